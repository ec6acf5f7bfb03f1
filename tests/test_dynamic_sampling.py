"""--grpo.dynamic-sampling (nanogrpo/dynamic.py) and --grpo.mask-truncated (rollout.loss_rows): the filter,
the round logic on a fake sampler, the regrouped batch's loss, masked rows out of the loss, and train.py
end to end (flag off unchanged, exact resume, the command line)."""

import json
from dataclasses import replace

import pytest
import torch
from helpers import metrics, run_train_here, tiny

from nanogrpo.data import PromptOrder, prompt_budget, tokenize_prompts
from nanogrpo.dynamic import (
    choose_groups,
    draw_step,
    informative_groups,
    join_groups,
    split_groups,
)
from nanogrpo.model import lora
from nanogrpo.policy import load_policy
from nanogrpo.recipes.demo import demo_rows
from nanogrpo.recipes.presets import PRESETS
from nanogrpo.rollout import Rollout, assemble, loss_rows, make_batch, prompt_seed, rollout
from train import grpo_update as update

TINY = PRESETS["tiny"][1]
G = 4
nan = float("nan")


def test_informative_groups_on_constructed_rewards():
    reward = torch.tensor(
        [0.0, 1.0, 0.5, 0.5]  # spread 1
        + [0.3, 0.3, 0.3, 0.3]  # none
        + [0.2, nan, nan, nan]  # a single valid reward: no spread
        + [nan, nan, nan, nan]  # no reward at all
        + [0.2, nan, 0.9, nan]  # two valid, spread 0.7
        + [0.5, 0.5, 0.5 + 1e-7, 0.5]  # spread below the default tolerance
    )
    assert informative_groups(reward, G, 1e-6).tolist() == [True, False, False, False, True, False]
    assert informative_groups(reward, G, 0.0).tolist() == [True, False, False, False, True, True]
    assert informative_groups(reward, G, 0.8).tolist() == [True, False, False, False, False, False]
    assert informative_groups(reward, G, 1.0).tolist() == [False] * 6  # max - min must be ABOVE tol


def test_choose_groups_keeps_the_first_informative_and_fills_with_the_earliest():
    assert choose_groups([[True, False, True, True], [True, True, False, True]], 4) == [
        (0, 0), (0, 2), (0, 3), (1, 0),
    ]  # fmt: skip
    # too few: the earliest groups without spread fill the step, in drawing order
    assert choose_groups([[False, False, True, False], [False, True, False, False]], 4) == [
        (0, 0), (0, 1), (0, 2), (1, 1),
    ]  # fmt: skip
    assert choose_groups([[False] * 4], 4) == [(0, 0), (0, 1), (0, 2), (0, 3)]


# ---------------------------------------------------------------------------- the rounds, on a fake sampler


def data_rows(n: int, spread: set[int]) -> list[dict]:
    return [
        {"id": i, "prompt": f"q{i}", "_prompt_ids": [5 + i % 7] * (1 + i % 3), "spread": i in spread}
        for i in range(n)
    ]


def fake_scored(rows: list[dict], seed: int = 0) -> Rollout:
    """G completions per row of random tokens and lengths; rewards with spread only for rows marked so."""
    gen = torch.Generator().manual_seed(seed)
    N, T = len(rows) * G, 6
    lengths = torch.randint(1, T + 1, (N,), generator=gen)  # (N,)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # (N, T)
    ids = torch.where(mask > 0, torch.randint(3, 60, (N, T), generator=gen), 0)  # (N, T) pad 0 past the end
    logp = -torch.rand(N, T, generator=gen) * mask  # (N, T)
    texts = [f"{r['id']}.{j}" for r in rows for j in range(G)]
    roll = assemble(rows, texts, ids, mask, logp, lengths == T, 0, torch.device("cpu"))
    roll.seconds = 1.0
    reward = torch.tensor(
        [v for r in rows for v in ([0.0, 1.0, 0.5, nan] if r["spread"] else [0.3, 0.3, nan, 0.3])]
    )
    roll.reward, roll.parts = reward, {"a": [None if x != x else float(x) for x in reward.tolist()]}
    roll.details, roll.t_score = {"judge": [f"why {t}" for t in texts]}, 0.5
    return roll


def draw(spread: set[int], P=4, rounds=3, on=True, tol=1e-6):
    """draw_step over data whose rows in `spread` have reward spread; the data order as train.py's."""
    data = data_rows(24, spread)
    order = PromptOrder(len(data), 0, shuffle=False)
    cfg = replace(TINY, prompts_per_step=P)
    cfg = replace(
        cfg, grpo=replace(cfg.grpo, dynamic_sampling=on, max_resample_rounds=rounds, zero_spread_tol=tol)
    )
    rows0 = [data[i] for i in order.take(P)]
    drawn = []

    def sample_round(r):
        rows = rows0 if r == 0 else [data[i] for i in order.take(P)]
        drawn.append(fake_scored(rows, seed=r))
        return drawn[-1]

    return draw_step(sample_round, cfg, 0, torch.device("cpu")), drawn, order


def ids(d) -> list[int]:
    return [r["id"] for r in d.roll.rows]


def test_rounds_stop_once_the_step_holds_P_informative_groups():
    d, drawn, order = draw({1, 2, 5, 6, 7, 9})
    assert ids(d) == [1, 2, 5, 6]  # round 0 had 1 and 2; round 1's 7 is past P: discarded
    assert (d.groups_drawn, d.groups_kept, d.rounds, len(drawn), order.pos) == (8, 4, 1, 2, 8)
    assert informative_groups(d.roll.reward, G, 1e-6).all()  # every trained group has spread
    assert 2.0 <= d.t_sample < 2.5 and d.roll.t_score == 1.0  # both rounds (and the regrouping)
    # the trained groups' pieces, from the round that sampled them
    src = {r["id"]: (s, i) for s in drawn for i, r in enumerate(s.rows)}
    for k, row_id in enumerate(ids(d)):
        s, i = src[row_id]
        assert d.roll.texts[k * G : (k + 1) * G] == s.texts[i * G : (i + 1) * G]
        assert d.roll.details["judge"][k * G : (k + 1) * G] == s.details["judge"][i * G : (i + 1) * G]
        torch.testing.assert_close(
            d.roll.reward[k * G : (k + 1) * G], s.reward[i * G : (i + 1) * G], equal_nan=True
        )
        L = int(s.lengths[i * G : (i + 1) * G].max())
        assert torch.equal(
            d.roll.batch.targets[k * G : (k + 1) * G, :L], s.batch.targets[i * G : (i + 1) * G, :L]
        )
        assert torch.equal(d.roll.truncated[k * G : (k + 1) * G], s.truncated[i * G : (i + 1) * G])
    drawn_valid = torch.cat([s.reward for s in drawn])
    assert d.drawn_reward == (float(drawn_valid.nansum()), float((~drawn_valid.isnan()).sum()))


def test_when_the_rounds_run_out_the_earliest_groups_without_spread_fill_the_step():
    d, drawn, order = draw({9}, rounds=2)  # one informative group, in round 2
    assert ids(d) == [0, 1, 2, 9] and (d.groups_drawn, d.groups_kept, d.rounds, order.pos) == (12, 1, 2, 12)
    assert informative_groups(d.roll.reward, G, 1e-6).tolist() == [False, False, False, True]
    d, drawn, _ = draw({1}, rounds=2)  # the fill is round 0 as drawn: no regrouping
    assert ids(d) == [0, 1, 2, 3] and d.roll is drawn[0] and d.groups_kept == 1


def test_tolerance_and_the_flag_off():
    d, drawn, _ = draw({1, 2, 3, 4, 5, 6, 7}, tol=1.0)  # a spread of 1 is not above a tolerance of 1
    assert d.groups_kept == 0 and d.rounds == 3 and ids(d) == [0, 1, 2, 3]
    d, drawn, order = draw(set(), on=False)  # off: round 0 as it was sampled, whatever its spread
    assert len(drawn) == 1 and d.roll is drawn[0] and order.pos == 4
    assert (d.groups_drawn, d.groups_kept, d.rounds) == (4, 0, 0)


def test_split_then_join_is_the_identity():
    s = fake_scored(data_rows(3, {1}), seed=3)
    back = join_groups(split_groups(s), 0, torch.device("cpu"))
    a, b = s.batch, back.batch
    L = int(s.lengths.max())
    assert b.targets.shape[1] == L  # cut to the longest completion
    for x, y in [
        (a.ids[:, : a.prompt_len + L], b.ids),
        (a.attn[:, : a.prompt_len + L], b.attn),
        (a.targets[:, :L], b.targets),
    ]:
        assert torch.equal(x, y)
    assert torch.equal(a.mask[:, :L], b.mask) and torch.equal(a.group, b.group)
    assert torch.equal(s.sampler_logp[:, :L], back.sampler_logp)
    assert torch.equal(s.truncated, back.truncated) and torch.equal(s.lengths, back.lengths)
    assert s.texts == back.texts and s.parts == back.parts and s.details == back.details
    assert [x.completion for x in s.samples] == [x.completion for x in back.samples]
    assert [x.tokens for x in back.samples] == s.lengths.long().tolist()  # for the overlong grader
    torch.testing.assert_close(s.reward, back.reward, equal_nan=True)


def test_resampling_rounds_seed_apart_and_round_0_keeps_its_seed():
    assert prompt_seed(3, 7, 5) == (3 * 1_000_003 + 7) * 4099 + 5  # what runs always used
    seeds = {prompt_seed(3, 7, i, r) for r in range(4) for i in range(16)}
    assert len(seeds) == 64 and all(0 <= x < 2**63 for x in seeds)


# ---------------------------------------------------------------------------- the loss on a real tiny policy


@pytest.fixture(scope="module")
def tiny_policy():
    cfg = replace(TINY, optim=replace(TINY.optim, grad_clip=0.0))
    tok, limit = prompt_budget(cfg)
    rows = demo_rows()[:4]
    tokenize_prompts(rows, tok, "", limit, "refuse", "demo")
    torch.manual_seed(0)
    policy = load_policy(cfg, torch.device("cpu"), torch.float32, tok)
    for m in lora.lora_modules(policy.core).values():  # B = 0 would leave A without a gradient
        torch.nn.init.normal_(m.lora_B.weight, std=0.1)
    roll = rollout(policy, rows, 0, 0, cfg, torch.device("cpu"))
    return policy, roll, cfg


def step_delta(policy, batch, adv, sampler_logp, cfg):
    """The change update() makes with SGD at lr 1 (minus the gradient), the weights then put back."""
    params = lora.trainable_parameters(policy.model)
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=1.0)
    upd = update(
        policy,
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        batch,
        adv,
        None,
        sampler_logp,
        cfg,
    )
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before)])
    with torch.no_grad():
        for p, b in zip(params, before):
            p.copy_(b)
    return delta, upd


def direct_batch(roll, rows: torch.Tensor):
    """The batch of just these rows, built afresh from the rollout's prompts and completions."""
    b, Tp = roll.batch, roll.batch.prompt_len
    return make_batch(b.ids[rows, :Tp], b.attn[rows, :Tp], b.targets[rows], b.mask[rows])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_the_loss_on_the_kept_groups_is_the_loss_of_those_groups_fed_directly(tiny_policy, agg):
    policy, roll, cfg = tiny_policy
    cfg = replace(cfg, grpo=replace(cfg.grpo, loss_agg=agg))
    adv = torch.randn(len(roll.texts), generator=torch.Generator().manual_seed(1))  # (N,)
    reward = torch.rand(len(roll.texts))
    roll.reward, roll.parts, roll.details = reward, {}, {}
    groups = split_groups(roll)
    joined = join_groups([groups[1], groups[3]], policy.pad_id, torch.device("cpu"))
    rows = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])  # groups 1 and 3
    got, upd = step_delta(policy, joined.batch, adv[rows], joined.sampler_logp, cfg)
    want, upd_direct = step_delta(policy, direct_batch(roll, rows), adv[rows], roll.sampler_logp[rows], cfg)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert float(want.abs().max()) > 1e-4  # it trained
    assert (
        (upd.seqs, upd.tokens)
        == (8.0, float(roll.batch.mask[rows].sum()))
        == (upd_direct.seqs, upd_direct.tokens)
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_mask_truncated_is_the_gradient_of_the_batch_without_those_rows(tiny_policy, agg):
    policy, roll, cfg = tiny_policy
    cfg = replace(cfg, grpo=replace(cfg.grpo, loss_agg=agg, mask_truncated=True))
    trunc = torch.zeros(len(roll.texts), dtype=torch.bool)
    trunc[[1, 2, 6, 9, 15]] = True  # a constructed case: these rows hit max_new_tokens
    roll = replace(roll, truncated=trunc)
    adv = torch.randn(len(roll.texts), generator=torch.Generator().manual_seed(2))  # (N,)
    batch, adv_b, ref_b, sampler_b, masked = loss_rows(roll, adv, None, True)
    got, upd = step_delta(policy, batch, adv_b, sampler_b, cfg)
    keep = (~trunc).nonzero().squeeze(1)
    want, upd_direct = step_delta(policy, direct_batch(roll, keep), adv[keep], roll.sampler_logp[keep], cfg)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)
    assert masked == 5 and upd.seqs == upd_direct.seqs == len(trunc) - 5
    assert upd.tokens == float(
        roll.batch.mask.sum() - roll.batch.mask[trunc].sum()
    )  # exactly those rows' tokens
    full, _ = step_delta(policy, roll.batch, adv, roll.sampler_logp, cfg)
    assert float((full - got).abs().max()) > 1e-5  # the flag changed the step
    off = loss_rows(roll, adv, None, False)
    assert off[0] is roll.batch and off[1] is adv and off[4] == 0


def test_mask_truncated_when_every_completion_is_truncated(tiny_policy):
    """Nothing left to train: the rows stay (every rank runs its forward and backward), advantage 0."""
    _, roll, _ = tiny_policy
    roll = replace(roll, truncated=torch.ones(len(roll.texts), dtype=torch.bool))
    adv = torch.randn(len(roll.texts))
    batch, adv_b, _, sampler_b, masked = loss_rows(roll, adv, None, True)
    assert batch is roll.batch and masked == 0 and not adv_b.any() and sampler_b is roll.sampler_logp


# ---------------------------------------------------------------------------- train.py end to end


def grpo(**kw):
    return replace(PRESETS["tiny"][1].grpo, **kw)


def test_flag_off_is_unchanged_and_nothing_to_drop_changes_nothing(tmp_path):
    """Off, a step is round 0 as sampled; on, with every group informative (the tiny preset's groups
    all spread), the trained batch and every logged number are the same, bit for bit."""
    from train import main

    main(tiny(tmp_path / "off", steps=3))
    main(tiny(tmp_path / "on", steps=3, grpo=grpo(dynamic_sampling=True, zero_spread_tol=0.0)))
    off, on = metrics(tmp_path / "off"), metrics(tmp_path / "on")
    assert off == on
    assert all((m["groups_drawn"], m["groups_kept"], m["resample_rounds"]) == (2, 2, 0) for m in off)
    assert all(m["reward_drawn"] == m["reward"] for m in off) and "frac_masked" not in off[0]


def test_dynamic_sampling_trains_the_informative_groups_and_resumes_exactly(tmp_path):
    from train import main

    g = grpo(dynamic_sampling=True, zero_spread_tol=0.3)  # the tiny preset's groups spread by ~0.2-0.6
    main(tiny(tmp_path / "straight", steps=4, grpo=g))
    main(tiny(tmp_path / "resumed", steps=2, grpo=g))
    main(tiny(tmp_path / "resumed", steps=4, grpo=g, resume=True))
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert a == b
    assert any(m["resample_rounds"] > 0 for m in a)  # the rounds ran
    assert all(m["groups_drawn"] == 2 * (m["resample_rounds"] + 1) and m["groups_kept"] <= 2 for m in a)
    for m, line in zip(a, (tmp_path / "straight" / "samples.jsonl").read_text().splitlines()):
        groups = json.loads(line)["groups"]  # samples.jsonl shows the trained groups
        rewards = torch.tensor([[c["reward"] for c in grp["completions"]] for grp in groups]).flatten()
        assert len(groups) == 2 and int(informative_groups(rewards, G, 0.3).sum()) == m["groups_kept"]


def test_the_command_line_runs(tmp_path):
    r = run_train_here(
        "tiny", "--grpo.dynamic-sampling", "--steps", "2", "--no-plots", "--out-dir", str(tmp_path / "run")
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train_here(
        "tiny", "--grpo.dynamic-sampling", "--grpo.zero-spread-tol", "0.3", "--grpo.mask-truncated",
        "--steps", "2", "--no-plots", "--out-dir", str(tmp_path / "both"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ms = metrics(tmp_path / "both")
    assert [m["step"] for m in ms] == [1, 2] and all(m["loss"] == m["loss"] for m in ms)  # no NaN
    assert all({"groups_drawn", "groups_kept", "resample_rounds", "frac_masked"} <= m.keys() for m in ms)
