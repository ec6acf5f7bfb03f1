"""The numbers grader of guide 001: are the reference's key figures in the answer?

Rules, as the guide states them:
- The key figures are the numbers of the reference: decimals, percentages, amounts; list numbering
  ('1.', '2)' at the start of a line) is not a figure, in the reference or in the answer. A figure
  written twice counts once.
- Units are aligned before comparing: 1,705M == 1.705B == 1705 million (K, M, B/bn, T and the words;
  see rewards/text.py for what is read as a number).
- Each figure is matched to the closest number in the answer, by relative error |a - r| / |r|:
  within 1% earns 1, within 5% earns 0.5, beyond that 0 (--reward.numbers-full / numbers-half).
- The score is the mean over the figures; a reference without figures gives None (the row is skipped).

Where the guide is silent: a percentage is compared by its number (9.91% vs 9.95 or 9.95%), so the
'%' sign alone never makes a figure wrong; a reference figure of 0 needs an exact 0; the answer is the
completion without its think block (or --reward.text-tag's content).

Figures are compared exactly, in decimal: |a - r| <= 0.01 |r| with no float rounding, so 1.01 against
1.00 is exactly 1% off, a 400-digit figure is not inf, and two figures 1e-27 apart stay two figures. A
digit run longer than rewards.text.MAX_DIGITS is not a figure. The closest answer number is found by
bisection in the sorted answer numbers, so a call costs O((R + A) log A) for R reference figures and A
answer numbers, never R * A.
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_left
from decimal import Decimal, localcontext

from rewards.base import Grader, Sample, check_text_field
from rewards.options import RewardConfig
from rewards.registry import register
from rewards.text import EXACT, figure_values, reply_text


def key_figures(text: str) -> list[Decimal]:
    """The distinct figures of a text, exact, units applied, in order of first appearance."""
    return figure_values(text)


def figure_credits(
    refs: list[Decimal], answer: list[Decimal], full: float | Decimal = 0.01, half: float | Decimal = 0.05
) -> list[float]:
    """Credit of each reference figure: 1, 0.5 or 0 by the relative error of the closest number of
    `answer`, which must be sorted ascending. Exact: the bands are compared in decimal arithmetic."""
    if not answer:
        return [0.0] * len(refs)
    full, half = Decimal(str(full)), Decimal(str(half))
    last = len(answer) - 1
    out = []
    with localcontext(EXACT):  # every figure fits: no rounding, no overflow
        for r in refs:
            i = bisect_left(answer, r)  # the closest number is one of the two neighbours of r
            err = min(abs(answer[max(i - 1, 0)] - r), abs(answer[min(i, last)] - r))
            scale = abs(r)  # |a - r| <= tol |r|: no division, and a reference 0 needs an exact 0
            out.append(1.0 if err <= full * scale else 0.5 if err <= half * scale else 0.0)
    return out


_reference_figures = functools.lru_cache(maxsize=256)(key_figures)  # read-only: never mutate a result


class Numbers(Grader):
    requires = ("reference",)

    def __init__(self, cfg: RewardConfig):
        if not (0 <= cfg.numbers_full <= cfg.numbers_half < math.inf):
            raise ValueError(
                f"--reward.numbers-full ({cfg.numbers_full}) must be >= 0 and <= --reward.numbers-half "
                f"({cfg.numbers_half}), which must be finite; the guide uses 0.01 and 0.05"
            )
        self.cfg = cfg
        self.full, self.half = Decimal(str(cfg.numbers_full)), Decimal(str(cfg.numbers_half))

    def check_row(self, row):
        return check_text_field(row, "reference")

    def score(self, batch: list[Sample]) -> list[float | None]:
        cfg = self.cfg
        out: list[float | None] = []
        for s in batch:
            ref = s.row.get("reference")
            if not isinstance(ref, str):
                out.append(None)
                continue
            figs = _reference_figures(ref)  # the G completions of a prompt share one reference
            if not figs:
                out.append(None)
                continue
            got = sorted(key_figures(reply_text(s.completion, cfg.text_tag, cfg.think_tag)))
            out.append(sum(figure_credits(figs, got, self.full, self.half)) / len(figs))
        return out


@register("numbers")
def _numbers(cfg: RewardConfig) -> Grader:
    return Numbers(cfg)
