"""Evaluation statistics: answer metrics, paired bootstrap, McNemar, rank agreement, Bradley-Terry/Elo.

Everything here is plain Python + numpy, deterministic given a seed, and tested against scipy.

- Answer metrics as in Concept Overlap: exact match (EM) and token F1 after SQuAD normalisation (lower case,
  drop punctuation, drop the articles a/an/the, collapse whitespace), and SeqM, difflib's
  SequenceMatcher ratio on the raw strings. With several references the best one counts.
- Paired bootstrap (Concept Overlap: 10,000 resamples): resample items with replacement, the same indices for
  both systems, and take the percentile interval of the mean difference.
- McNemar's exact test: a two-sided binomial test on the discordant pairs, computed with exact integers.
- Elo (Shaping Explanations): Shaping Explanations reports "Elo" from pairwise judge preferences without saying how; we fit the
  Bradley-Terry model by maximum likelihood (Hunter's MM iteration, ties counted as half a win) and put
  it on the Elo scale, 1500 + 400 log10(strength / geometric mean strength). Unlike sequential Elo
  updates this does not depend on the order of the games. A pseudo-count of ties between every pair
  (default one game) keeps ratings finite when a system wins or loses every comparison.
- Distinct answers: how many different (normalised) answers a system gives and the share of the most common
  one, since a gain can be a constant answer that is often right.
- Self-BLEU (RLVRR's diversity measure): BLEU-4 of each of a prompt's k samples against the other k - 1
  as references, averaged; our own few lines (nltk is not a dependency), smoothed as nltk's method2 and
  tested against it.
"""

from __future__ import annotations

import difflib
import math
import re
import string
from collections import Counter
from collections.abc import Sequence

import numpy as np

# rank agreement with humans is defined beside the graders, whose command line reports it too
from rewards.agreement import kendall_tau_b, pairwise_accuracy  # noqa: F401

# ----------------------------------------------------------------------------- answer metrics

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _refs(reference: str | Sequence[str]) -> list[str]:
    refs = [reference] if isinstance(reference, str) else list(reference)
    if not refs:
        raise ValueError("no reference to score against: give at least one reference string")
    return refs


def exact_match(prediction: str, reference: str | Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised reference, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(r) for r in _refs(reference)))


def _f1(pred_tokens: list[str], ref_tokens: list[str]) -> float:
    if not pred_tokens or not ref_tokens:
        # SQuAD convention: two empty answers agree, one empty answer scores 0
        return float(pred_tokens == ref_tokens)
    common = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, reference: str | Sequence[str]) -> float:
    """Bag-of-tokens F1 between the normalised prediction and the best reference."""
    pred = normalize_answer(prediction).split()
    return max(_f1(pred, normalize_answer(r).split()) for r in _refs(reference))


def seq_match(prediction: str, reference: str | Sequence[str]) -> float:
    """difflib.SequenceMatcher ratio on the raw strings (no autojunk), best reference."""
    return max(difflib.SequenceMatcher(None, prediction, r, autojunk=False).ratio() for r in _refs(reference))


def distinct_answers(answers: Sequence[str]) -> dict:
    """How varied a system's answers are: {"n", "distinct", "top" (the most common answer; the first seen on a
    tie), "top_share" (the share of the answers that are it)}. A gain can be one answer given to every
    question that happens to be right for many of them: a low `distinct` and a high `top_share` say so."""
    counts = Counter(answers)
    if not counts:
        return {"n": 0, "distinct": 0, "top": None, "top_share": None}
    top, k = counts.most_common(1)[0]
    return {"n": len(answers), "distinct": len(counts), "top": top, "top_share": k / len(answers)}


# ----------------------------------------------------------------------------- bootstrap


def bootstrap_means(
    values: np.ndarray, n_resamples: int = 10_000, seed: int = 0, chunk: int = 1000
) -> np.ndarray:
    """Means of `n_resamples` bootstrap resamples of the rows of `values` (n,) or (n, k) -> (R,) or (R, k).

    Every column uses the same resampled rows, so metrics of one comparison stay paired with each other.
    """
    x = np.asarray(values, dtype=np.float64)
    squeeze = x.ndim == 1
    x = x.reshape(len(x), -1)  # (n, k)
    n = len(x)
    if n == 0:
        raise ValueError("cannot bootstrap an empty sample")
    rng = np.random.default_rng(seed)
    out = np.empty((n_resamples, x.shape[1]))
    for s in range(0, n_resamples, chunk):  # chunks keep the (R, n) index matrix small for large n
        r = min(chunk, n_resamples - s)
        idx = rng.integers(0, n, size=(r, n))  # (r, n)
        out[s : s + r] = x[idx].mean(axis=1)  # (r, k)
    return out[:, 0] if squeeze else out


def bootstrap_ci(
    values: Sequence[float], n_resamples: int = 10_000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its percentile bootstrap interval."""
    x = np.asarray(values, dtype=np.float64)
    means = bootstrap_means(x, n_resamples, seed)
    a = (1 - level) / 2
    lo, hi = np.quantile(means, [a, 1 - a])
    return float(x.mean()), float(lo), float(hi)


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], n_resamples: int = 10_000, seed: int = 0, level: float = 0.95
) -> dict[str, float]:
    """Paired bootstrap of mean(b) - mean(a) over items scored by both systems.

    Returns n, mean_a, mean_b, diff, the interval (low, high), and p_boot: twice the fraction of
    resampled differences on the far side of zero (a rough two-sided p-value, capped at 1).
    """
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if xa.shape != xb.shape or xa.ndim != 1:
        raise ValueError(f"paired samples must be 1-D and of equal length, got {xa.shape} and {xb.shape}")
    d = xb - xa  # (n,)
    means = bootstrap_means(d, n_resamples, seed)  # (R,)
    q = (1 - level) / 2
    lo, hi = np.quantile(means, [q, 1 - q])
    tail = min((means <= 0).mean(), (means >= 0).mean())
    return {
        "n": int(len(d)),
        "mean_a": float(xa.mean()),
        "mean_b": float(xb.mean()),
        "diff": float(d.mean()),
        "low": float(lo),
        "high": float(hi),
        "p_boot": float(min(1.0, 2 * tail)),
    }


# ----------------------------------------------------------------------------- McNemar


def binom_two_sided_half(k: int, n: int) -> float:
    """Exact two-sided p-value of k successes in n Binomial(n, 1/2) trials (integer arithmetic)."""
    if n == 0:
        return 1.0
    k = min(k, n - k)
    if 2 * k == n:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1))  # P(X <= k) * 2^n, exact
    return min(1.0, 2 * tail / 2**n)


def mcnemar_exact(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> dict[str, float]:
    """McNemar's exact test on paired binary outcomes.

    only_a: items a got right and b wrong; only_b: the reverse. Under H0 (same accuracy) the discordant
    pairs split Binomial(only_a + only_b, 1/2).
    """
    if len(a_correct) != len(b_correct):
        raise ValueError(f"paired outcomes of different lengths: {len(a_correct)} vs {len(b_correct)}")
    only_a = sum(1 for x, y in zip(a_correct, b_correct) if x and not y)
    only_b = sum(1 for x, y in zip(a_correct, b_correct) if y and not x)
    return {"only_a": only_a, "only_b": only_b, "p": binom_two_sided_half(only_a, only_a + only_b)}


# ----------------------------------------------------------------------------- Bradley-Terry / Elo


def outcome_matrices(games: Sequence[tuple[int, int, float]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(wins, games) matrices (k, k) from (i, j, s) records, s = 1 if i won, 0 if j won, 0.5 a tie."""
    wins, n = np.zeros((k, k)), np.zeros((k, k))
    for i, j, s in games:
        assert i != j and s in (0.0, 0.5, 1.0), f"bad game record {(i, j, s)}"
        wins[i, j] += s
        wins[j, i] += 1 - s
        n[i, j] += 1
        n[j, i] += 1
    return wins, n


def bradley_terry(
    wins: np.ndarray, games: np.ndarray, prior: float = 1.0, iters: int = 10_000, tol: float = 1e-10
) -> np.ndarray:
    """Elo ratings from Bradley-Terry maximum likelihood; batched over leading dims: (..., k, k) -> (..., k).

    wins[i, j] is i's score against j (a tie is half a win each); games[i, j] the number of games. `prior`
    adds that many tied games to every pair. P(i beats j) = 1 / (1 + 10^((R_j - R_i) / 400)), mean
    rating 1500 in log-strength (geometric mean strength).
    """
    w = np.asarray(wins, dtype=np.float64) + prior / 2  # (..., k, k)
    n = np.asarray(games, dtype=np.float64) + prior  # (..., k, k)
    k = w.shape[-1]
    eye = np.eye(k, dtype=bool)
    w = np.where(eye, 0.0, w)
    n = np.where(eye, 0.0, n)
    total = w.sum(-1)  # (..., k)
    if np.any(total <= 0):
        raise ValueError("a system has no wins and no ties: Bradley-Terry is unbounded; use prior > 0")
    p = np.ones(w.shape[:-1])  # (..., k) strengths
    for _ in range(iters):
        # MM update (Hunter 2004): p_i <- W_i / sum_j n_ij / (p_i + p_j)
        denom = (n / (p[..., :, None] + p[..., None, :])).sum(-1)  # (..., k)
        new = total / denom
        new = new / np.exp(np.log(new).mean(-1, keepdims=True))  # fix the scale: geometric mean 1
        done = np.max(np.abs(np.log(new) - np.log(p))) < tol
        p = new
        if done:
            break
    return 1500.0 + 400.0 * np.log10(p)


def elo_from_games(
    games: Sequence[tuple[int, int, float, object]],
    k: int,
    n_resamples: int = 1000,
    seed: int = 0,
    prior: float = 1.0,
    level: float = 0.95,
) -> dict[str, np.ndarray]:
    """Ratings and bootstrap intervals from (i, j, s, item) records.

    The bootstrap resamples items (all games on one prompt go together, since they share its
    difficulty), refits Bradley-Terry on each resample, and takes percentile intervals. Returns
    {"elo": (k,), "low": (k,), "high": (k,)}.
    """
    items = sorted({g[3] for g in games}, key=str)
    index = {it: t for t, it in enumerate(items)}
    w_item = np.zeros((len(items), k, k))  # per-item wins, so a resample is a weighted sum
    n_item = np.zeros((len(items), k, k))
    for i, j, s, it in games:
        w, n = outcome_matrices([(i, j, s)], k)
        w_item[index[it]] += w
        n_item[index[it]] += n
    elo = bradley_terry(w_item.sum(0), n_item.sum(0), prior)  # (k,)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(len(items), np.full(len(items), 1 / len(items)), size=n_resamples)  # (R, I)
    w_boot = np.einsum("ri,ijk->rjk", counts, w_item)  # (R, k, k)
    n_boot = np.einsum("ri,ijk->rjk", counts, n_item)  # (R, k, k)
    boot = bradley_terry(w_boot, n_boot, prior)  # (R, k)
    q = (1 - level) / 2
    lo, hi = np.quantile(boot, [q, 1 - q], axis=0)
    return {"elo": elo, "low": lo, "high": hi}


# ----------------------------------------------------------------------------- Self-BLEU (RLVRR)

BLEU_ORDER = 4
"""BLEU-4: n-gram precisions for n = 1..4 with uniform weights, as in most Self-BLEU reports."""

_BLEU_TOKEN = re.compile(r"\w+|[^\w\s]")


def bleu_tokens(text: str) -> list[str]:
    """The tokens BLEU counts: lower-cased words and single punctuation marks."""
    return _BLEU_TOKEN.findall(text.lower())


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def sentence_bleu(
    hypothesis: Sequence[str], references: Sequence[Sequence[str]], order: int = BLEU_ORDER
) -> float:
    """BLEU of one tokenised hypothesis against tokenised references, in [0, 1].

    The geometric mean of the clipped n-gram precisions p_1..p_order (a hypothesis n-gram counts at most
    as often as it occurs in any one reference) times the brevity penalty exp(1 - r/c), applied when the
    hypothesis (c tokens) is shorter than the reference closest to it in length (r; the shorter on a tie).
    Smoothing is Lin & Och's (2004; nltk's method2): p_n = (matches + 1) / (n-grams + 1) for n >= 2, so
    two short texts that share words but no 4-gram still score; p_1 is not smoothed, so texts sharing no
    word score 0. An empty hypothesis scores 0.
    """
    c = len(hypothesis)
    if c == 0 or not references:
        return 0.0
    log_p = 0.0
    for n in range(1, order + 1):
        hyp = _ngrams(hypothesis, n)
        most = Counter()  # each n-gram's largest count in any one reference
        for ref in references:
            most |= _ngrams(ref, n)
        matches, total = sum((hyp & most).values()), sum(hyp.values())
        if n == 1 and matches == 0:
            return 0.0
        p = matches / total if n == 1 else (matches + 1) / (total + 1)
        log_p += math.log(p) / order
    r = min((len(ref) for ref in references), key=lambda length: (abs(length - c), length))
    brevity = 1.0 if c > r else math.exp(1 - r / c)
    return brevity * math.exp(log_p)


def self_bleu(texts: Sequence[str], order: int = BLEU_ORDER) -> float | None:
    """Self-BLEU (Zhu et al. 2018): each text's BLEU against all the others as references, averaged.

    High means the texts repeat each other (1 for identical texts), low means they differ (0 when no two
    share a word). None for fewer than two texts, where there is nothing to compare.
    """
    tokens = [bleu_tokens(t) for t in texts]
    if len(tokens) < 2:
        return None
    return float(
        np.mean([sentence_bleu(h, tokens[:i] + tokens[i + 1 :], order) for i, h in enumerate(tokens)])
    )
