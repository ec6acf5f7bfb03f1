"""Small helpers the test files share: writing JSONL rows, running eval.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_rows(path: Path, rows: list[dict]) -> Path:
    """`rows` as a JSONL file at `path` (returned)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_eval(*args, cwd, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python eval.py ARGS` in `cwd`, output captured: in this process (eval.run: the command line's exit
    status and one-line errors, no interpreter to start), or with `fresh` in a new one."""
    if fresh:
        return subprocess.run(
            [sys.executable, str(ROOT / "eval.py"), *map(str, args)], cwd=cwd, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
    import eval as eval_py

    return _in_process(eval_py.run, "eval.py", args, cwd)


def _in_process(run, name: str, args, cwd: Path) -> subprocess.CompletedProcess:
    """run([args]) as `python NAME ARGS` would: in `cwd`, stdout and stderr captured, the exit status (a
    flag tyro refuses exits with its status and message, as the command would)."""
    import io
    import os

    out, err = io.StringIO(), io.StringIO()
    here = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = run([str(a) for a in args])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess([name, *map(str, args)], code, out.getvalue(), err.getvalue())


def packing_params() -> list:
    """pytest params (dtype, fp32 packer) for each way this CPU packs the sampler's weights: bf16 for oneDNN
    (packer None), float32 for oneDNN ('onednn') and for MKL ('mkl'); each skipped, saying why, where it does
    not run here or NANOGRPO_PACKED=0. `use_packer` makes the packer the one in use."""
    import os

    import pytest
    import torch

    from nanogrpo.infra.cpu import cpu_capability

    cap = cpu_capability()
    off = os.environ.get("NANOGRPO_PACKED") == "0"
    ways = [
        ("bf16", torch.bfloat16, None, cap.onednn_bf16),
        ("fp32-onednn", torch.float32, "onednn", cap.onednn_fp32),
    ]
    ways.append(("fp32-mkl", torch.float32, "mkl", cap.mkl_packed_fp32))
    why = lambda name: "NANOGRPO_PACKED=0" if off else f"no {name} packing on this CPU: {cap}"  # noqa: E731
    return [
        pytest.param(dtype, packer, id=name, marks=pytest.mark.skipif(off or not runs, reason=why(name)))
        for name, dtype, packer, runs in ways
    ]


def use_packer(monkeypatch, packer: str | None) -> None:
    """Pack float32 weights with `packer` ('onednn' or 'mkl') for the rest of the test; None: this CPU's
    default."""
    if packer is None:
        monkeypatch.delenv("NANOGRPO_PACKED_FP32", raising=False)
    else:
        monkeypatch.setenv("NANOGRPO_PACKED_FP32", packer)


def run_train_here(*args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in this process (train.run), for the runs a test only checks the outcome of."""
    import train

    return _in_process(train.run, "train.py", args, cwd)


@contextlib.contextmanager
def train_py_here():
    """While open, `subprocess.run([python, train.py, ARGS...], ...)` runs train.run(ARGS) in this process
    (its exit status; its output printed, or written to the file given as stdout), for the tests of a driver
    that starts train.py once per run (eval.py seeds, the RLVRR table): each run then costs no interpreter
    start (~3 s of imports). Every other command runs as before."""
    real = subprocess.run

    def run(cmd, *args, **kwargs):
        if not (isinstance(cmd, (list, tuple)) and len(cmd) > 1 and Path(str(cmd[1])).name == "train.py"):
            return real(cmd, *args, **kwargs)
        res = run_train_here(*cmd[2:], cwd=Path(kwargs.get("cwd") or Path.cwd()))
        sink = kwargs.get("stdout")
        if hasattr(sink, "write"):
            sink.write(res.stdout + res.stderr)
        else:
            print(res.stdout, end="")
            print(res.stderr, end="", file=sys.stderr)
        return subprocess.CompletedProcess(cmd, res.returncode)

    subprocess.run = run
    try:
        yield
    finally:
        subprocess.run = real


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a server or a torchrun rendezvous a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM to the process group a test started (start_new_session=True), SIGKILL if it lingers."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
