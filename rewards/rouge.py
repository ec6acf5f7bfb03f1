"""ROUGE-L F1 on word tokens (guide 001; Lin 2004), batched.

LCS is the longest common subsequence of the two word sequences; precision = LCS / words in the
answer, recall = LCS / words in the reference, F1 = 2PR / (P + R) = 2 LCS / (answer + reference words).
Words are case-folded unicode word runs (`\\w+`): no stemming and no stop-word removal, so the guide's
worked examples come out as written (A 0.67, B 0.19, C 0.89). The `rouge-score` package keeps only
[a-z0-9] and so drops accented words; on ASCII text without stemming the two agree.

Every LCS in nanogrpo (here and the keyword chains) goes through `nanogrpo_kernels.lcs.lcs_lengths`: words
become integer ids, a whole batch of pairs goes in at once, and the lengths come from rapidfuzz's
bit-parallel LCS on the CPU cores, or from the Triton kernel on a GPU (nanogrpo_kernels' backend 'triton').

None when the reference has no words; an empty answer scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from rewards.base import Grader, Sample, check_text_field
from rewards.options import RewardConfig
from rewards.registry import register
from rewards.text import reply_text, words


def to_ids(seqs: Sequence[Sequence[str]]) -> list[list[int]]:
    """Map words to integer ids shared across the batch (ids are only compared for equality)."""
    vocab: dict[str, int] = {}
    return [[vocab.setdefault(w, len(vocab)) for w in s] for s in seqs]


def rouge_l(answers: Sequence[str], references: Sequence[str]) -> list[float | None]:
    """ROUGE-L F1 of each (answer, reference) pair; None where the reference has no words."""
    from nanogrpo_kernels.lcs import lcs_lengths  # on first use: kernels loads torch and triton

    cand = [words(a) for a in answers]
    ref = [words(r) for r in references]
    ids = to_ids(cand + ref)
    lcs = lcs_lengths(ids[: len(cand)], ids[len(cand) :])
    return [None if not r else 2.0 * n / (len(c) + len(r)) for c, r, n in zip(cand, ref, lcs)]


class RougeL(Grader):
    requires = ("reference",)

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg

    def check_row(self, row):
        return check_text_field(row, "reference")

    def score(self, batch: list[Sample]) -> list[float | None]:
        refs = [s.row.get("reference") for s in batch]
        texts = [reply_text(s.completion, self.cfg.text_tag, self.cfg.think_tag) for s in batch]
        scores = rouge_l(texts, [r if isinstance(r, str) else "" for r in refs])
        return [sc if isinstance(r, str) else None for sc, r in zip(scores, refs)]


@register("rouge_l")
def _rouge_l(cfg: RewardConfig) -> Grader:
    return RougeL(cfg)
