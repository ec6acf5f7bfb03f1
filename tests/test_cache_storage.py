"""Storage faults under the model cache (nanogrpo/infra/model_cache.py): a read-only cache, a full disk and
NANOGRPO_CACHE naming a file each stop train.py with exit status 2 and one line naming the folder and the
fix, before any step, and leave no half-built model behind. Faults are simulated in this process (the suite
may run as root, whom a read-only mode does not stop)."""

from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path

import pytest
from helpers import run_train_here


def _fault(code: int, path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


def _under(path, root: Path) -> bool:
    try:
        return Path(os.fspath(path)).absolute().is_relative_to(root)
    except TypeError:  # a file descriptor
        return False


def read_only(monkeypatch, root: Path) -> None:
    """Every write under root fails as on a read-only mount: new folders, files opened to write, os.open."""
    real_open, real_mkdir, real_builtin = os.open, os.mkdir, builtins.open
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def os_open(path, flags, *a, **k):
        if _under(path, root) and flags & writes:
            raise _fault(errno.EROFS, path)
        return real_open(path, flags, *a, **k)

    def mkdir(path, *a, **k):
        if _under(path, root):
            raise _fault(errno.EROFS, path)
        return real_mkdir(path, *a, **k)

    def open_(path, mode="r", *a, **k):
        if _under(path, root) and any(c in mode for c in "wax+"):
            raise _fault(errno.EROFS, path)
        return real_builtin(path, mode, *a, **k)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(builtins, "open", open_)


def full_disk_in_safetensors(monkeypatch) -> None:
    """What safetensors raises when the disk fills as it writes the weights: its own error, not an OSError."""
    import safetensors.torch
    from safetensors import SafetensorError

    def save_file(tensors, path, *a, **k):
        raise SafetensorError(
            f'Error while serializing: I/O error: No space left on device (os error 28) at path "{path}"'
        )

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def full_disk_in_json(monkeypatch, root: Path) -> None:
    """The disk fills when the build writes a JSON file (config.json, the tokenizer's)."""
    real = builtins.open

    def open_(path, mode="r", *a, **k):
        if _under(path, root) and "w" in mode and str(path).endswith(".json"):
            raise _fault(errno.ENOSPC, path)
        return real(path, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", open_)


CASES = {
    "read-only": ("Read-only file system", "a folder you can write"),
    "full-safetensors": ("No space left on device", "Free space there"),
    "full-json": ("No space left on device", "Free space there"),
    "a-file": ("File exists", "is a file, not a folder"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_cache_fault_is_one_line_naming_the_folder_and_the_fix(case, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOGRPO_CACHE", str(cache))
    if case == "a-file":
        cache.write_text("")
    else:
        cache.mkdir()
    if case == "read-only":
        read_only(monkeypatch, cache)
    elif case == "full-safetensors":
        full_disk_in_safetensors(monkeypatch)
    elif case == "full-json":
        full_disk_in_json(monkeypatch, cache)
    here = tmp_path / "cwd"
    here.mkdir()
    res = run_train_here("tiny", "--steps", "1", "--out-dir", tmp_path / "run", cwd=here)
    cause, fix = CASES[case]
    err = [ln for ln in res.stderr.splitlines() if not ln.startswith("nanogrpo: building")]
    assert res.returncode == 2 and len(err) == 1, res.stderr[-3000:]
    assert err[0].startswith(f"error: cannot write the model cache {cache}: {cause}. ") and fix in err[0]
    assert "NANOGRPO_CACHE" in err[0] and "Traceback" not in res.stderr
    if cache.is_dir():  # no half-built model left to mistake for one: at most the build's lock file
        assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    assert list(here.iterdir()) == []
