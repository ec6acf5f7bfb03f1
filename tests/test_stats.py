"""Evaluation statistics against references: scipy's exact binomial test and Kendall tau, hand-worked
SQuAD normalisation cases, bootstrap coverage on synthetic data, and Bradley-Terry against a direct MLE."""

import difflib
import math

import numpy as np
import pytest
import scipy.optimize
import scipy.stats

from nanogrpo.eval import evaluate, stats


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Cat", "cat"),
        ("a cat, an apple and the dog!", "cat apple and dog"),
        ("  Hello,   World.  ", "hello world"),
        ("theatre another answer", "theatre another answer"),  # articles only as whole words
        ("U.S.A.", "usa"),
        ("An", ""),
        ("", ""),
        ("Café—Ünïcode", "café—ünïcode"),  # only ASCII punctuation is removed, as in SQuAD
    ],
)
def test_normalize_answer(text, expected):
    assert stats.normalize_answer(text) == expected


@pytest.mark.parametrize(
    "pred, ref, em, f1",
    [
        ("The Paris.", "paris", 1.0, 1.0),
        ("Paris, France", "Paris", 0.0, 2 * (1 / 2) * 1 / (1 / 2 + 1)),  # P = 1/2, R = 1: F1 = 2/3
        ("the the cat", "a cat cat", 0.0, 2 / 3),  # -> ["cat"] vs ["cat", "cat"]: P = 1, R = 1/2
        ("dog", "cat", 0.0, 0.0),
        ("", "", 1.0, 1.0),  # both empty agree (SQuAD convention)
        ("", "cat", 0.0, 0.0),
        ("the", "cat", 0.0, 0.0),  # normalises to empty
        ("Blue whale", ["ocean", "the blue whale"], 1.0, 1.0),  # best of several references
    ],
)
def test_exact_match_and_token_f1(pred, ref, em, f1):
    assert stats.exact_match(pred, ref) == em
    assert stats.token_f1(pred, ref) == pytest.approx(f1)


def test_seq_match_is_difflib_ratio_on_raw_strings():
    assert stats.seq_match("abcd", "abce") == pytest.approx(0.75)
    assert stats.seq_match("Paris", "paris") == pytest.approx(0.8)  # case counts: no normalisation
    a, b = "x" * 300 + "y", "x" * 301  # long repeats: autojunk must be off to match difflib without it
    assert stats.seq_match(a, b) == difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()
    assert stats.seq_match("abc", ["zzz", "abc"]) == 1.0


def test_metrics_refuse_no_reference():
    with pytest.raises(ValueError, match="reference"):
        stats.token_f1("x", [])


def test_mcnemar_matches_scipy_binomtest():
    rng = np.random.default_rng(0)
    cases = [(0, 0), (0, 1), (1, 1), (3, 12), (12, 3), (8, 18), (50, 50), (40, 61), (250, 200)]
    cases += [tuple(int(x) for x in rng.integers(0, 40, 2)) for _ in range(30)]
    for only_a, only_b in cases:
        # build paired outcomes with these discordant counts and some concordant pairs around them
        a = [True] * only_a + [False] * only_b + [True] * 7 + [False] * 5
        b = [False] * only_a + [True] * only_b + [True] * 7 + [False] * 5
        res = stats.mcnemar_exact(a, b)
        assert (res["only_a"], res["only_b"]) == (only_a, only_b)
        n = only_a + only_b
        ref = scipy.stats.binomtest(only_a, n, 0.5).pvalue if n else 1.0
        assert res["p"] == pytest.approx(ref, rel=1e-9, abs=1e-15), (only_a, only_b)


def test_bootstrap_ci_coverage_near_nominal():
    """Synthetic paired data with a known mean difference: the 95% CI covers it ~95% of the time."""
    rng = np.random.default_rng(123)
    true_diff, n, datasets = 0.3, 60, 400
    hits95 = hits80 = 0
    for d in range(datasets):
        item = rng.normal(0, 1, n)  # per-item difficulty shared by both systems: that is the pairing
        a = item + rng.normal(0, 0.5, n)
        b = item + true_diff + rng.exponential(0.5, n) - 0.5  # skewed noise, mean 0
        res95 = stats.paired_bootstrap(a, b, n_resamples=1000, seed=d)
        res80 = stats.paired_bootstrap(a, b, n_resamples=1000, seed=d, level=0.8)
        hits95 += res95["low"] <= true_diff <= res95["high"]
        hits80 += res80["low"] <= true_diff <= res80["high"]
    # binomial tolerance: 3 standard errors of a proportion over `datasets` trials (plus the small
    # known undercoverage of percentile intervals); the 80% level checks the intervals are not just wide
    for hits, level in ((hits95, 0.95), (hits80, 0.8)):
        se = math.sqrt(level * (1 - level) / datasets)
        assert abs(hits / datasets - level) <= 3 * se + 0.01, (level, hits / datasets)


def test_paired_bootstrap_is_seeded_and_paired():
    rng = np.random.default_rng(0)
    a = rng.normal(size=50)
    b = a + 0.1  # identical up to a shift: a paired interval is a point, an unpaired one would be wide
    r1, r2 = stats.paired_bootstrap(a, b, seed=7), stats.paired_bootstrap(a, b, seed=7)
    assert r1 == r2
    assert r1["diff"] == pytest.approx(0.1)
    assert r1["low"] == pytest.approx(0.1) and r1["high"] == pytest.approx(0.1)
    assert r1["mean_a"] == pytest.approx(a.mean()) and r1["n"] == 50


def test_bootstrap_means_shares_indices_across_columns():
    x = np.arange(20.0)
    both = stats.bootstrap_means(np.stack([x, 2 * x], 1), n_resamples=50, seed=3)  # (50, 2)
    assert np.allclose(both[:, 1], 2 * both[:, 0])
    assert np.allclose(both[:, 0], stats.bootstrap_means(x, n_resamples=50, seed=3))


def test_kendall_tau_b_matches_scipy_with_ties():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 5, 40).astype(float)
    y = x + rng.integers(-2, 3, 40)
    assert stats.kendall_tau_b(x, y) == pytest.approx(scipy.stats.kendalltau(x, y).statistic)
    assert math.isnan(stats.kendall_tau_b([1, 1, 1], [1, 2, 3]))


def test_pairwise_accuracy_hand_case():
    # group g1: human 1 > 0.5 > 0; grader agrees on (0,1) and (0,2), ties on (1,2) -> 2.5 / 3
    # group g2: human ties -> no pair; group g3: one discordant pair -> 0 / 1
    scores = [0.9, 0.3, 0.3, 0.5, 0.6, 0.1, 0.8]
    human = [1.0, 0.5, 0.0, 0.7, 0.7, 1.0, 0.0]
    groups = ["g1", "g1", "g1", "g2", "g2", "g3", "g3"]
    acc, pairs = stats.pairwise_accuracy(scores, human, groups)
    assert pairs == 4
    assert acc == pytest.approx(2.5 / 4)


def _bt_mle_scipy(wins, games, prior):
    """Bradley-Terry MLE by direct optimisation in float64 (the oracle for the MM iteration)."""
    k = len(wins)
    w = wins + prior / 2 * (1 - np.eye(k))  # the prior's tied games, half a win each way

    def nll_full(theta):
        d = theta[:, None] - theta[None, :]  # (k, k) log-odds of i over j
        # sum over ordered pairs of w_ij log sigmoid(d_ij); games enter through w_ij + w_ji = n_ij
        return -(w * -np.logaddexp(0, -d)).sum()

    res = scipy.optimize.minimize(nll_full, np.zeros(k), method="BFGS", options={"gtol": 1e-10})
    theta = res.x - res.x.mean()
    return 1500 + 400 * theta / math.log(10)


def test_bradley_terry_matches_direct_mle():
    rng = np.random.default_rng(5)
    k = 5
    wins = rng.integers(0, 20, (k, k)).astype(float) * (1 - np.eye(k))
    games = wins + wins.T  # every game won by one side
    elo = stats.bradley_terry(wins, games, prior=1.0)
    assert elo.mean() == pytest.approx(1500.0)
    np.testing.assert_allclose(elo, _bt_mle_scipy(wins, games, 1.0), atol=1e-3)


def test_bradley_terry_batched_equals_one_by_one():
    rng = np.random.default_rng(6)
    wins = rng.integers(0, 10, (3, 4, 4)).astype(float) * (1 - np.eye(4))
    games = wins + np.swapaxes(wins, 1, 2)
    batched = stats.bradley_terry(wins, games)
    for b in range(3):
        np.testing.assert_allclose(batched[b], stats.bradley_terry(wins[b], games[b]), atol=1e-6)


def test_elo_recovers_known_ordering_with_ties():
    rng = np.random.default_rng(11)
    true = np.array([1350.0, 1450.0, 1500.0, 1650.0])
    true_rel = true - true.mean()
    games = []
    for item in range(300):
        for i in range(4):
            for j in range(i + 1, 4):
                p = 1 / (1 + 10 ** ((true[j] - true[i]) / 400))
                u = rng.random()
                # a tie band around the decision boundary: ties happen most between close systems
                s = 0.5 if abs(u - p) < 0.08 else float(u < p)
                games.append((i, j, s, item))
    fit = stats.elo_from_games(games, 4, n_resamples=300, seed=0)
    assert list(np.argsort(fit["elo"])) == [0, 1, 2, 3]
    est_rel = fit["elo"] - fit["elo"].mean()
    assert np.all(np.abs(est_rel - true_rel) < 40), est_rel - true_rel
    assert np.all(fit["low"] < fit["elo"]) and np.all(fit["elo"] < fit["high"])


def test_bradley_terry_prior_keeps_ratings_finite():
    wins = np.array([[0.0, 10.0], [0.0, 0.0]])  # system 0 won every game
    elo = stats.bradley_terry(wins, wins + wins.T, prior=1.0)
    assert np.all(np.isfinite(elo)) and elo[0] > elo[1] + 300
    with pytest.raises(ValueError, match="prior"):
        stats.bradley_terry(wins, wins + wins.T, prior=0.0)


def test_paired_summary_and_table():
    base = [{"em": 1.0, "f1": 0.5}, {"em": 0.0, "f1": 0.2}, {"em": 0.0, "f1": None}, {"em": 1.0, "f1": 1.0}]
    trained = [{"em": 1.0, "f1": 0.7}, {"em": 1.0, "f1": 0.6}, {"em": 1.0, "f1": 0.9}, {"em": 1.0, "f1": 1.0}]
    s = evaluate.paired_summary(base, trained, seed=0, n_resamples=2000)
    assert s["em"]["n"] == 4 and s["f1"]["n"] == 3  # rows where either side is None drop out
    assert s["em"]["diff"] == pytest.approx(0.5)
    assert s["f1"]["diff"] == pytest.approx((0.2 + 0.4 + 0.0) / 3)
    assert (s["em"]["mcnemar"]["only_a"], s["em"]["mcnemar"]["only_b"]) == (0, 2)
    assert s["em"]["mcnemar"]["p"] == pytest.approx(scipy.stats.binomtest(0, 2).pvalue)
    assert "mcnemar" not in s["f1"]
    table = evaluate.format_paired_table(s, ("base", "trained")).splitlines()
    assert table[0].split()[:5] == ["metric", "n", "base", "trained", "diff"]
    assert table[1].split()[:5] == ["em", "4", "0.500", "1.000", "+0.500"]
