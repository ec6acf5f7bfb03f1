"""Reward scaling, CISPO, dual-clip, the entropy bonus and the high-entropy-token mask, against hand
computations; micro-batch invariance of each; the train.py flags end to end; old run folders resume."""

import itertools
import json
import math
from dataclasses import replace

import pytest
import torch
from helpers import batch, metrics, run_train_here, tiny

from nanogrpo.config import GRPOConfig
from nanogrpo.grpo import (
    batch_std,
    compute_advantages,
    entropy_threshold,
    finalize_stats,
    grpo_loss,
    high_entropy_tokens,
    reward_moments,
)
from nanogrpo.infra.config_file import load_config
from nanogrpo.infra.flag_checks import check_config
from nanogrpo.optim import accumulate_stats
from nanogrpo.recipes.presets import PRESETS

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
NAN = float("nan")
EPS = 1e-4


def cfg(**kw) -> GRPOConfig:
    return replace(GRPOConfig(), **kw)


def t64(*rows):
    return torch.tensor(rows, dtype=torch.float64)


# ----------------------------------------------------------------------------- reward scaling


def test_each_scaling_mode_by_hand():
    """Groups (0, 1) and (1, 3): deviations -0.5, 0.5, -1, 1 from the group means 0.5 and 2."""
    r = t64(0.0, 1.0, 1.0, 3.0)
    dev = [-0.5, 0.5, -1.0, 1.0]
    want = {
        # unbiased group stds: sqrt(0.5) and sqrt(2)
        "group": [-0.5 / (0.5**0.5 + EPS), 0.5 / (0.5**0.5 + EPS), -1 / (2**0.5 + EPS), 1 / (2**0.5 + EPS)],
        # all four rewards: mean 1.25, squared deviations 1.5625 + 0.0625 + 0.0625 + 3.0625 = 4.75, / 3
        "batch": [d / (math.sqrt(4.75 / 3) + EPS) for d in dev],
        "none": dev,
    }
    for scale, w in want.items():
        adv, zero = compute_advantages(r, cfg(group_size=2, scale_rewards=scale, adv_eps=EPS))
        torch.testing.assert_close(adv, t64(*w), rtol=1e-12, atol=0)
        assert not zero.any()


def test_batch_scale_leaves_missing_rewards_out():
    """The same valid rewards as above, each group with a row no grader scored: the same batch std."""
    r = t64(0.0, 1.0, NAN, 1.0, 3.0, NAN)
    adv, _ = compute_advantages(r, cfg(group_size=3, scale_rewards="batch", adv_eps=EPS))
    s = math.sqrt(4.75 / 3) + EPS
    torch.testing.assert_close(adv, t64(-0.5 / s, 0.5 / s, 0, -1 / s, 1 / s, 0), rtol=1e-12, atol=0)
    assert reward_moments(r) == {"n": 4.0, "sum": 5.0, "sumsq": 11.0}
    assert batch_std({"n": 1.0, "sum": 2.0, "sumsq": 4.0}) == 0.0  # one reward: no spread


def test_batch_moments_summed_over_halves_give_the_full_batch():
    """What two ranks do: each computes its moments, they are summed, each scales its own groups."""
    g = torch.Generator().manual_seed(0)
    r = torch.rand(16, generator=g, dtype=torch.float64)
    r[5] = NAN
    c = cfg(group_size=4, scale_rewards="batch")
    full, zero = compute_advantages(r, c)
    a, b = reward_moments(r[:8]), reward_moments(r[8:])
    total = {k: a[k] + b[k] for k in a}
    halves = [compute_advantages(part, c, total) for part in (r[:8], r[8:])]
    torch.testing.assert_close(torch.cat([h[0] for h in halves]), full, rtol=1e-12, atol=1e-15)
    # each half alone has another std: the global moments matter
    alone = compute_advantages(r[:8], c)[0]
    assert (alone - full[:8]).abs().max() > 1e-3


# ----------------------------------------------------------------------------- CISPO and dual-clip


def one_token(ratio, a, c):
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    x = (old + math.log(ratio)).requires_grad_(True)
    loss, stats = grpo_loss(
        x, old, None, torch.tensor([a]), torch.ones(1, 1), c, num_seqs=1, num_tokens=1, max_len=1
    )
    loss.backward()
    return loss.item(), x.grad.item(), {k: float(v) for k, v in stats.items()}


@pytest.mark.parametrize(
    "ratio,a,w,low,high",
    [
        (1.5, 1.0, 1.2, 0, 1),  # the weight is capped at 1 + eps_high, the gradient stays
        (1.5, -1.0, 1.2, 0, 1),  # capped whatever the sign of the advantage
        (0.5, -1.0, 0.8, 1, 0),  # floored at 1 - eps_low
        (1.1, 2.0, 1.1, 0, 0),  # inside: the weight is the ratio
    ],
)
def test_cispo_by_hand(ratio, a, w, low, high):
    """loss = -w * a * logp with w = clip(ratio) detached: d loss / d logp = -w * a, never 0."""
    loss, grad, stats = one_token(ratio, a, cfg(policy_loss="cispo", eps_low=0.2, eps_high=0.2))
    logp = -1.0 + math.log(ratio)
    assert loss == pytest.approx(-w * a * logp, rel=1e-12)
    assert grad == pytest.approx(-w * a, rel=1e-12)
    assert (
        stats["clip_low"] == low and stats["clip_high"] == high and stats["ratio_max"] == pytest.approx(ratio)
    )


@pytest.mark.parametrize(
    "ratio,a,loss_want,grad_want,dual,low,high",
    [
        (4.0, -1.0, 3.0, 0.0, 1, 0, 0),  # clip loss 4 (unclipped branch), bounded at -C * a = 3: no gradient
        (2.0, -1.0, 2.0, 2.0, 0, 0, 0),  # under the bound: the clip loss -ratio * a, gradient -ratio * a
        (2.5, -2.0, 5.0, 5.0, 0, 0, 0),  # 5 < -C * a = 6
        (0.5, -1.0, 0.8, 0.0, 0, 1, 0),  # the lower clip, as without dual-clip
        (4.0, 1.0, -1.2, 0.0, 0, 0, 1),  # a > 0: the upper clip, the dual clip does not apply
    ],
)
def test_dual_clip_by_hand(ratio, a, loss_want, grad_want, dual, low, high):
    loss, grad, stats = one_token(ratio, a, cfg(dual_clip=3.0, eps_low=0.2, eps_high=0.2))
    assert loss == pytest.approx(loss_want, rel=1e-12)
    assert grad == pytest.approx(grad_want, rel=1e-12, abs=0)
    assert (stats["clip_dual"], stats["clip_low"], stats["clip_high"]) == (dual, low, high)


def test_dual_clip_fraction_in_the_stats():
    """Two of three tokens past C = 3 with a < 0: clip_dual 2/3; token-mean loss (3 + 3 + 2) / 3."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    x = torch.log(t64([5.0, 4.0, 2.0])).requires_grad_(True)
    loss, stats = grpo_loss(
        x, old, None, t64(-1.0), torch.ones(1, 3), cfg(dual_clip=3.0), num_seqs=1, num_tokens=3, max_len=3
    )
    loss.backward()
    assert loss.item() == pytest.approx(8 / 3, rel=1e-12)
    torch.testing.assert_close(x.grad, t64([0.0, 0.0, 2.0 / 3]))
    assert finalize_stats(accumulate_stats(None, stats))["clip_dual"] == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------- entropy bonus and mask


def test_entropy_bonus_by_hand():
    """On-policy token-mean: loss = -mean(adv) - coef * mean(H); d loss / d H = -coef / n on real tokens."""
    logp, _, _, adv, mask = batch()
    logp = logp.nan_to_num(0.0, 0.0, 0.0)
    ent = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ent = torch.where(mask > 0, ent, math.nan).requires_grad_(True)  # padding: garbage that must not leak
    n = float(mask.sum())
    loss, stats = grpo_loss(
        logp, logp, None, adv, mask, cfg(entropy_coef=0.1), num_seqs=6, num_tokens=n, max_len=5, entropy=ent
    )
    loss.backward()
    h = torch.where(mask > 0, ent, 0.0).detach()
    want = -(adv[:, None] * mask).sum() / n - 0.1 * h.sum() / n
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(ent.grad, -0.1 * mask / n)
    assert stats["entropy_bonus"].item() == pytest.approx(0.1 * h.sum().item() / n, rel=1e-12)
    # coefficient 0: the same loss, bit for bit, as without the entropy
    base, s0 = grpo_loss(logp, logp, None, adv, mask, cfg(), num_seqs=6, num_tokens=n, max_len=5)
    zero, s1 = grpo_loss(logp, logp, None, adv, mask, cfg(), num_seqs=6, num_tokens=n, max_len=5, entropy=ent)
    assert torch.equal(base, zero) and list(s0) == list(s1) and "entropy_bonus" not in s0


def test_entropy_threshold_and_the_kept_tokens_by_hand():
    """Real tokens' entropies 0.1, 0.9, 0.5, 0.3, 0.7; q = 0.4: the 0.6 quantile sits at 2.4 of the sorted
    positions 0..4, 0.5 + 0.4 * (0.7 - 0.5) = 0.58, so 0.9 and 0.7 keep the policy gradient."""
    ent = t64([0.1, 0.9, 0.5], [0.3, 0.7, 5.0])  # the 5.0 is padding
    mask = t64([1.0, 1.0, 1.0], [1.0, 1.0, 0.0])
    tau = entropy_threshold(ent[mask > 0], 0.4)
    assert tau == pytest.approx(0.58, rel=1e-12)
    keep = high_entropy_tokens(ent, mask, tau)
    assert keep.tolist() == [[False, True, False], [False, True, False]]
    x = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)  # on-policy, log-probs 0
    ref = t64([0.1, -0.2, 0.3], [0.2, 0.1, 0.0])
    c = cfg(top_entropy_quantile=0.4, kl_placement="loss", kl_estimator="k1", kl_is_weight=True, beta=0.5)
    loss, stats = grpo_loss(x, x.detach(), ref, t64(2.0, -1.0), mask, c, num_seqs=2, num_tokens=5, max_len=3,
                            keep=keep)  # fmt: skip
    loss.backward()
    # policy term: -adv / 5 on the kept tokens only; KL (k1 * ratio): beta * (l + 1) / 5 on every real token
    l = (x - ref).detach()
    want = torch.where(keep, -t64(2.0, -1.0)[:, None] / 5, 0.0) + 0.5 * (l + 1) * mask / 5
    torch.testing.assert_close(x.grad, want)
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 5 + 0.5 * float((l * mask).sum()) / 5, rel=1e-12)
    assert finalize_stats(accumulate_stats(None, stats))["entropy_kept"] == pytest.approx(0.4)


def test_entropy_threshold_is_the_linear_quantile():
    g = torch.Generator().manual_seed(0)
    e = torch.rand(1001, generator=g, dtype=torch.float64)
    for q in (0.2, 0.5, 0.77, 1.0):
        assert entropy_threshold(e, q) == pytest.approx(torch.quantile(e, 1 - q).item(), rel=1e-12)
    assert (e >= entropy_threshold(e, 0.2)).double().mean().item() == pytest.approx(0.2, abs=2e-3)


def test_the_mask_needs_keep_and_the_bonus_needs_entropy():
    x = torch.zeros(1, 2)
    kw = dict(num_seqs=1, num_tokens=2, max_len=2)
    with pytest.raises(ValueError, match="keep"):
        grpo_loss(x, x, None, torch.zeros(1), torch.ones(1, 2), cfg(top_entropy_quantile=0.5), **kw)
    with pytest.raises(ValueError, match="entropy_grad"):
        grpo_loss(x, x, None, torch.zeros(1), torch.ones(1, 2), cfg(entropy_coef=0.1), **kw)


def test_entropy_bonus_gradient_through_the_head_matches_float64_autograd():
    """grpo_loss's bonus through token_logprobs(entropy_grad=True) (the reference path): the gradient of
    -coef * mean H with respect to hidden and weight equals float64 autograd of an explicit entropy."""
    from nanogrpo_kernels.logprobs import token_logprobs

    g = torch.Generator().manual_seed(0)
    n, h, v, temp = 6, 8, 50, 0.7
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    adv = torch.randn(2, generator=g)
    mask = torch.ones(2, 3)

    def loss_of(h_, w_, explicit):
        if explicit:
            logq = (h_ @ w_.T / temp).log_softmax(-1)
            lp, ent = logq.gather(1, targets[:, None]).squeeze(1), -(logq.exp() * logq).sum(-1)
        else:
            lp, ent = token_logprobs(h_, w_, targets, temp, entropy_grad=True)
        lp, ent = lp.view(2, 3), ent.view(2, 3)
        c = cfg(entropy_coef=0.3, loss_agg="seq-mean-token-mean")
        return grpo_loss(
            lp, lp.detach(), None, adv, mask, c, num_seqs=2, num_tokens=6, max_len=3, entropy=ent
        )[0]

    got = torch.autograd.grad(
        loss_of(hidden.requires_grad_(), weight.requires_grad_(), False), (hidden, weight)
    )
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = torch.autograd.grad(loss_of(h64, w64, True), (h64, w64))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- micro-batch invariance


def split_loss(c, rows, logp, old, ref, adv, mask, ent, keep, norms):
    x, e = logp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    loss, stats = grpo_loss(
        x[rows], old[rows], ref[rows], adv[rows], mask[rows], c, **norms, sampler_logp=old[rows] + 0.05,
        entropy=e[rows], keep=keep[rows],
    )  # fmt: skip
    loss.backward()
    return loss.detach(), x.grad, torch.zeros_like(e) if e.grad is None else e.grad, stats


VARIANTS = [
    {"policy_loss": "cispo"},
    {"policy_loss": "cispo", "eps_low": 1.0, "eps_high": 4.0, "is_correction": "tis"},
    {"dual_clip": 1.5},
    {"dual_clip": 3.0, "kl_placement": "loss", "kl_estimator": "k3"},
    {"entropy_coef": 0.05},
    {"top_entropy_quantile": 0.3},
    {"top_entropy_quantile": 0.5, "entropy_coef": 0.01, "dual_clip": 2.0, "kl_placement": "loss"},
]


@pytest.mark.parametrize("agg,extra", list(itertools.product(AGGS, VARIANTS)))
def test_microbatch_split_sums_to_full_batch(agg, extra):
    c = replace(cfg(loss_agg=agg, eps_low=0.2, eps_high=0.28, beta=0.1), **extra)
    logp, old, ref, adv, mask = batch()
    logp = logp + 0.8 * (torch.arange(5, dtype=torch.float64) % 2)  # some ratios past the dual clip's C
    ent = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    keep = high_entropy_tokens(ent, mask, entropy_threshold(ent[mask > 0], c.top_entropy_quantile))
    norms = dict(num_seqs=6.0, num_tokens=float(mask.sum()), max_len=5)
    args = (logp, old, ref, adv, mask, ent, keep, norms)
    full, gx, ge, s_full = split_loss(c, slice(0, 6), *args)
    assert torch.isfinite(full) and torch.isfinite(gx).all() and (gx[mask == 0] == 0).all()
    total, sx, se, totals = 0.0, torch.zeros_like(gx), torch.zeros_like(ge), None
    for rows in ([0, 1], [2], [3, 4, 5]):
        loss, g1, g2, s = split_loss(c, rows, *args)
        total, sx, se, totals = total + loss, sx + g1, se + g2, accumulate_stats(totals, s)
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(sx, gx, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(se, ge, rtol=1e-12, atol=1e-14)
    f_full, f_sum = finalize_stats(accumulate_stats(None, s_full)), finalize_stats(totals)
    assert f_full.keys() == f_sum.keys()
    for k in f_full:
        assert f_sum[k] == pytest.approx(f_full[k], rel=1e-12, abs=1e-14), k
    if c.dual_clip == 1.5:
        assert f_full["clip_dual"] > 0  # the case exercises the bound


# ----------------------------------------------------------------------------- config and train.py


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"dual_clip": 0.5}, "--grpo.dual-clip 0.5: must be > 1, or 0"),
        ({"dual_clip": 3.0, "policy_loss": "cispo"}, "drop --grpo.dual-clip"),
        ({"entropy_coef": -0.01}, ">= 0"),
        ({"top_entropy_quantile": 0.0}, "in (0, 1]"),
        ({"top_entropy_quantile": 1.5}, "in (0, 1]"),
        ({"top_entropy_quantile": 0.2, "ratio_level": "sequence"}, "--grpo.ratio-level token"),
    ],
)
def test_check_config_refuses_and_says_how_to_fix(kw, needle):
    base = PRESETS["tiny"][1]
    check_config(replace(base, grpo=replace(base.grpo, dual_clip=3.0, top_entropy_quantile=0.2)))  # fine
    with pytest.raises(ValueError) as e:
        check_config(replace(base, grpo=replace(base.grpo, **kw)))
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "flags,key",
    [
        (["--grpo.scale-rewards", "batch"], None),
        (["--grpo.scale-rewards", "none"], None),
        (["--grpo.policy-loss", "cispo"], None),
        (["--grpo.dual-clip", "3"], "clip_dual"),
        (["--grpo.entropy-coef", "0.01"], "entropy_bonus"),
        (["--grpo.top-entropy-quantile", "0.2"], "entropy_kept"),
    ],
)
def test_train_py_runs_with_each_flag(tmp_path, flags, key):
    args = [
        "tiny",
        "--steps",
        "2",
        "--log-samples-every",
        "0",
        "--no-plots",
        "--out-dir",
        str(tmp_path / "r"),
    ]
    r = run_train_here(*args, *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    ms = metrics(tmp_path / "r")
    assert [m["step"] for m in ms] == [1, 2] and all(math.isfinite(m["loss"]) for m in ms)
    saved = json.loads((tmp_path / "r" / "config.json").read_text())["grpo"]
    value = saved[flags[0].removeprefix("--grpo.").replace("-", "_")]
    assert value == (float(flags[1]) if isinstance(value, float) else flags[1])
    if key == "entropy_kept":
        assert all(0.15 <= m[key] <= 0.3 for m in ms), [m[key] for m in ms]
    elif key == "entropy_bonus":  # 0.01 * the logged mean entropy
        assert all(m[key] == pytest.approx(0.01 * m["entropy"], rel=1e-4) for m in ms)
    elif key is not None:
        assert all(0 <= m[key] <= 1 for m in ms)


def test_a_bad_flag_is_a_one_line_error(tmp_path):
    r = run_train_here("tiny", "--out-dir", str(tmp_path / "x"), "--grpo.dual-clip", "0.9")
    assert r.returncode == 2 and "--grpo.dual-clip 0.9" in r.stderr.splitlines()[-1], r.stderr[-2000:]


def test_options_do_not_depend_on_the_micro_batch(tmp_path):
    """policy.update end to end: the high-entropy mask (one no-grad pass over the whole step first), the
    entropy bonus and the dual clip give the same step with micro-batches of 2 as all at once."""
    from train import main

    g = replace(PRESETS["tiny"][1].grpo, top_entropy_quantile=0.3, entropy_coef=0.01, dual_clip=2.0)
    main(tiny(tmp_path / "all", steps=1, grpo=g))
    main(tiny(tmp_path / "micro", steps=1, grpo=g, micro_batch=2))
    a, b = metrics(tmp_path / "all")[0], metrics(tmp_path / "micro")[0]
    for k in ("loss", "pg_loss", "entropy_bonus", "entropy_kept", "clip_dual", "grad_norm", "entropy"):
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k


def test_an_old_run_with_adv_std_norm_resumes(tmp_path):
    """config.json of a run saved before scale_rewards: adv_std_norm true / false is 'group' / 'none'."""
    from train import cli, main

    main(tiny(tmp_path / "run", steps=2, grpo=replace(PRESETS["tiny"][1].grpo, scale_rewards="none")))
    path = tmp_path / "run" / "config.json"
    saved = json.loads(path.read_text())
    for old, scale in ((True, "group"), (False, "none")):
        grpo = {k: v for k, v in saved["grpo"].items() if k != "scale_rewards"}
        path.write_text(json.dumps({**saved, "grpo": {**grpo, "adv_std_norm": old}}))
        assert load_config(tmp_path / "run").grpo.scale_rewards == scale
    # the run (adv_std_norm false) continues: the mapped config is the one it ran with
    main(cli(["--out-dir", str(tmp_path / "run"), "--resume", "--steps", "3"]))
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3]
    assert json.loads(path.read_text())["grpo"]["scale_rewards"] == "none"
    # an old key and its new name that disagree: refused, naming the file
    path.write_text(json.dumps({**saved, "grpo": {**saved["grpo"], "adv_std_norm": True}}))
    with pytest.raises(ValueError, match="adv_std_norm"):
        load_config(tmp_path / "run")
