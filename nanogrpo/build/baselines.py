"""`python -m nanogrpo.build baseline`: keywords without an LLM, for seed 003's ablations.

RLVRR compares its LLM keywords with keywords picked by TF-IDF or at random, at 15% (and 30%) of the
reference. Here a row's keywords are distinct single words of its reference (the first of `reference`,
`references`), k = round(share x its word count) of them (at least 1, at most its distinct words):

- tfidf: the k words with the highest tf-idf, tf = count in the reference / its words, idf = ln((1 + N)
  / (1 + df)) + 1 over the N references of the file (scikit-learn's smoothed idf, written out: nanogrpo
  does not depend on scikit-learn); ties go to the earlier word;
- random: k distinct words drawn uniformly, seeded by --seed and the row's id (the same on any rerun).

The row gets one key point, the chosen words in the order they first occur in the reference:
`key_points: [["w1", "w2", ...]]`, as `keypoints --one-level` writes. The share is of word tokens,
counting each keyword once (a keyword repeated in the reference is one keyword).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import tyro

from nanogrpo.build import rows as io
from rewards.text import words


@dataclass(frozen=True)
class BaselineArgs:
    """Keywords by TF-IDF over the corpus or at random, at a share of each reference; no LLM."""

    input: tyro.conf.Positional[str]
    """Input JSONL (rows with `reference` or `references`)."""
    out: str
    """Output JSONL: the rows with `key_points`."""
    method: Literal["tfidf", "random"] = "tfidf"
    """How the keywords are picked."""
    share: float = 0.15
    """Keywords per reference word (RLVRR's ablations: 0.15 and 0.30)."""
    seed: int = 0
    """Seed of the random picks."""
    limit: int = 0
    """Only the first N rows (0 = all)."""


def idf(docs: list[list[str]]) -> dict[str, float]:
    """Smoothed inverse document frequency of every word: ln((1 + N) / (1 + df)) + 1."""
    df = Counter(w for d in docs for w in set(d))
    n = len(docs)
    return {w: math.log((1 + n) / (1 + c)) + 1 for w, c in df.items()}


def pick(tokens: list[str], k: int, method: str, weights: dict[str, float], rng: random.Random) -> list[str]:
    """k distinct words of `tokens`, in the order they first occur there."""
    first: dict[str, int] = {}
    for i, w in enumerate(tokens):
        first.setdefault(w, i)
    distinct = list(first)
    k = min(k, len(distinct))
    if method == "tfidf":
        tf = Counter(tokens)
        chosen = sorted(distinct, key=lambda w: (-tf[w] / len(tokens) * weights[w], first[w]))[:k]
    else:
        chosen = rng.sample(distinct, k)
    return sorted(chosen, key=first.__getitem__)


def run(args: BaselineArgs) -> dict[str, Any]:
    """Write each row with baseline keywords; rows without a reference are reported and left out."""
    if not 0 < args.share <= 1:
        raise ValueError(f"--share is a fraction of the reference's words, in (0, 1]; got {args.share}")
    rejected_path, _ = io.out_paths(args.out, args.input)
    rows = io.load(args.input, args.limit)
    rejects = io.Rejects(args.input, [])
    docs = {id(r): words(refs[0]) for r in rows if (refs := io.references(r)) and words(refs[0])}
    weights = idf(list(docs.values()))
    written, shares = [], []
    for row in rows:
        tokens = docs.get(id(row))
        if tokens is None:
            rejects.add(row, "no reference with words: give 'reference' (a string) or 'references'")
            continue
        seed = hashlib.sha256(f"{args.seed}:{row.get('id')}".encode()).hexdigest()
        kws = pick(tokens, max(1, round(args.share * len(tokens))), args.method, weights, random.Random(seed))
        shares.append(len(kws) / len(tokens))
        written.append({**io.clean(row), "key_points": [kws]})
    io.write_jsonl(args.out, written)
    rejects.report(rejected_path)
    mean = sum(shares) / len(shares) if shares else 0.0
    print(f"baseline {args.method}: {len(written)} of {len(rows)} rows written to {args.out}; keywords are "
          f"{mean:.1%} of the reference's words on average (asked {args.share:.0%})")  # fmt: skip
    return {"written": len(written), "share": mean}
