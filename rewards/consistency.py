"""The consistency term of Concept Overlap: 1 - the rate of repeated n-grams in the completion.

Concept Overlap gives this term a small weight (0.1) to keep early samples from padding and looping; it
reads no reference and no model. The seed says only "computed from the rate of repeated n-grams,
capped to [0, 1]"; nanogrpo fixes the details:

    rate  = (n-grams that repeat an earlier n-gram) / (all n-grams)      word n-grams, case-folded
    score = 1 - rate = distinct n-grams / all n-grams

n is --reward.consistency-n (default 3). A completion shorter than n words repeats nothing and
scores 1; one with no words at all (empty, or only punctuation like '!!!!!!') scores 0, since padding
is what this term is there to punish. The whole completion is read, think block included: a loop in
the reasoning is the degeneration this term catches.
"""

from __future__ import annotations

from rewards.base import Grader, Sample
from rewards.options import RewardConfig
from rewards.registry import register
from rewards.text import words


def distinct_ngram_rate(tokens: list[str], n: int) -> float:
    """Distinct n-grams / all n-grams (1 - the repeated n-gram rate); see the module docstring."""
    if not tokens:
        return 0.0
    total = len(tokens) - n + 1
    if total <= 0:
        return 1.0
    grams = {tuple(tokens[i : i + n]) for i in range(total)}
    return len(grams) / total


class Consistency(Grader):
    requires = ()

    def __init__(self, cfg: RewardConfig):
        if cfg.consistency_n < 1:
            raise ValueError(
                f"--reward.consistency-n must be >= 1, got {cfg.consistency_n}; Concept Overlap style is 3"
            )
        self.n = cfg.consistency_n

    def score(self, batch: list[Sample]) -> list[float | None]:
        return [distinct_ngram_rate(words(s.completion), self.n) for s in batch]


@register("consistency")
def _consistency(cfg: RewardConfig) -> Grader:
    return Consistency(cfg)
