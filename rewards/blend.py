"""What acts on the graders' scores before they blend into one reward: the gates of --reward.gate and the
per-group z-scores of --reward.aggregate normalize-then-sum.

rewards/registry.py's RewardFunction applies them in this order for each mix: gates, then
normalize-then-sum, then the weighted sum with its None rule (rewards/base.py's `combine`; see registry.py's
module docstring and docs/STABILITY.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

AGGREGATES = ("sum", "normalize-then-sum")
GATE_FORM = (
    "'A<B' (A counts where B scores >= 1) or 'A<B>=0.5', several separated by ';', e.g. 'rouge_l<format'"
)


def normalize_in_groups(scores: Sequence[float | None], groups: Sequence[int]) -> list[float | None]:
    """Each score z-scored within its group (rows sharing `groups[i]`): (s - mean) / std over the group's
    scored rows (std unbiased, as the advantages). None stays None and is left out of the statistics; a
    group with fewer than 2 scored rows, or whose scores are all equal, gets exactly 0."""
    by_group: dict[int, list[int]] = {}
    for i, (s, g) in enumerate(zip(scores, groups)):
        if s is not None:
            by_group.setdefault(g, []).append(i)
    out = list(scores)
    for idx in by_group.values():
        vals = [scores[i] for i in idx]
        n, mean = len(vals), sum(vals) / len(vals)
        spread = n >= 2 and max(vals) > min(vals)  # exact equality, as the advantages' zero-spread flag
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if spread else 0.0
        for i, v in zip(idx, vals):
            out[i] = (v - mean) / std if spread else 0.0
    return out


@dataclass(frozen=True)
class Gate:
    """'A<B>=t': grader A's score counts only on rows where grader B scores at least t."""

    target: str
    gate: str
    threshold: float = 1.0

    @property
    def key(self) -> str:
        return f"{self.target}<{self.gate}" + ("" if self.threshold == 1.0 else f">={self.threshold:g}")


def parse_gates(text: str) -> list[Gate]:
    """'rouge_l<format; judge<numbers>=0.5' -> [Gate('rouge_l', 'format', 1.0), Gate('judge', 'numbers', 0.5)]."""
    out: list[Gate] = []
    for part in re.split(r"[;,]", text):
        part = part.strip()
        if not part:
            continue
        target, sep, rest = part.partition("<")
        gate, has_t, t = rest.partition(">=")
        target, gate = target.strip(), gate.strip()
        if not (sep and target and gate) or any(c in gate + target for c in "<>="):
            raise ValueError(f"--reward.gate: cannot read {part!r}; write {GATE_FORM}")
        try:
            threshold = float(t) if has_t else 1.0
        except ValueError:
            threshold = math.nan
        if not math.isfinite(threshold):
            raise ValueError(
                f"--reward.gate: threshold {t.strip()!r} in {part!r} is not a number; write {GATE_FORM}"
            )
        if target == gate:
            raise ValueError(f"--reward.gate: {part!r} gates '{target}' on itself; name another grader as B")
        out.append(Gate(target, gate, threshold))
    return out


def apply_gates(
    components: dict[str, list[float | None]], gates: Sequence[Gate]
) -> tuple[dict[str, list[float | None]], list[tuple[int, int]]]:
    """The components with each gate applied: A becomes 0.0 where B scored below the threshold (A None stays
    None; B None, B not applying, leaves A as it is). Gates read B's own score, not B after its gates.
    Also, per gate, (rows it closed, rows A scored)."""
    out, counts = dict(components), []
    for g in gates:
        a, b = list(out[g.target]), components[g.gate]
        shut = [
            i for i, (x, y) in enumerate(zip(a, b)) if x is not None and y is not None and y < g.threshold
        ]
        for i in shut:
            a[i] = 0.0
        out[g.target] = a
        counts.append((len(shut), sum(x is not None for x in components[g.target])))
    return out, counts
