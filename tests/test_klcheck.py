"""The KL facts, checked exactly through the trainer's own loss code (nanogrpo.lab.klcheck on the 81-sequence toy)."""

import json

import pytest
import torch

from nanogrpo.lab import klcheck
from nanogrpo.lab.toy import TabularPolicy

DISTANCES = (0.1, 0.3, 1.0, 3.0)
EXACT = 1e-6


@pytest.fixture(scope="module")
def recs():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a few hundred numbers per tensor: threads only contend (1 s instead of 40)
    try:
        return klcheck.run(DISTANCES, old_shift=0.1, group=2, seed=0)
    finally:
        torch.set_num_threads(n)


def rows(recs, regime, variant):
    out = [r for r in recs if r["regime"] == regime and r["variant"] == variant]
    assert len(out) == len(DISTANCES), (regime, variant)
    return out


def test_kl_grows_with_distance(recs):
    kls = [r["kl_rev"] for r in rows(recs, "on", "loss k1 token")]
    assert kls == sorted(kls) and kls[0] < 0.05 < 1.0 < kls[-1]


@pytest.mark.parametrize("variant", ["loss k1 token", "loss k1 seq"])
def test_on_policy_k1_in_the_loss_has_zero_expected_gradient(recs, variant):
    for r in rows(recs, "on", variant):
        assert r["grad_norm"] < 1e-8


@pytest.mark.parametrize(
    "variant",
    [
        "reward k1 sum, no baseline",
        "reward k1 sum, rloo G=2",
        "loss k2 seq",  # KL reward-to-go in the loss
        "loss k1 seq +IS",
        "loss k3 seq +IS",
    ],
)
def test_on_policy_reverse_kl_gradient_is_exact(recs, variant):
    for r in rows(recs, "on", variant):
        assert r["rev/rel_err"] < EXACT, r


def test_k3_in_the_loss_is_the_forward_kl_gradient_and_drifts_from_the_reverse_one(recs):
    seq, tok = rows(recs, "on", "loss k3 seq"), rows(recs, "on", "loss k3 token")
    for r in seq:
        assert r["fwd/rel_err"] < EXACT, r  # sequence level: exactly grad KL(ref || pi)
    for r in tok:
        assert r["tok_fwd/rel_err"] < EXACT, r  # per token: the per-prefix forward KL, pi's prefixes
    for rs in (seq, tok):
        errs = [r["rev/rel_err"] for r in rs]
        assert errs == sorted(errs) and errs[0] < 0.1 and errs[-1] > 0.5, errs


def test_per_token_terms_give_only_the_per_prefix_part(recs):
    """k2 per token (and k1/k3 per token with the live IS weight) give the per-prefix reverse KL gradient, which
    misses the effect of theta on which prefixes are visited: not grad KL(pi || ref) at length > 1."""
    for variant in ("loss k2 token", "loss k1 token +IS", "loss k3 token +IS"):
        for r in rows(recs, "on", variant):
            assert r["tok_rev/rel_err"] < EXACT
            assert r["rev/rel_err"] > 1e-3


def test_k3_in_the_reward_is_the_difference_of_the_two(recs):
    for r in rows(recs, "on", "reward k3 sum, no baseline"):
        assert r["rev-tokfwd/rel_err"] < EXACT and r["rev/rel_err"] > 0.5


def test_group_mean_baseline_shrinks_by_g_minus_1_over_g(recs):
    for r in rows(recs, "on", "reward k1 sum, grpo G=2"):
        assert r["rev/cos"] == pytest.approx(1.0, abs=1e-12) and r["rev/norm_ratio"] == pytest.approx(0.5)


@pytest.mark.parametrize("variant", ["loss k3 seq +IS", "loss k1 seq +IS"])
def test_off_policy_importance_weighted_kl_is_exact(recs, variant):
    for r in rows(recs, "off", variant):
        assert r["rev/rel_err"] < EXACT, r


def test_off_policy_per_token_is_weight_corrects_the_token_not_the_prefixes(recs):
    for r in rows(recs, "off", "loss k3 token +IS"):
        assert r["tok_rev/rel_err"] < EXACT  # prefixes weighted by pi_old, not pi
        assert r["rev/rel_err"] > 1e-3


def test_off_policy_k1_in_the_loss_points_away_from_pi_old(recs):
    for r in rows(recs, "off", "loss k1 token"):
        assert r["away/rel_err"] < EXACT  # E_old[grad k1] = -grad KL(pi_old || pi)
        assert r["grad_norm"] > 1e-3
    # and a descent step along it really increases KL(pi_old || pi)
    pol = TabularPolicy()
    gen = torch.Generator().manual_seed(1)
    theta_ref, theta = pol.init(1.0, gen), pol.init(1.0, gen)
    theta_old = theta + 0.1 * pol.init(1.0, gen)
    v = next(v for v in klcheck.variants(2) if v.name == "loss k1 token")
    g = klcheck.expected_grad(pol, theta, theta_old, theta_ref, v)
    before = pol.kl(theta_old, theta).item()
    after = pol.kl(theta_old, theta - 1e-2 * g).item()
    assert after > before


def test_cli_json(capsys):
    n = torch.get_num_threads()
    klcheck.main(["--json", "--distances", "0.5"])
    out = json.loads(capsys.readouterr().out)
    assert len(out) == 2 * len(klcheck.variants(2))
    assert {"regime", "distance", "variant", "rev/rel_err", "rev/cos", "rev/norm_ratio", "matches"} <= set(
        out[0]
    )
    klcheck.main(["--distances", "0.5"])
    assert "loss k3 seq +IS" in capsys.readouterr().out
    torch.set_num_threads(n)  # main() sets 1
