"""What a run ran on: RUN/environment.json, written by rank 0 when the run starts.

config.json says what was asked (`--model.device auto`, `--model.dtype auto`) and stays a TrainConfig that
`--resume` and `--config` load; environment.json says what that resolved to and with which code: the
device and compute dtype, the versions of Python, torch, transformers and nanogrpo, the git commit of the
nanogrpo checkout (and whether its tree had changes; null outside a git checkout), the CPU capability line
(nanogrpo/infra/cpu.py) and the environment variables that change the kernels. A resumed run writes its own start
on top and keeps the earlier ones under "earlier", so a run continued on another machine says so.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

from nanogrpo.infra import dist
from nanogrpo.infra.cpu import cpu_capability
from nanogrpo.infra.heap import keeps_freed_memory
from nanogrpo.infra.metrics import replace_atomically

ROOT = Path(__file__).resolve().parents[2]  # the checkout nanogrpo runs from (a git work tree, or not)
PACKAGES = ("nanogrpo", "torch", "transformers", "tokenizers", "numpy", "triton", "peft")
# set in the environment, these change which kernels run or how many threads they use (nanogrpo/infra/cpu.py),
# or, NANOGRPO_KEEP_FREED and glibc's MALLOC_ARENA_MAX, how much memory a CPU run holds (nanogrpo/infra/heap.py)
ENV_VARS = (
    "NANOGRPO_KERNELS",
    "NANOGRPO_PACKED",
    "NANOGRPO_PACKED_FP32",
    "NANOGRPO_KEEP_FREED",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "OMP_NUM_THREADS",
    "MALLOC_ARENA_MAX",
    "CUDA_VISIBLE_DEVICES",
)


def version(package: str) -> str | None:
    """The installed version of package, or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_state(root: Path | None = None, probe: str = "nanogrpo/__init__.py") -> dict | None:
    """{'commit': HEAD's sha, 'dirty': whether tracked or untracked files differ from it} of the git work
    tree at root (default ROOT); None when root is not in one, or git does not track `probe` there (an
    installed copy in a virtual environment inside some other repository), or git is not installed.

    Read only: `git status` would otherwise refresh the index, taking .git/index.lock while it writes it,
    and a git command of the user's at that moment fails ("index.lock: File exists"). --no-optional-locks
    (and GIT_OPTIONAL_LOCKS=0 for a git that predates the flag) skips that write."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> str:
        cmd = ["git", "--no-optional-locks", "-C", str(root or ROOT), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True, env=env).stdout

    try:
        git("ls-files", "--error-unmatch", "--", probe)  # raises outside a checkout that holds it
        commit = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain").strip())
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    """What this process runs on and with: the resolved device and dtype, versions, commit, CPU."""
    dev = torch.device(device)
    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "argv": sys.argv,
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "world_size": dist.world(),
        "cpu": str(cpu_capability()),
        "torch_threads": torch.get_num_threads(),
        "heap_kept": keeps_freed_memory(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {p: version(p) for p in PACKAGES} | {"cuda": torch.version.cuda},
        "git": git_state(),
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }


def write_environment(out: Path, device: torch.device, dtype: torch.dtype, resume: bool = False) -> dict:
    """Write out/environment.json for this start (resume: the file's earlier starts kept under 'earlier',
    oldest first); returns what it wrote."""
    path = Path(out) / "environment.json"
    env = environment(device, dtype)
    if resume and path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict):
            env["earlier"] = [*old.pop("earlier", []), old]
    replace_atomically(path, json.dumps(env, indent=2))
    return env
