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
"""

from __future__ import annotations

import math

from rewards.base import Grader, Sample, check_text_field
from rewards.options import RewardConfig
from rewards.registry import register
from rewards.text import figures, reply_text


def key_figures(text: str) -> list[float]:
    """The distinct finite figures of a text, units applied, in order of first appearance."""
    seen: dict[float, None] = {}
    for f in figures(text):
        v = float(f.value)
        if math.isfinite(v):
            seen.setdefault(v, None)
    return list(seen)


def figure_credit(ref: float, answer: list[float], full: float = 0.01, half: float = 0.05) -> float:
    """Credit of one reference figure: 1, 0.5 or 0 by the relative error of the closest answer number."""
    if not answer:
        return 0.0
    if ref == 0:
        return float(any(a == 0 for a in answer))
    err = min(abs(a - ref) for a in answer) / abs(ref)
    eps = 1e-9  # 1.01 vs 1.00 is 1% off, whatever float rounding says
    return 1.0 if err <= full + eps else 0.5 if err <= half + eps else 0.0


def numbers_score(answer: str, reference: str, full: float = 0.01, half: float = 0.05) -> float | None:
    """Mean credit over the reference's key figures; None when it has none."""
    ref = key_figures(reference)
    if not ref:
        return None
    got = key_figures(answer)
    return sum(figure_credit(r, got, full, half) for r in ref) / len(ref)


class Numbers(Grader):
    requires = ("reference",)

    def __init__(self, cfg: RewardConfig):
        if not (0 <= cfg.numbers_full <= cfg.numbers_half):
            raise ValueError(
                f"--reward.numbers-full ({cfg.numbers_full}) must be >= 0 and <= --reward.numbers-half "
                f"({cfg.numbers_half}); the guide uses 0.01 and 0.05"
            )
        self.cfg = cfg
        self._ref_cache: dict[str, list[float]] = {}

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
            if ref not in self._ref_cache:  # the G completions of a prompt share one reference
                if len(self._ref_cache) > 100_000:
                    self._ref_cache.clear()
                self._ref_cache[ref] = key_figures(ref)
            figs = self._ref_cache[ref]
            if not figs:
                out.append(None)
                continue
            got = key_figures(reply_text(s.completion, cfg.text_tag, cfg.think_tag))
            out.append(
                sum(figure_credit(r, got, cfg.numbers_full, cfg.numbers_half) for r in figs) / len(figs)
            )
        return out


@register("numbers")
def _numbers(cfg: RewardConfig) -> Grader:
    return Numbers(cfg)
