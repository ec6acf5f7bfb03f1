"""`python -m nanogrpo.reward_data baseline`: keywords without an LLM, for RLVRR's ablations.

RLVRR compares its LLM keywords with keywords picked by TF-IDF or at random, at 15% (and 30%) of the
reference. Here a row's keywords are distinct single words of its reference (the first of `reference`,
`references`), k = round(share x its word count) of them (at least 1, at most its distinct words):

- tfidf: the k words with the highest tf-idf, tf = count in the reference / its words, idf = ln((1 + N)
  / (1 + df)) + 1 over the N references of the file (scikit-learn's smoothed idf, written out: nanogrpo
  does not depend on scikit-learn); ties go to the earlier word. English function words (STOP_WORDS: "the",
  "and", "of", ...) come after every other word: on a small file idf cannot tell them from content (a word
  of one reference has the top idf whatever it is), so a frequent "the" won. They fill k only when the
  reference has fewer content words (--no-stop-words ranks them as any word, as scikit-learn's default);
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
from typing import Annotated, Any, Literal

import tyro

from nanogrpo.reward_data import rows as io
from nanogrpo_base.ranges import at_least, within
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
    share: Annotated[float, within(0, 1, lo_open=True)] = 0.15
    """Keywords per reference word (RLVRR's ablations: 0.15 and 0.30)."""
    seed: Annotated[int, at_least(0)] = 0
    """Seed of the random picks."""
    limit: Annotated[int, at_least(0, "0 = all")] = 0
    """Only the first N rows (0 = all)."""
    stop_words: bool = True
    """tfidf: English function words (STOP_WORDS) rank after every content word."""


# English function words: articles, pronouns, auxiliaries, prepositions, conjunctions (tfidf's last picks)
STOP_WORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has have having
    he her here hers herself him himself his how i if in into is it its itself just me more most my myself
    no nor not now of off on once only or other our ours ourselves out over own same she should so some such
    than that the their theirs them themselves then there these they this those through to too under until up
    very was we were what when where which while who whom why will with would you your yours yourself
    yourselves""".split()
)


def idf(docs: list[list[str]]) -> dict[str, float]:
    """Smoothed inverse document frequency of every word: ln((1 + N) / (1 + df)) + 1."""
    df = Counter(w for d in docs for w in set(d))
    n = len(docs)
    return {w: math.log((1 + n) / (1 + c)) + 1 for w, c in df.items()}


def pick(
    tokens: list[str], k: int, method: str, weights: dict[str, float], rng: random.Random, stop=frozenset()
) -> list[str]:
    """k distinct words of `tokens`, in the order they first occur there; tfidf ranks `stop` words last."""
    first: dict[str, int] = {}
    for i, w in enumerate(tokens):
        first.setdefault(w, i)
    distinct = list(first)
    k = min(k, len(distinct))
    if method == "tfidf":
        tf = Counter(tokens)
        rank = lambda w: (w in stop, -tf[w] / len(tokens) * weights[w], first[w])  # noqa: E731
        chosen = sorted(distinct, key=rank)[:k]
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
        stop = STOP_WORDS if args.stop_words else frozenset()
        k = max(1, round(args.share * len(tokens)))
        kws = pick(tokens, k, args.method, weights, random.Random(seed), stop)
        shares.append(len(kws) / len(tokens))
        written.append({**io.clean(row), "key_points": [kws]})
    io.write_jsonl(args.out, written)
    rejects.report(rejected_path)
    mean = sum(shares) / len(shares) if shares else 0.0
    print(f"baseline {args.method}: {len(written)} of {len(rows)} rows written to {args.out}; keywords are "
          f"{mean:.1%} of the reference's words on average (asked {args.share:.0%})")  # fmt: skip
    return {"written": len(written), "share": mean}
