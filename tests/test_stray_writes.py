"""Nothing written where the user did not point, and what is written readable as any other file: the git read of
environment.json takes no lock in the user's checkout, compiled decoding keeps inductor's files (the C++
precompiled headers included) under nanogrpo's cache folder, and weights and run files get the umask's mode."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, run_train_here

from nanogrpo.infra import provenance

GIT = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]


def git_repo(path: Path) -> Path:
    """A git work tree that tracks nanogrpo/__init__.py, whose file then looks changed to git's stat check
    (same content, a new mtime): a `git status` that may write refreshes the index, taking index.lock."""
    path.mkdir()
    (path / "nanogrpo").mkdir()
    (path / "nanogrpo" / "__init__.py").write_text("x = 1\n")
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "one"]):
        subprocess.run([*GIT, "-C", str(path), *cmd], check=True, capture_output=True)
    t = os.stat(path / "nanogrpo" / "__init__.py").st_mtime + 5
    os.utime(path / "nanogrpo" / "__init__.py", (t, t))
    return path


def index_state(repo: Path) -> tuple:
    st = (repo / ".git" / "index").stat()
    return st.st_ino, st.st_mtime_ns, st.st_size


def test_git_state_reads_the_checkout_without_writing_its_index(tmp_path):
    repo = git_repo(tmp_path / "repo")
    before = index_state(repo)
    state = provenance.git_state(repo)
    assert state is not None and not state["dirty"] and len(state["commit"]) == 40
    assert index_state(repo) == before and not (repo / ".git" / "index.lock").exists()


def test_a_train_run_leaves_the_checkouts_git_untouched(tmp_path, monkeypatch):
    """A whole train.py run (environment.json reads the checkout's commit) against a checkout whose index a
    plain `git status` would rewrite: the index is the same file after, no git call could take index.lock,
    and the run's folder is the only thing written (the current folder stays empty)."""
    repo = git_repo(tmp_path / "repo")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    calls = []
    real = subprocess.run

    def recording(cmd, *args, **kwargs):
        if isinstance(cmd, list) and cmd and cmd[0] == "git":
            calls.append((cmd, (kwargs.get("env") or os.environ).get("GIT_OPTIONAL_LOCKS")))
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(provenance, "ROOT", repo)
    monkeypatch.setattr(provenance.subprocess, "run", recording)
    before = index_state(repo)
    here = tmp_path / "cwd"
    here.mkdir()
    res = run_train_here("tiny", "--steps", "1", "--no-plots", "--out-dir", tmp_path / "run", cwd=here)
    assert res.returncode == 0, res.stderr[-2000:]
    assert calls and all("--no-optional-locks" in c and lock == "0" for c, lock in calls), calls
    env = json.loads((tmp_path / "run" / "environment.json").read_text())
    assert env["git"] == {"commit": head.stdout.strip(), "dirty": False}
    assert index_state(repo) == before and not (repo / ".git" / "index.lock").exists()
    assert list(here.iterdir()) == []


def test_precompiled_headers_go_to_nanogrpos_cache_folder(tmp_path, monkeypatch):
    """Inductor keeps its C++ precompiled headers (~150 MB each) in /tmp/torchinductor_$USER whatever
    TORCHINDUCTOR_CACHE_DIR says; the compiled decode step's cache folder takes them too, as it does when
    the user names one. Checked where inductor reads it, without a compile."""
    from torch._inductor import codecache

    from nanogrpo.infra import model_cache

    monkeypatch.setattr(codecache, "_HEADER_DIR", codecache._HEADER_DIR)  # put back after the test
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", codecache._HEADER_LOCK_DIR)
    monkeypatch.setenv("NANOGRPO_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    model_cache.private_inductor_cache()
    folder = tmp_path / "inductor-default"
    assert codecache._HEADER_DIR == str(folder / "precompiled_headers")
    assert codecache._HEADER_LOCK_DIR == str(folder / "precompiled_headers" / "locks")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))
    model_cache.private_inductor_cache()
    assert codecache._HEADER_DIR == str(tmp_path / "chosen" / "precompiled_headers")


@pytest.mark.slow
def test_a_compile_writes_nothing_to_the_system_temp_folder(tmp_path):
    """A real compile in a fresh interpreter whose temp folder is empty: after it, still empty (no
    torchinductor_<user>, no precompiled header), and the header is in nanogrpo's cache folder. ~7 s with a
    warm cache (the header is built once per cache: ~20 s more the first time); a random constant makes the
    kernel new, so inductor compiles C++ every time."""
    tmp, cache = tmp_path / "tmp", Path(os.environ.get("NANOGRPO_CACHE") or tmp_path / "cache")
    tmp.mkdir()
    code = (
        "import torch\nfrom nanogrpo.infra.model_cache import private_inductor_cache\n"
        "private_inductor_cache()\n"
        f"f = torch.compile(lambda x: (x.sin() * {random.random()}).sum(), fullgraph=True)\n"
        "print(float(f(torch.ones(8))))\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp), "NANOGRPO_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("ATEN_CPU_CAPABILITY", None)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert list(tmp.iterdir()) == []
    assert list((cache / "inductor-default" / "precompiled_headers").glob("*.gch"))


@pytest.fixture
def umask_002():
    old = os.umask(0o002)  # a group's umask: what a shared cache or run folder is made with
    try:
        yield
    finally:
        os.umask(old)


def modes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): oct(stat.S_IMODE(p.stat().st_mode))
        for p in folder.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def test_weights_and_run_files_get_the_umasks_mode(tmp_path, umask_002):
    """Under umask 002 every file of a run folder is 0664: the checkpoint's and the final adapter's weights
    (safetensors alone writes 0600), the logs and config.json (opened 0644 before)."""
    out = tmp_path / "run"
    res = run_train_here(
        "tiny", "--steps", "2", "--save-every", "1", "--no-plots", "--out-dir", out, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-2000:]
    got = modes(out)
    assert "adapter/adapter_model.safetensors" in got and any(k.startswith("ckpt/step_") for k in got)
    assert {k: v for k, v in got.items() if v != "0o664"} == {}


def test_each_weights_writer_gives_0644_under_umask_022(tmp_path):
    """The adapter (PEFT layout), a full fine-tune's weights, a stacked adapter and a probe, under the usual
    umask 022: 0644, as any file the user makes."""
    from nanogrpo.infra.checkpoint import write_full_weights
    from nanogrpo.model import lora
    from rewards.probe import Probe

    old = os.umask(0o022)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        lora.inject_lora(model, 2, 4.0, 0.0, ["0"])
        lora.save_adapter(model, tmp_path / "a")
        lora.save_adapter(model, tmp_path / "b")
        lora.stack_adapters(tmp_path / "a", tmp_path / "b")
        (tmp_path / "full").mkdir()
        write_full_weights({"w": torch.zeros(3)}, tmp_path / "full")
        t = {"weight": torch.zeros(4), "bias": torch.zeros(()), "mean": torch.zeros(4), "std": torch.ones(4)}
        Probe(t, {"layer": 1, "threshold": 0.5, "dev_log_loss_per_layer": [float("nan")]}).save(
            tmp_path / "p"
        )
    finally:
        os.umask(old)
    assert set(modes(tmp_path).values()) == {"0o644"}, modes(tmp_path)
    meta = json.loads((tmp_path / "p" / "probe.json").read_text(), parse_constant=_not_json)
    assert meta["dev_log_loss_per_layer"] == [None]  # strict JSON: the NaN is written as null


def _not_json(name: str):
    raise AssertionError(f"probe.json holds {name}, which is not JSON")
