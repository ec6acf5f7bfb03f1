"""Reward-hacking diagnostics: does a grader pay for length rather than for quality?

Two numbers per grader (and for the total reward), from one step's scores, the completions' lengths and
the group layout (G consecutive rows per group), both measured within groups, where GRPO's advantages
are:

- len_corr: the Pearson correlation between score and length over a group's scored rows, averaged over
  groups. Groups with fewer than 3 scored rows, or with no spread in score or in length, are skipped.
  Near 0 on a healthy run; a value that climbs towards +1 says longer completions earn more.
- best_is_longest: the fraction of groups whose longest completion is among the best-scored (score ties
  count as best; with length ties, any of the longest will do). Only groups whose scored rows differ in
  score and in length count. With G distinct completions chance is about 1/G; a rate that climbs towards
  1 is the same warning.

Both come as a sum and a count (`x_sum`, `x_n`), so they add up over ranks before the division
(`rewards.registry.mean_metrics`). They are cheap, pure Python, and measure only association with
length: a task whose good answers really are longer shows the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _groups(scores: Sequence[float | None], lengths: Sequence[float], G: int):
    """Per group of G consecutive rows, the (score, length) pairs of its scored rows."""
    assert len(scores) == len(lengths) and G > 0 and len(scores) % G == 0, "rows must be whole groups of G"
    for k in range(0, len(scores), G):
        yield [(float(s), float(n)) for s, n in zip(scores[k : k + G], lengths[k : k + G]) if s is not None]


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson's r; None when either side has no spread."""
    if max(xs) == min(xs) or max(ys) == min(ys):
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))


def len_corr(scores: Sequence[float | None], lengths: Sequence[float], G: int) -> tuple[float, int]:
    """(sum over groups of the within-group Pearson r of score and length, groups counted)."""
    total, counted = 0.0, 0
    for pairs in _groups(scores, lengths, G):
        r = pearson([s for s, _ in pairs], [ln for _, ln in pairs]) if len(pairs) >= 3 else None
        if r is not None:
            total, counted = total + r, counted + 1
    return total, counted


def best_is_longest(scores: Sequence[float | None], lengths: Sequence[float], G: int) -> tuple[int, int]:
    """(groups whose longest completion is among the best-scored, groups counted); see the module docstring."""
    hits, counted = 0, 0
    for pairs in _groups(scores, lengths, G):
        ss, ls = [s for s, _ in pairs], [ln for _, ln in pairs]
        if len(pairs) < 2 or max(ss) == min(ss) or max(ls) == min(ls):
            continue
        hits += any(s == max(ss) and ln == max(ls) for s, ln in pairs)
        counted += 1
    return hits, counted


def hacking_totals(
    parts: dict[str, Sequence[float | None]], reward: Sequence[float | None], lengths: Sequence[float], G: int
) -> dict[str, float]:
    """For each grader of `parts` and for 'reward': 'len_corr/<name>_sum', '_n' and 'best_is_longest/<name>_sum',
    '_n', the same keys whatever the batch holds (sum them over ranks, then `mean_metrics`)."""
    out: dict[str, float] = {}
    for name, scores in {**parts, "reward": reward}.items():
        c_sum, c_n = len_corr(scores, lengths, G)
        b_sum, b_n = best_is_longest(scores, lengths, G)
        out |= {f"len_corr/{name}_sum": c_sum, f"len_corr/{name}_n": float(c_n)}
        out |= {f"best_is_longest/{name}_sum": float(b_sum), f"best_is_longest/{name}_n": float(b_n)}
    return out
