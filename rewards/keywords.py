"""The content reward of RLVRR: do the key points' keywords appear, in the reference's order?

Each row carries `key_points`: a list of key points, each a list of short keywords taken from the
reference (RLVRR has an LLM extract them offline; nanogrpo reads them from the data). For a key point
with keywords K and one reference text:

    ref_order = K sorted by where each keyword first occurs in the reference
    gen_order = the keywords of K found in the completion, sorted by where each first occurs there
    score     = LCS(ref_order, gen_order) / max(len(ref_order), len(gen_order))

The row's score is the mean over key points, and with several references (`reference` plus
`references`) the maximum over them. Ordering matters by design: RLVRR reports that matching keywords
without their order invites verbose reward hacking.

Where the seed is silent: keywords are matched as case-folded word sequences (a multi-word keyword
must appear contiguously); a keyword missing from a reference keeps its listed place at the end of that
reference's order (it stays required); with no reference text the listed order is the reference order.
`key_points` may also hold {"keywords": [...]} objects or bare strings (a one-keyword key point).
None when a row has no usable key point.
"""

from __future__ import annotations

import functools
from typing import Any

from rewards.base import Grader, Sample
from rewards.options import RewardConfig
from rewards.registry import register
from rewards.text import reply_text, words

_NOWHERE = 1 << 62


def key_point_lists(raw: Any) -> list[list[tuple[str, ...]]]:
    """`key_points` -> key points as lists of distinct keyword word-tuples (empty ones dropped)."""
    out = []
    for kp in raw if isinstance(raw, list) else []:
        if isinstance(kp, dict):
            kp = kp.get("keywords", [])
        kws = [kp] if isinstance(kp, str) else kp if isinstance(kp, list) else []
        seen: dict[tuple[str, ...], None] = {}
        for kw in kws:
            if isinstance(kw, str) and (t := tuple(words(kw))):
                seen.setdefault(t, None)
        if seen:
            out.append(list(seen))
    return out


def spaced_words(text: str) -> str:
    """The text's words joined by single spaces, with a space at each end: ' w1 w2 ... wn '."""
    return f" {' '.join(words(text))} "


_reference_words = functools.lru_cache(maxsize=256)(spaced_words)  # the G answers share a reference


def first_positions(spaced: str, keywords: list[tuple[str, ...]]) -> list[int]:
    """Word index of each keyword's first occurrence in `spaced` (a `spaced_words` string; _NOWHERE
    when absent). Words hold no spaces, so a keyword is the substring ' w1 w2 ' and its word index is
    the number of spaces before it: a linear string search per keyword, at C speed."""
    out = []
    for kw in keywords:
        at = spaced.find(f" {' '.join(kw)} ")
        out.append(_NOWHERE if at < 0 else spaced.count(" ", 0, at))
    return out


def keyword_scores(texts: list[str], key_points: list[list[list[tuple[str, ...]]]], refs: list[list[str]]):
    """Score of each completion; all LCS lengths of the batch go through one `lcs_lengths` call."""
    pairs_a, pairs_b, where = [], [], []  # where[k] = (sample, reference, denominator)
    for i, (text, kps, rtexts) in enumerate(zip(texts, key_points, refs)):
        gen = spaced_words(text)
        for j, rtext in enumerate(rtexts or [None]):
            for kws in kps:
                ids = list(range(len(kws)))  # keyword k of this key point has id k
                if rtext is not None:
                    rpos = first_positions(_reference_words(rtext), kws)
                    ids.sort(key=lambda k: (rpos[k], k))
                gpos = first_positions(gen, kws)
                found = sorted(
                    (k for k in range(len(kws)) if gpos[k] != _NOWHERE), key=lambda k: (gpos[k], k)
                )
                pairs_a.append(ids)
                pairs_b.append(found)
                where.append((i, j, max(len(ids), len(found))))
    from nanogrpo_kernels.lcs import lcs_lengths  # on first use: kernels loads torch and triton

    lcs = lcs_lengths(pairs_a, pairs_b)
    sums: dict[tuple[int, int], list[float]] = {}
    for (i, j, denom), n in zip(where, lcs):
        sums.setdefault((i, j), []).append(n / denom)
    best: list[float | None] = [None] * len(texts)
    for (i, _), vals in sums.items():
        s = sum(vals) / len(vals)
        best[i] = s if best[i] is None else max(best[i], s)
    return best


class Keywords(Grader):
    requires = ("key_points",)

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg

    def check_row(self, row):
        kp = row.get("key_points")
        if kp is None:
            return "key_points", 'is missing (write e.g. [["keyword", "keyword"], ["keyword"]])'
        if not isinstance(kp, list) or not key_point_lists(kp):
            return (
                "key_points",
                'must be a non-empty list of keyword lists, e.g. [["warfarin", "INR"], ["bleeding"]]',
            )
        refs = row.get("references")
        if refs is not None and not (isinstance(refs, list) and all(isinstance(r, str) for r in refs)):
            return "references", "must be a list of strings"
        return None

    def score(self, batch: list[Sample]) -> list[float | None]:
        texts = [reply_text(s.completion, self.cfg.text_tag, self.cfg.think_tag) for s in batch]
        kps = [key_point_lists(s.row.get("key_points")) for s in batch]
        refs = []
        for s in batch:
            extra = s.row.get("references")
            r = [s.row.get("reference"), *(extra if isinstance(extra, list) else [])]
            refs.append([x for x in r if isinstance(x, str) and x.strip()])
        return keyword_scores(texts, kps, refs)


@register("keywords")
def _keywords(cfg: RewardConfig) -> Grader:
    return Keywords(cfg)
