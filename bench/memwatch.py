"""Memory of a benchmark process: RSS now, and a background thread that records the peak RSS of a window
(plus the CUDA peak on a GPU)."""

from __future__ import annotations

import os
import resource
import threading


def rss_bytes() -> int:
    """Resident set size of this process now (/proc on Linux, else psutil)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


class MemoryMonitor:
    def __init__(self, every_s: float = 0.01):
        self.every_s = every_s
        self.base = self.peak = 0
        self._on = False
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self._on:
                self.peak = max(self.peak, rss_bytes())

    def start(self) -> None:
        """Called once, right before the first step (after the model and optimizer exist)."""
        import torch

        if self._on:
            return
        self.base = self.peak = rss_bytes()
        self._on = True
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def result(self) -> dict:
        import torch

        self._stop.set()
        self.peak = max(self.peak, rss_bytes())
        out = {
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
            "step_rss_gib": (self.peak - self.base) / 2**30,
        }
        if torch.cuda.is_available():
            out["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return out
