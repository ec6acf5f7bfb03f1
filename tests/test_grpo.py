"""nanogrpo.grpo: advantages, clipped surrogate, aggregation invariance, KL terms, against hand computations."""

import itertools
import math
from dataclasses import replace

import pytest
import torch
from helpers import batch

from nanogrpo.config import GRPOConfig
from nanogrpo.grpo import (
    compute_advantages,
    finalize_stats,
    grpo_loss,
    kl_estimate,
    kl_penalty,
)
from nanogrpo.optim import accumulate_stats

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def cfg(**kw) -> GRPOConfig:
    return replace(GRPOConfig(), **kw)


def loss_and_grad(c, logp, old, ref, adv, mask, rows, norms):
    x = logp.clone().requires_grad_(True)
    loss, stats = grpo_loss(x[rows], old[rows], ref[rows], adv[rows], mask[rows], c, **norms)
    loss.backward()
    return loss.detach(), x.grad, stats


@pytest.mark.parametrize(
    "agg,extra",
    list(
        itertools.product(
            AGGS,
            [
                {},
                {"ratio_level": "sequence"},
                {"kl_placement": "loss", "kl_estimator": "k3"},
                {"kl_placement": "loss", "kl_estimator": "k2", "kl_reward_to_go": True},
                {"kl_placement": "loss", "kl_estimator": "k3", "kl_is_weight": True, "kl_reward_to_go": True},
                {"kl_placement": "loss", "kl_estimator": "k1", "kl_is_weight": True},
            ],
        )
    ),
)
def test_microbatch_split_sums_to_full_batch(agg, extra):
    c = cfg(loss_agg=agg, eps_low=0.2, eps_high=0.28, beta=0.1, **extra)
    logp, old, ref, adv, mask = batch()
    norms = dict(num_seqs=6.0, num_tokens=float(mask.sum()), max_len=5)
    full, g_full, s_full = loss_and_grad(c, logp, old, ref, adv, mask, slice(0, 6), norms)
    assert torch.isfinite(full) and torch.isfinite(g_full).all()
    total, g_sum, totals = 0.0, torch.zeros_like(logp), None
    for rows in ([0, 1], [2], [3, 4, 5]):
        loss, g, s = loss_and_grad(c, logp, old, ref, adv, mask, rows, norms)
        total, g_sum, totals = total + loss, g_sum + g, accumulate_stats(totals, s)
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_sum, g_full, rtol=1e-12, atol=1e-14)
    f_full, f_sum = finalize_stats(accumulate_stats(None, s_full)), finalize_stats(totals)
    for k in f_full:
        assert f_sum[k] == pytest.approx(f_full[k], rel=1e-12, abs=1e-14), k


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(
    "extra", [{}, {"kl_placement": "loss", "kl_reward_to_go": True, "kl_is_weight": True}]
)
def test_masked_tokens_get_no_gradient(agg, extra):
    logp, old, ref, adv, mask = batch()
    norms = dict(num_seqs=6.0, num_tokens=float(mask.sum()), max_len=5)
    _, g, _ = loss_and_grad(cfg(loss_agg=agg, **extra), logp, old, ref, adv, mask, slice(0, 6), norms)
    assert (g[mask == 0] == 0).all()
    assert (g[mask > 0] != 0).any()


def test_equal_rewards_in_a_group_give_zero_advantage_and_zero_gradient():
    rewards = torch.tensor([0.3, 0.3, 0.3, 0.3, 1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    for est, scale in itertools.product(["grpo", "rloo"], ["group", "batch", "none"]):
        adv, zero = compute_advantages(rewards, cfg(group_size=4, adv_estimator=est, scale_rewards=scale))
        assert zero.tolist() == [True, False]
        assert (adv[:4] == 0).all() and (adv[4:] != 0).any()
    adv, _ = compute_advantages(rewards, cfg(group_size=4))
    logp, old, ref, _, _ = batch(N=6, T=5)
    logp, old = (
        torch.cat([logp, logp[:2]]).nan_to_num(0.0, 0.0, 0.0),
        torch.cat([old, old[:2]]).nan_to_num(0.0),
    )
    mask = torch.ones(8, 5, dtype=torch.float64)
    x = logp.clone().requires_grad_(True)
    loss, _ = grpo_loss(x, old, None, adv, mask, cfg(group_size=4), num_seqs=8, num_tokens=40, max_len=5)
    loss.backward()
    assert (x.grad[:4] == 0).all() and (x.grad[4:] != 0).any()


def test_grpo_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0], dtype=torch.float64)
    adv, _ = compute_advantages(r, cfg(group_size=4, adv_eps=1e-4))
    std1 = math.sqrt(4 * 0.25 / 3)  # unbiased std of (1, 0, 0, 1)
    std2 = math.sqrt((9 + 1 + 1 + 9) / 3)
    want = [0.5 / (std1 + 1e-4), -0.5 / (std1 + 1e-4)] * 1
    want = [want[0], want[1], want[1], want[0]] + [d / (std2 + 1e-4) for d in (-3, -1, 1, 3)]
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64))
    adv, _ = compute_advantages(r, cfg(group_size=4, scale_rewards="none"))
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, -3, -1, 1, 3], dtype=torch.float64))


def test_rloo_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.2, 0.5, 0.9, 0.4], dtype=torch.float64)
    adv, _ = compute_advantages(r, cfg(group_size=4, adv_estimator="rloo", scale_rewards="none"))
    want = []
    for g in r.view(2, 4).tolist():
        want += [g[i] - sum(g[j] for j in range(4) if j != i) / 3 for i in range(4)]
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64))


NAN = float("nan")


def test_a_missing_reward_is_left_out_of_its_group():
    """[0.8, 0.9, None, 0.85] is the group (0.8, 0.9, 0.85) plus a row with no advantage, not a group whose
    fourth member scored 0 (which made all three advantages positive)."""
    r = torch.tensor([0.8, 0.9, NAN, 0.85], dtype=torch.float64)
    for est in ("grpo", "rloo"):
        for scale in ("group", "batch", "none"):
            c = cfg(group_size=4, adv_estimator=est, scale_rewards=scale)
            adv, zero = compute_advantages(r, c)
            want, _ = compute_advantages(r[[0, 1, 3]], replace(c, group_size=3))
            torch.testing.assert_close(adv[[0, 1, 3]], want, rtol=1e-12, atol=1e-14)
            assert adv[2] == 0 and not zero[0]
            assert adv[0] < 0 < adv[1]


def test_tied_or_lonely_valid_rewards_are_zero_spread():
    r = torch.tensor(
        [1, 1, NAN, 1, NAN, 0.5, NAN, NAN, NAN, NAN, NAN, NAN, 0, 1, NAN, 1], dtype=torch.float64
    )
    for est in ("grpo", "rloo"):
        adv, zero = compute_advantages(r, cfg(group_size=4, adv_estimator=est))
        assert zero.tolist() == [True, True, True, False]
        assert (adv[:12] == 0).all() and adv[14] == 0
        # RLOO among the valid rows: 0 - mean(1, 1), 1 - mean(0, 1)
        if est == "rloo":
            s = torch.tensor([0.0, 1, 1]).std().item() + 1e-4
            torch.testing.assert_close(
                adv[[12, 13, 15]], torch.tensor([-1, 0.5, 0.5], dtype=torch.float64) / s
            )


def test_bad_group_size_is_refused():
    with pytest.raises(ValueError, match="group-size 1"):
        compute_advantages(torch.zeros(4), cfg(group_size=1))
    with pytest.raises(ValueError, match="multiple"):
        compute_advantages(torch.zeros(5), cfg(group_size=2))


def test_on_policy_loss_is_minus_mean_advantage_and_gradient_by_hand():
    logp, _, _, adv, mask = batch()
    logp = logp.nan_to_num(0.0, 0.0, 0.0)
    x = logp.clone().requires_grad_(True)
    n = float(mask.sum())
    loss, stats = grpo_loss(x, logp, None, adv, mask, cfg(), num_seqs=6, num_tokens=n, max_len=5)
    loss.backward()
    assert loss.item() == pytest.approx(-(adv[:, None] * mask).sum().item() / n, rel=1e-12)
    torch.testing.assert_close(x.grad, -adv[:, None] * mask / n)
    assert stats["clip_low"] == 0 and stats["clip_high"] == 0 and stats["ratio_max"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "ratio,a,loss_want,grad_nonzero,low,high",
    [
        (1.5, 1.0, -1.2, False, 0, 1),  # above 1+eps_high with a > 0: clipped, no gradient
        (1.5, -1.0, 1.5, True, 0, 0),  # above with a < 0: the unclipped (worse) branch, gradient
        (0.5, -1.0, 0.8, False, 1, 0),  # below 1-eps_low with a < 0: clipped
        (0.5, 1.0, -0.5, True, 0, 0),  # below with a > 0: unclipped
        (1.1, 1.0, -1.1, True, 0, 0),  # inside the trust region
    ],
)
def test_clip_by_hand(ratio, a, loss_want, grad_nonzero, low, high):
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    x = (old + math.log(ratio)).requires_grad_(True)
    c = cfg(eps_low=0.2, eps_high=0.2)
    loss, stats = grpo_loss(
        x, old, None, torch.tensor([a]), torch.ones(1, 1), c, num_seqs=1, num_tokens=1, max_len=1
    )
    loss.backward()
    assert loss.item() == pytest.approx(loss_want, rel=1e-12)
    assert (x.grad.abs().item() > 0) == grad_nonzero
    if grad_nonzero:
        assert x.grad.item() == pytest.approx(-ratio * a, rel=1e-12)  # d(-rho a)/dlogp = -rho a
    assert stats["clip_low"].item() == low and stats["clip_high"].item() == high


def test_gspo_sequence_ratio():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=torch.float64)
    delta = torch.tensor([[0.10, -0.04, 0.06, 9.0]], dtype=torch.float64)  # last token is padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    x = (old + delta).requires_grad_(True)
    c = cfg(ratio_level="sequence", loss_agg="seq-mean-token-mean")
    loss, stats = grpo_loss(x, old, None, torch.tensor([2.0]), mask, c, num_seqs=1, num_tokens=3, max_len=4)
    loss.backward()
    s = math.exp((0.10 - 0.04 + 0.06) / 3)  # geometric mean of the 3 token ratios
    assert loss.item() == pytest.approx(-s * 2.0, rel=1e-12)
    torch.testing.assert_close(x.grad, torch.tensor([[-2 * s / 3] * 3 + [0.0]], dtype=torch.float64))
    assert stats["ratio_max"].item() == pytest.approx(s)
    # far outside the trust region every token of the sequence is clipped together
    x = (old + 0.5 * mask).requires_grad_(True)
    loss, stats = grpo_loss(x, old, None, torch.tensor([2.0]), mask, c, num_seqs=1, num_tokens=3, max_len=4)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2 * 2.0) and (x.grad == 0).all() and stats["clip_high"].item() == 3


def test_kl_estimators_and_penalty():
    l = torch.tensor([-0.5, 0.0, 0.3], dtype=torch.float64)
    torch.testing.assert_close(kl_estimate(l, "k1"), l)
    torch.testing.assert_close(kl_estimate(l, "k2"), l * l / 2)
    torch.testing.assert_close(kl_estimate(l, "k3"), torch.exp(-l) - 1 + l)
    logp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -2.0, -2.7]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    assert kl_penalty(logp, ref, mask, cfg(kl_estimator="k1")).item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, mask, cfg(kl_estimator="k3")).item() == pytest.approx(math.exp(-0.5) - 0.5)


def test_sequence_level_kl_gradient_by_hand():
    """k2 with kl_reward_to_go: d loss / d logp_t = beta * w * sum_{s>=t} l_s; k1 per token: beta * w."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.2, -1.5, -0.9]], dtype=torch.float64)
    l = (logp - ref)[0].tolist()
    mask = torch.ones(1, 3, dtype=torch.float64)
    c = cfg(
        kl_placement="loss",
        kl_estimator="k2",
        kl_reward_to_go=True,
        beta=0.5,
        loss_agg="seq-mean-token-sum-norm",
    )
    x = logp.clone().requires_grad_(True)
    loss, stats = grpo_loss(x, logp, ref, torch.zeros(1), mask, c, num_seqs=1, num_tokens=3, max_len=3)
    loss.backward()
    want = [0.5 / 3 * sum(l[t:]) for t in range(3)]
    torch.testing.assert_close(x.grad[0], torch.tensor(want, dtype=torch.float64))
    assert loss.item() == pytest.approx(0.5 / 3 * sum(v * v / 2 for v in l))  # the value is k2 per token
    assert stats["kl"].item() == pytest.approx(sum(math.exp(-v) - 1 + v for v in l))


def test_loss_kl_needs_ref():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(
            x,
            x,
            None,
            torch.zeros(1),
            torch.ones(1, 2),
            cfg(kl_placement="loss"),
            num_seqs=1,
            num_tokens=2,
            max_len=2,
        )
