"""The model cache on a newcomer's machine (nanogrpo/infra/model_cache.py): a torchrun first run builds a
complete model, a half-built or damaged folder is rebuilt, a killed build leaves the next run working, and
concurrent first users wait for one build. Every test starts from its own empty cache."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import free_port

from nanogrpo.infra.model_cache import MANIFEST, why_incomplete
from nanogrpo.model.transformer import Transformer
from nanogrpo.model.zoo import TINY_VERSION, load_tokenizer, resolve_model

ROOT = Path(__file__).resolve().parents[1]


def _env(cache: Path) -> dict:
    return {**os.environ, "NANOGRPO_CACHE": str(cache), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _loads(folder: Path) -> None:
    """What a run does with the folder: the weights, the tokenizer and its chat template."""
    model = Transformer.from_pretrained(folder)
    assert model.model.embed_tokens.weight.shape == (1024, 64)
    tok = load_tokenizer(folder)
    assert tok.eos_token_id == 2 and tok.chat_template


def _temporaries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir() and p.name.startswith("."))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One tiny model built into a cache of its own: the tests below copy it (with its files' times)."""
    cache = tmp_path_factory.mktemp("built")
    subprocess.run([sys.executable, "-m", "nanogrpo.model.zoo", "tiny"], env=_env(cache), check=True)
    return cache / TINY_VERSION


def test_torchrun_first_run_on_an_empty_cache_builds_a_complete_model(tmp_path, monkeypatch) -> None:
    """Rank 1 builds first, with the process group up (where transformers' save_pretrained writes no weights
    on a rank other than 0); rank 0 then finds the folder complete, and so does a plain process."""
    script = tmp_path / "ranks.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "from nanogrpo.model.zoo import resolve_model\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n"
        "    resolve_model('tiny')\n"
        "dist.barrier()\n"
        "if dist.get_rank() == 0:\n"
        "    resolve_model('tiny')\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    port = free_port()
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(script)]  # fmt: skip
    run = subprocess.run(cmd, env=_env(cache), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("nanogrpo: building") == 1, run.stderr[-3000:]
    folder = cache / TINY_VERSION
    assert why_incomplete(folder) is None
    monkeypatch.setenv("NANOGRPO_CACHE", str(cache))
    assert resolve_model("tiny") == folder
    _loads(folder)


def _truncate(f: Path) -> None:
    os.truncate(f, f.stat().st_size // 2)


def _corrupt_in_place(f: Path) -> None:
    with open(f, "r+b") as fh:  # the same size, other bytes
        fh.seek(f.stat().st_size - 64)
        fh.write(b"\x7f" * 64)


DAMAGE = {
    "config.json missing": lambda d: (d / "config.json").unlink(),
    "weights truncated": lambda d: _truncate(d / "model.safetensors"),
    "weights changed at the same size": lambda d: _corrupt_in_place(d / "model.safetensors"),
    "no manifest (a folder of an earlier nanogrpo)": lambda d: (d / MANIFEST).unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_half_built_or_damaged_folder_is_moved_aside_and_rebuilt(built, tmp_path, monkeypatch, capfd, damage):
    cache = tmp_path / "cache"
    folder = cache / TINY_VERSION
    shutil.copytree(built, folder)
    DAMAGE[damage](folder)
    assert why_incomplete(folder) is not None
    monkeypatch.setenv("NANOGRPO_CACHE", str(cache))
    assert resolve_model("tiny") == folder
    err = capfd.readouterr().err
    assert f"{folder} is not a complete model" in err and f"{TINY_VERSION}.damaged" in err, err
    assert why_incomplete(folder) is None and (cache / f"{TINY_VERSION}.damaged").is_dir()
    _loads(folder)
    assert resolve_model("tiny") == folder and "building" not in capfd.readouterr().err  # built once


def test_a_plain_file_in_the_models_place_is_moved_aside(built, tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / TINY_VERSION).write_text("not a model")
    monkeypatch.setenv("NANOGRPO_CACHE", str(cache))
    _loads(resolve_model("tiny"))
    assert (cache / f"{TINY_VERSION}.damaged").read_text() == "not a model"


# a first run whose build sleeps once its files are written (before the manifest and the rename: the widest
# window), after it has written a marker; then it is killed there
KILLED_BUILD = """
import sys, time
from pathlib import Path
import nanogrpo.model.zoo as zoo
build = zoo._build_tiny
def slow(out):
    build(out)
    Path(sys.argv[1]).touch()
    time.sleep(300)
zoo._build_tiny = slow
zoo.resolve_model("tiny")
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_build_killed_midway_leaves_the_next_run_working(tmp_path, monkeypatch, sig) -> None:
    cache, marker = tmp_path / "cache", tmp_path / "written"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_BUILD, str(marker)], env=_env(cache))
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the build never reached its files"
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert _temporaries(cache), "the killed build left no temporary folder: the test killed nothing"
    assert not (cache / TINY_VERSION).exists()
    monkeypatch.setenv("NANOGRPO_CACHE", str(cache))
    _loads(resolve_model("tiny"))
    assert _temporaries(cache) == [], "the next build did not clean the killed one's folder"


# a first run that counts its builds in a shared log and takes its time, so two of them overlap
COUNTED_BUILD = """
import os, sys, time
import nanogrpo.model.zoo as zoo
from nanogrpo.model.transformer import Transformer
build = zoo._build_tiny
def counted(out):
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(2)
    build(out)
zoo._build_tiny = counted
Transformer.from_pretrained(zoo.resolve_model("tiny"))
"""


def test_two_concurrent_first_runs_both_succeed_with_one_build(tmp_path) -> None:
    cache, log = tmp_path / "cache", tmp_path / "builds.log"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", COUNTED_BUILD, str(log)], env=_env(cache), stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    errs = [p.communicate(timeout=180)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert len(log.read_text().split()) == 1, f"built more than once: {log.read_text()!r}"
    assert why_incomplete(cache / TINY_VERSION) is None and _temporaries(cache) == []


def test_a_cache_that_cannot_be_written_is_one_clear_error(tmp_path, monkeypatch) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("NANOGRPO_CACHE", str(not_a_folder))
    with pytest.raises(ValueError, match=f"cannot write the model cache {not_a_folder}.*NANOGRPO_CACHE"):
        resolve_model("tiny")
