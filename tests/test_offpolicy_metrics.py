"""Honest off-policy metrics: with more than one pass over a step's samples, the clip metrics of the later
passes are logged apart (offpolicy/*), in GRPO and PPO alike, and `lr` is the learning rate the step used."""

import json
from dataclasses import replace

import torch

from nanogrpo.config import updates_per_step
from nanogrpo.optim import build_scheduler
from nanogrpo.recipes.presets import PRESETS
from train import main

TINY = replace(PRESETS["tiny"][1], plots=False)  # no PNGs or run page: nothing here reads them


def metrics(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_later_passes_report_their_own_clip_metrics(tmp_path):
    """mu = 3 with a clip band of 1% and a large lr: after pass 1's optimizer step the ratios leave the
    band, so passes 2-3 clip while pass 1 (ratio exactly 1) cannot. Before, only pass 1 was logged: 0."""
    g = replace(TINY.grpo, num_iterations=3, eps_low=0.01, eps_high=0.01)
    main(replace(TINY, out_dir=str(tmp_path), steps=1, grpo=g, optim=replace(TINY.optim, lr=5e-2)))
    ms = metrics(tmp_path)  # one step: at this lr the next one's groups all tie (no advantage, no clip)
    assert all(m["clip_low"] == m["clip_high"] == 0 and m["ratio_max"] == 1 for m in ms)  # the first pass
    assert all(m["offpolicy/clip_low"] + m["offpolicy/clip_high"] > 0 for m in ms), ms
    assert all(m["offpolicy/ratio_max"] > 1.01 for m in ms)
    single = replace(TINY, out_dir=str(tmp_path / "mu1"), steps=1)
    main(single)
    assert not any(k.startswith("offpolicy/") for k in metrics(tmp_path / "mu1")[0])  # one pass: none


def test_ppo_reports_its_epochs_as_grpo_does(tmp_path):
    from nanogrpo.config import PPOConfig

    cfg = replace(TINY, algo="ppo", out_dir=str(tmp_path), steps=1, ppo=replace(PPOConfig(), epochs=3))
    g = replace(cfg.grpo, eps_low=0.01, eps_high=0.01)
    main(replace(cfg, grpo=g, optim=replace(TINY.optim, lr=5e-2)))
    m = metrics(tmp_path)[0]
    assert m["clip_low"] == m["clip_high"] == 0 and "clip_frac" not in m
    assert m["offpolicy/clip_low"] + m["offpolicy/clip_high"] > 0 and m["offpolicy/ratio_max"] > 1.01


def test_the_logged_lr_is_the_one_the_step_used(tmp_path):
    """A linear warmup over 3 steps: step k logs the lr of its own optimizer step (the first of them with
    mu > 1), not the scheduler's next value."""
    optim = replace(TINY.optim, warmup_steps=3, lr=1e-3)
    cfg = replace(TINY, out_dir=str(tmp_path), steps=3, optim=optim)
    main(cfg)
    sched = build_scheduler(torch.optim.SGD([torch.zeros(1)], lr=optim.lr), optim, 3 * updates_per_step(cfg))
    want = []
    for _ in range(3):
        want.append(sched.get_last_lr()[0])
        for _ in range(updates_per_step(cfg)):
            sched.optimizer.step()
            sched.step()
    got = [m["lr"] for m in metrics(tmp_path)]
    assert got == want and got[0] < got[1] < got[2], (got, want)
