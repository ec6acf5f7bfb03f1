"""Rank agreement between a grader's scores and a person's: Kendall's tau-b and pairwise accuracy
within groups. Plain numpy, O(n^2); `python -m rewards.grade` reports both, and nanogrpo.eval.stats
offers them beside the other evaluation statistics."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b (tie-corrected rank correlation); nan when either side is constant. O(n^2)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    sx = np.sign(x[:, None] - x[None, :])  # (n, n)
    sy = np.sign(y[:, None] - y[None, :])  # (n, n)
    iu = np.triu_indices(len(x), k=1)
    sx, sy = sx[iu], sy[iu]
    denom = math.sqrt(float(np.count_nonzero(sx)) * float(np.count_nonzero(sy)))
    return float((sx * sy).sum() / denom) if denom > 0 else float("nan")


def pairwise_accuracy(scores: Sequence[float], human: Sequence[float], groups: Sequence) -> tuple[float, int]:
    """Within each group, the fraction of pairs the human ranks strictly that the grader orders the same
    way (a grader tie counts half). Returns (accuracy, number of pairs); accuracy is nan with no pairs."""
    by_group: dict = {}
    for s, h, g in zip(scores, human, groups):
        by_group.setdefault(g, []).append((s, h))
    hits, pairs = 0.0, 0
    for items in by_group.values():
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (si, hi), (sj, hj) = items[i], items[j]
                if hi == hj:
                    continue
                pairs += 1
                hits += 0.5 if si == sj else float((si - sj) * (hi - hj) > 0)
    return (hits / pairs if pairs else float("nan")), pairs
