"""The C library's heap on the CPU: keep freed memory for the next step, or hand it back to the system.

PyTorch's CPU tensors come from malloc, and a training step allocates and frees the same activations
every step. With glibc's defaults a block over the mmap threshold (128 KiB at first, raised as such
blocks are freed, to 32 MiB at most) gets fresh pages from the system and returns them when freed, and
the free top of the heap past the trim threshold is returned too; every page returned is faulted in and
zeroed again at its next use: a GRPO step faults in gigabytes of pages, and a large share of `make demo`'s
CPU time went to the kernel (docs/BENCHMARKS.md).

`keep_freed_memory()`, which a CPU run's start-up checks (startup.check_run) and eval.py's model loading
call, sets the mmap threshold to its 32 MiB maximum and the trim threshold out of reach, so one step's freed blocks serve the next: a shorter
step for a slightly higher peak (docs/BENCHMARKS.md). Blocks over 32 MiB still come from the system each time; the log-prob
head's tiles stay under it (nanogrpo_kernels/logprobs.py).
`release_free_heap()` is the opposite (malloc_trim): the free pages back to the system, so that the
resident memory falls to what is live; it does nothing in a process that keeps its memory.

Elsewhere than glibc (musl, macOS, Windows) neither does anything.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt's parameters (glibc's malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest mmap threshold on 64-bit
TRIM_THRESHOLD = (1 << 31) - 1  # the largest an int holds: the heap's top is never trimmed
TOP_PAD = 64 << 20  # the heap grows 64 MiB beyond each request: fewer brk calls

_keeping = False


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The process's C library, where it can be opened this way (not on Windows)."""
    try:
        return ctypes.CDLL(None)
    except (OSError, TypeError):
        return None


def _glibc(name: str) -> Callable[..., int] | None:
    """A function of glibc's malloc (mallopt, malloc_trim), or None where the C library has none."""
    lib = _libc()
    return getattr(lib, name, None) if lib is not None else None


def keep_freed_memory() -> bool:
    """Keep freed blocks up to 32 MiB in the heap and never trim its top, for the rest of the process.
    False (nothing changed) where the C library is not glibc, or NANOGRPO_KEEP_FREED=0 (glibc's defaults,
    and the sampler's trims: the lowest peak memory)."""
    global _keeping
    if os.environ.get("NANOGRPO_KEEP_FREED", "1") == "0":
        return False
    mallopt = _glibc("mallopt")
    if mallopt is None or _glibc("malloc_trim") is None:  # musl has neither; macOS has no mallopt
        return False
    ok = all(
        mallopt(param, value) == 1
        for param, value in [
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
        ]
    )
    _keeping = _keeping or ok
    return ok


def keeps_freed_memory() -> bool:
    """keep_freed_memory() has taken effect in this process."""
    return _keeping


def release_free_heap() -> bool:
    """Give the pages of freed memory in glibc's heaps back to the system (malloc_trim(0)): the process's
    resident memory falls to what is live. False where nothing was handed back: the C library cannot, or
    this process keeps its freed memory (keep_freed_memory)."""
    trim = _glibc("malloc_trim")
    if trim is None or _keeping:
        return False
    trim(0)
    return True
