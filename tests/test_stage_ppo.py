"""--algo ppo: GAE against hand-computed numbers, the value head (trained on AdamW, saved, restored on
--resume, invisible to GRPO), the clipped value loss, the config checks, and a tiny end-to-end run."""

import json
from dataclasses import asdict, replace

import pytest
import torch
from helpers import metrics
from safetensors.torch import load_file

from nanogrpo.config import updates_per_step
from nanogrpo.infra.flag_checks import check_config
from nanogrpo.model.fast.shared_prompt import FastLogprobHead
from nanogrpo.model.logprobs import ValueHead, completion_logprobs
from nanogrpo.model.sampling import pad_left
from nanogrpo.model.transformer import Transformer
from nanogrpo.optim import build_optimizer, muon_groups
from nanogrpo.policy import VALUE_HEAD, load_policy
from nanogrpo.recipes.presets import PRESETS
from nanogrpo.rollout import make_batch
from nanogrpo.stages.ppo import gae, ppo_update, token_rewards, value_loss, whiten
from train import cli, main

TINY = replace(PRESETS["tiny"][1], plots=False)  # no PNGs or run page: nothing here reads them
PPO_METRICS = (
    "step", "reward", "reward/rouge_l", "reward/consistency", "loss", "pg_loss", "vf_loss", "value_mean",
    "return_mean", "explained_variance", "clip_low", "kl", "len_mean", "tokens", "t_sample", "t_score",
    "grad_norm", "lr", "t_train",
)  # fmt: skip


def ppo_cfg(tmp_path, **kw):
    return replace(TINY, algo="ppo", out_dir=str(tmp_path), **kw)


def tiny_batch(seed: int = 0, n: int = 4, tc: int = 6):
    """Two prompts, n completions of random tokens, the second half of them shorter (right padding)."""
    g = torch.Generator().manual_seed(seed)
    p_ids, p_mask = pad_left([[1, 5, 9, 11], [3, 4]], 0)
    p_ids, p_mask = p_ids.repeat_interleave(n // 2, 0), p_mask.repeat_interleave(n // 2, 0)
    ids = torch.randint(3, 1000, (n, tc), generator=g)
    mask = torch.ones(n, tc)
    mask[n // 2 :, tc - 2 :] = 0
    return make_batch(p_ids, p_mask, ids, mask)


# ----------------------------------------------------------------------------- GAE


def test_gae_matches_hand_computed_numbers_and_ignores_padding():
    """gamma 0.9, lam 0.8 (gamma * lam = 0.72); V after the last token is 0.
    row 0, 3 tokens, r = (0, 0, 1), V = (0.5, 0.4, 0.6):
      delta = (0 + 0.9*0.4 - 0.5, 0 + 0.9*0.6 - 0.4, 1 - 0.6) = (-0.14, 0.14, 0.4)
      A_2 = 0.4;  A_1 = 0.14 + 0.72*0.4 = 0.428;  A_0 = -0.14 + 0.72*0.428 = 0.16816
      R = A + V = (0.66816, 0.828, 1.0)
    row 1, 2 tokens then padding holding garbage (r 5, V 9): r = (0.2, 1), V = (0.1, 0.3):
      delta = (0.2 + 0.9*0.3 - 0.1, 1 - 0.3) = (0.37, 0.7);  A = (0.37 + 0.72*0.7, 0.7) = (0.874, 0.7)
      R = (0.974, 1.0), and 0 on the padding."""
    r = torch.tensor([[0.0, 0.0, 1.0], [0.2, 1.0, 5.0]])
    v = torch.tensor([[0.5, 0.4, 0.6], [0.1, 0.3, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.16816, 0.428, 0.4], [0.874, 0.7, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.66816, 0.828, 1.0], [0.974, 1.0, 0.0]]))
    alone = gae(r[1:, :2], v[1:, :2], mask[1:, :2], gamma=0.9, lam=0.8)  # the same row without padding
    torch.testing.assert_close(adv[1:, :2], alone[0])


def test_gae_with_lam_and_gamma_one_gives_the_reward_to_go():
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    lengths = torch.tensor([7, 1, 4, 6, 3])
    mask = (torch.arange(7)[None] < lengths[:, None]).float()  # (5, 7)
    adv, ret = gae(r, v, mask, gamma=1.0, lam=1.0)
    to_go = (r * mask).flip(1).cumsum(1).flip(1) * mask  # sum_{s >= t} r_s
    torch.testing.assert_close(ret, to_go)
    torch.testing.assert_close(adv, (to_go - v) * mask)
    adv0, ret0 = gae(r, v, mask, gamma=1.0, lam=0.0)  # lam 0: one-step TD, R_t = r_t + V(s_{t+1})
    next_v = torch.cat([v[:, 1:] * mask[:, 1:], torch.zeros(5, 1)], 1)
    torch.testing.assert_close(ret0, (r + next_v) * mask)


def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_everywhere():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, 7.0, 7.0]])
    ref = torch.tensor([[-1.5, -2.0, -1.0], [-0.5, 0.0, 0.0]])
    r = token_rewards(torch.tensor([1.0, 0.5]), logp, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(r, torch.tensor([[-0.05, 0.0, 0.95], [0.55, 0.0, 0.0]]))
    assert torch.equal(
        token_rewards(torch.tensor([1.0, 0.5]), logp, None, mask, 0.0)[:, -1], torch.tensor([1.0, 0])
    )


def test_whiten_and_the_clipped_value_loss():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w = whiten(torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 5.0]]), mask)
    on = w[mask > 0]
    assert abs(float(on.mean())) < 1e-6 and abs(float(on.std()) - 1) < 1e-6 and w[0, 2] == 0
    # V_old 0, R 1: a value that moved to 0.5 is clipped back to 0.2, so the clipped error (0.64) counts
    v, old, ret, m = torch.tensor([[0.5]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1)
    loss, stats = value_loss(v, old, ret, m, clip=0.2, num_tokens=1.0)
    assert abs(float(loss) - 0.5 * 0.64) < 1e-6 and stats["vf_clipped"] == 1
    assert abs(float(value_loss(v, old, ret, m, clip=0.0, num_tokens=1.0)[0]) - 0.5 * 0.25) < 1e-6
    loss2, _ = value_loss(v, old, ret, m, clip=0.2, num_tokens=4.0)  # normalised by the step's tokens
    assert abs(float(loss2) - 0.5 * 0.64 / 4) < 1e-6


# ----------------------------------------------------------------------------- the value head


def test_grpo_forward_is_unchanged_without_a_value_head(tiny_model_dir):
    """Without a value head the state dict and outputs are the Transformer's; with one (non-zero, so it
    matters) log-probs and entropies are bit-for-bit the same and the values come as a third tensor."""
    torch.manual_seed(0)
    model = Transformer.from_pretrained(tiny_model_dir)
    batch = tiny_batch()
    plain = FastLogprobHead(model)
    assert list(plain.state_dict()) == ["model." + k for k in model.state_dict()]
    vh = ValueHead(model.config.hidden_size)
    torch.nn.init.normal_(vh.weight)
    with_v = FastLogprobHead(model, vh)
    a = completion_logprobs(plain, batch)
    b = completion_logprobs(with_v, batch)
    lp, ent, values = completion_logprobs(with_v, batch, values=True)
    assert len(a) == 2 and len(b) == 2
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.equal(lp, a[0]) and torch.equal(ent, a[1]) and len(completion_logprobs(model, batch)) == 2
    assert values.shape == batch.mask.shape and bool((values[batch.mask == 0] == 0).all())
    assert bool((values[batch.mask > 0] != 0).all())
    with pytest.raises(ValueError, match="needs a value head"):
        completion_logprobs(plain, batch, values=True)


def test_value_head_is_on_adamw_and_gets_gradients(tmp_path):
    policy = load_policy(ppo_cfg(tmp_path), "cpu", torch.float32)
    vh = policy.value_head
    assert (
        vh is not None
        and load_policy(replace(TINY, out_dir=str(tmp_path)), "cpu", torch.float32).value_head is None
    )
    opt = build_optimizer(policy.model, TINY.optim)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in in_opt for p in vh.parameters()) and isinstance(opt, torch.optim.AdamW)
    named = [(n, p) for n, p in policy.model.named_parameters() if p.requires_grad]
    mats, rest = muon_groups(named)  # --optim.name muon: the head's vector stays on AdamW
    assert {id(p) for p in vh.parameters()} <= {id(p) for p in rest}
    assert not {id(p) for p in vh.parameters()} & {id(p) for p in mats}
    with torch.no_grad():
        vh.weight.normal_(std=0.1)  # a trained head: the value loss then reaches the adapters too
    batch = tiny_batch()
    _, _, values = completion_logprobs(policy.model, batch, values=True)
    ((values - 1.0) ** 2 * batch.mask).sum().backward()
    assert float(vh.weight.grad.abs().sum()) > 0 and float(vh.bias.grad.abs().sum()) > 0
    lora_b = [p for n, p in policy.model.named_parameters() if "lora_B" in n]
    assert any(float(p.grad.abs().sum()) > 0 for p in lora_b)


@pytest.mark.parametrize("value_clip", [0.0, 0.2])
def test_ppo_update_lowers_the_value_loss_on_a_fixed_batch(tmp_path, value_clip):
    """Epochs over one batch fit the head to the returns; with a value clip, V stays within the clip of
    V_old (0 here) for the whole step, so the loss cannot fall below that of |V - R| = |R| - clip."""
    ppo = replace(TINY.ppo, epochs=12, kl_coef=0.0, value_clip=value_clip)
    cfg = ppo_cfg(tmp_path, ppo=ppo, optim=replace(TINY.optim, lr=1e-2), micro_batch=4)
    policy = load_policy(cfg, "cpu", torch.float32)
    opt = build_optimizer(policy.model, cfg.optim)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    batch = tiny_batch(n=6)
    mask = batch.mask
    returns = torch.where(mask > 0, torch.linspace(0.4, 1.0, mask.shape[1]).expand_as(mask), 0.0)  # (6, 6)
    adv = whiten(torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)), mask)
    zeros = torch.zeros_like(mask)
    upd = ppo_update(policy, opt, sched, batch, adv, returns, zeros, zeros, None, cfg)
    v = upd.vf_losses
    assert len(v) == 12 and upd.metrics["vf_loss"] == pytest.approx(v[0]) and updates_per_step(cfg) == 12
    assert v[0] == pytest.approx(0.5 * float((returns**2).sum() / mask.sum()))  # V starts at 0
    if value_clip == 0:
        assert v[-1] < 0.2 * v[0], v
    else:
        floor = 0.5 * float(((returns - value_clip).clamp(min=0) ** 2).sum() / mask.sum())
        assert min(v) >= floor - 1e-6 and v[-1] < 0.8 * v[0] and upd.metrics["vf_clip_frac"] > 0, v
    off = upd.metrics["offpolicy/clip_low"] + upd.metrics["offpolicy/clip_high"]
    assert (
        off > 0 and upd.metrics["clip_low"] == upd.metrics["clip_high"] == 0
    )  # later epochs clip, not the 1st


# ----------------------------------------------------------------------------- the config checks


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"sampling": replace(TINY.sampling, temperature=0.0)}, "temperature > 0"),
        ({"sampling": replace(TINY.sampling, top_k=5)}, "--sampling.top-k 0"),
        ({"sampling": replace(TINY.sampling, top_p=0.9)}, "--sampling.top-p 1"),
        ({"ppo": replace(TINY.ppo, gamma=1.5)}, "--ppo.gamma 1.5"),
        ({"ppo": replace(TINY.ppo, lam=-0.1)}, "--ppo.lam"),
        ({"ppo": replace(TINY.ppo, value_clip=-1.0)}, "--ppo.value-clip"),
        ({"grpo": replace(TINY.grpo, num_iterations=2)}, "--ppo.epochs"),
        ({"grpo": replace(TINY.grpo, kl_placement="loss")}, "--ppo.kl-coef"),
        ({"grpo": replace(TINY.grpo, dynamic_sampling=True)}, "GRPO only"),
    ],
)
def test_ppo_config_checks_say_the_fix(tmp_path, change, needle):
    with pytest.raises(ValueError, match="^--") as e:
        check_config(ppo_cfg(tmp_path, **change))
    assert needle in str(e.value)
    check_config(ppo_cfg(tmp_path))  # the defaults pass


# ----------------------------------------------------------------------------- end to end


def test_ppo_run_logs_its_metrics_and_resume_restores_the_value_head(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    main(cli(["tiny", "--algo", "ppo", "--no-plots", "--out-dir", str(straight), "--steps", "3"]))
    main(cli(["tiny", "--algo", "ppo", "--no-plots", "--out-dir", str(resumed), "--steps", "2"]))
    ckpt = resumed / "ckpt" / "step_000002"
    saved = load_file(str(ckpt / VALUE_HEAD))
    assert float(saved["weight"].abs().sum()) > 0  # the head trained
    policy = load_policy(ppo_cfg(resumed), "cpu", torch.float32)  # a fresh head (zeros) ...
    policy.load_weights(ckpt)  # ... takes the checkpoint's values
    assert torch.equal(policy.value_head.weight.detach(), saved["weight"])
    assert torch.equal(policy.value_head.bias.detach(), saved["bias"])
    main(cli(["--resume", "--out-dir", str(resumed), "--steps", "3"]))
    a, b = metrics(straight), metrics(resumed)
    assert [m["step"] for m in a] == [1, 2, 3] and a == b  # exact: the head came back with its optimizer
    for key in PPO_METRICS:
        assert key in json.loads((straight / "metrics.jsonl").read_text().splitlines()[0]), key
    assert all(m["kl"] is not None and m["vf_loss"] >= 0 for m in a)
    final = {k: load_file(str(d / "adapter" / VALUE_HEAD)) for k, d in (("a", straight), ("b", resumed))}
    assert all(torch.equal(final["a"][n], final["b"][n]) for n in ("weight", "bias"))
    assert json.loads((straight / "config.json").read_text())["algo"] == "ppo"


# ----------------------------------------------------------------------------- the study's pieces


def test_study_commands_parse_and_its_summary_and_plot_work_on_fake_curves(tmp_path):
    from nanogrpo.lab import ppo_vs_grpo as study

    cells = study.grid([1e-4, 5e-4], [0.05, 0.1], [0, 1], grpo_kl=0.05)
    assert len(cells) == 12 and sum(c.algo == "ppo" for c in cells) == 8
    for cell in (cells[0], cells[-1]):  # the command lines are valid train.py flags that pass the checks
        cfg = cli(study.command(cell, tmp_path / cell.name, study.Shape(steps=3, group=4))[2:])
        check_config(cfg)
        assert cfg.algo == cell.algo and cfg.optim.lr == cell.lr and cfg.reward.spec == "contains:1"
        assert (cfg.ppo.samples_per_prompt if cell.algo == "ppo" else cfg.grpo.group_size) == 4
    nan = float("nan")
    fake = lambda loss, vf: {  # noqa: E731
        "loss": loss, "pg_loss": loss, "vf_loss": vf, "reward": [0.0, 0.5, 1.0, 1.0], "kl": [0.0] * 4,
        "explained_variance": [nan, 0.1, 0.2, 0.3], "grad_norm": [1.0] * 4, "value_mean": [0.0] * 4,
    }  # fmt: skip
    results = [
        {"cell": asdict(cells[0]), "curves": fake([0.1, 5.0, 40.0, 30.0], [1.0, 50, 400, 300])},
        {"cell": asdict(cells[1]), "curves": fake([0.1, 0.2, 0.3, 0.2], [1.0, 2, 3, 2])},
        {"cell": asdict(cells[-1]), "curves": fake([0.0, -0.1, 0.1, 0.0], [nan] * 4)},
    ]
    rows = study.summarise(results, tail=2)
    ppo, grpo_row = rows
    assert (
        ppo["seeds"] == 2
        and ppo["loss_peak"] == 40.0
        and ppo["over_28.9"] == 1
        and ppo["vf_loss_peak"] == 400
    )
    assert ppo["loss_end"] == pytest.approx((35.0 + 0.25) / 2) and ppo["ev_end"] == pytest.approx(0.25)
    assert grpo_row["vf_loss_peak"] is None and grpo_row["over_28.9"] == 0 and grpo_row["reward_end"] == 1.0
    table = study.markdown(rows, tail=2)
    assert table.count("\n") == 4 and "| PPO lr 0.0001 KL 0.05 | 2 |" in table and "1/2" in table
    assert study.plot(results, tmp_path / "img" / "p.png").stat().st_size > 1000


def test_study_plot_goes_to_its_out_folder_not_into_docs(tmp_path, monkeypatch):
    from nanogrpo.lab import ppo_vs_grpo as study

    figure = study.TRAIN_PY.parent / "docs" / "img" / "ppo_vs_grpo.png"
    before = figure.stat().st_mtime_ns if figure.exists() else None
    curves = {k: [0.1, 0.2, 0.3] for k in study.CURVES}
    fake_runs = lambda cells, out, shape, threads: [  # noqa: E731  (no train.py: the plot is the subject)
        {"cell": asdict(c), "curves": curves, "wall_s": 1.0} for c in cells
    ]
    monkeypatch.setattr(study, "run_cells", fake_runs)
    monkeypatch.chdir(tmp_path)  # a relative docs/img/... would land here
    flags = ["--lrs", "1e-4", "--kls", "0.05", "--seeds", "0", "--steps", "3"]
    study.main([*flags, "--out", "study"])
    assert (tmp_path / "study" / "ppo_vs_grpo.png").stat().st_size > 1000
    assert not (tmp_path / "docs").exists()
    assert (figure.stat().st_mtime_ns if figure.exists() else None) == before
    study.main([*flags, "--out", "study", "--plot", "docs/img/ppo_vs_grpo.png"])  # by name only
    assert (tmp_path / "docs" / "img" / "ppo_vs_grpo.png").is_file()
