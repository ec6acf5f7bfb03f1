"""The C library's heap on the CPU (nanogrpo/infra/heap.py): a process that keeps its freed memory reuses a
step's blocks instead of faulting fresh pages in for them, and then hands nothing back; one that does not
hands the free pages back on request."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanogrpo.infra import heap
from nanogrpo.infra.heap import release_free_heap

ROOT = Path(__file__).resolve().parent.parent
STEPS = """
import resource, sys, torch
from nanogrpo.infra import heap
kept = heap.keep_freed_memory() if sys.argv[1] == "keep" else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a training step's activations: 48 blocks of 1-8 MiB, written, then freed
    xs = [torch.ones((1 + i % 8) << 18) for i in range(48)]
    del xs
step()
f0 = faults()
for _ in range(4):
    step()
print(kept, heap.release_free_heap(), (faults() - f0) // 4)
"""


def run_steps(mode: str, **env) -> tuple[str, str, int]:
    """(kept, trimmed, page faults per step) of four steps of allocations in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    kept, trimmed, faults = out.stdout.split()
    return kept, trimmed, int(faults)


def test_kept_memory_is_reused_not_faulted_in_again():
    """With glibc's defaults a step's 200 MiB of 1-8 MiB blocks come back as fresh pages (tens of thousands
    of faults a step); kept, they are reused (a few hundred), and the sampler's trims hand nothing back.
    NANOGRPO_KEEP_FREED=0 leaves the defaults."""
    if not heap._glibc("mallopt") or not heap._glibc("malloc_trim"):
        pytest.skip("not glibc: nothing to set")
    kept, trimmed, faults_kept = run_steps("keep")
    assert (kept, trimmed) == ("True", "False")
    kept, trimmed, faults_default = run_steps("default")
    assert (kept, trimmed) == ("False", "True")
    assert faults_default > 10_000 and faults_kept < faults_default / 5, (faults_kept, faults_default)
    assert run_steps("keep", NANOGRPO_KEEP_FREED="0")[:2] == ("False", "True")


def test_release_free_heap_gives_freed_pages_back(monkeypatch):
    """Freed blocks in the middle of glibc's heap stay resident until malloc_trim hands their pages back:
    the resident memory falls by most of what was freed (what keeps the packed copies of one call and the
    activations of the next from adding up in the step's peak)."""
    monkeypatch.setattr(heap, "_keeping", False)  # as in a process that did not keep its memory
    if not release_free_heap():
        pytest.skip("this C library has no malloc_trim")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    release_free_heap()
    # 200 MiB of 64 KiB blocks: under glibc's mmap threshold, so from the heap
    blocks = [bytearray(b"\x01") * (64 * 1024) for _ in range(3200)]
    keep = blocks[::64]  # a few live blocks across the range: the heap's top cannot simply shrink
    del blocks
    before = rss()
    release_free_heap()
    assert before - rss() > 150 * 2**20, (before, rss())
    del keep
