"""--resume continues a run as it was configured: config.json is the default the flags override, changes that
would break exact resumption are refused by name, and a fresh run never mixes into another run's folder."""

import json
from dataclasses import asdict, replace

import pytest
from helpers import TINY, metrics, run_train, run_train_here, saved_run

from nanogrpo.config import OptimConfig
from nanogrpo.infra.config_file import load_config
from rewards.options import JudgeConfig, RewardConfig
from train import cli, main


def test_config_json_round_trips_nested_options_and_tuples(tmp_path):
    reward = RewardConfig(spec="judge:1", format_tags=("a", "b"), judge=JudgeConfig(model="m", timeout_s=5.0))
    cfg = saved_run(tmp_path, reward=reward, optim=OptimConfig(betas=(0.8, 0.9)))
    back = load_config(tmp_path)
    assert back == cfg and isinstance(back.reward.format_tags, tuple) and isinstance(back.optim.betas, tuple)
    (tmp_path / "config.json").write_text(json.dumps({**asdict(cfg), "optim": {"lr": 1.0, "momentum": 0.9}}))
    with pytest.raises(ValueError, match="optim.momentum is not an option"):
        load_config(tmp_path)


@pytest.mark.parametrize("preset", [[], ["tiny"], ["demo"]])
def test_resume_defaults_are_the_run_config_not_the_preset(tmp_path, preset):
    cfg = saved_run(
        tmp_path, optim=replace(TINY.optim, lr=5e-4), sampling=replace(TINY.sampling, stop=("\n",))
    )
    assert cli([*preset, "--out-dir", str(tmp_path), "--resume"]) == replace(cfg, resume=True)


def test_resume_refuses_each_change_by_flag_and_says_what_to_do(tmp_path):
    saved_run(tmp_path, optim=replace(TINY.optim, lr=5e-4))
    args = [
        "--out-dir",
        str(tmp_path),
        "--resume",
        "--optim.lr",
        "1e-3",
        "--grpo.group-size",
        "8",
        "--wandb",
        "p",
    ]
    with pytest.raises(ValueError) as e:
        cli(args)
    msg = str(e.value)
    assert "--grpo.group-size: 4 -> 8" in msg and "--optim.lr: 0.0005 -> 0.001" in msg
    assert "--wandb" not in msg  # logging only: allowed
    assert "another --out-dir" in msg and "Drop them" in msg


@pytest.mark.parametrize(
    "schedule, refused",
    [("constant", False), ("cosine", True)],  # cosine decays over --steps: a new total changes every later lr
)
def test_more_steps_extend_a_constant_schedule_only(tmp_path, schedule, refused):
    cfg = saved_run(tmp_path, steps=4, optim=replace(TINY.optim, schedule=schedule, warmup_steps=2))
    args = [
        "--out-dir",
        str(tmp_path),
        "--resume",
        "--steps",
        "8",
        "--save-every",
        "2",
        "--log-samples-every",
        "0",
    ]
    if refused:
        with pytest.raises(ValueError, match=r"--steps: 4 -> 8 \(--optim.schedule cosine"):
            cli(args)
    else:
        assert cli(args) == replace(cfg, resume=True, steps=8, save_every=2, log_samples_every=0)


@pytest.mark.parametrize("beta", [["--grpo.beta", "0.1"], ["--grpo.beta=0.1"]])
def test_beta_without_a_kl_placement_is_refused(beta):
    with pytest.raises(ValueError, match="--grpo.beta has no effect with --grpo.kl-placement none"):
        cli(["tiny", *beta])
    assert cli(["tiny", "--grpo.kl-placement", "loss", *beta]).grpo.beta == 0.1
    assert cli(["tiny"]).grpo.kl_placement == "none"  # the default beta, not named, is fine


def test_a_fresh_run_does_not_write_into_another_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="pass --resume to continue it, or pick another --out-dir"):
        main(replace(TINY, out_dir=str(tmp_path)))  # refused before the model loads
    assert not (tmp_path / "config.json").exists()


def test_resume_before_the_first_checkpoint_starts_again_without_duplicate_steps(tmp_path):
    cfg = saved_run(tmp_path, steps=2, save_every=0)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # a run that died after step 1, before saving
    main(replace(cfg, resume=True))
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]


def test_resume_from_the_command_line(tmp_path):
    run = tmp_path / "run"
    r = run_train("tiny", "--out-dir", str(run), "--steps", "2", "--optim.lr", "5e-4", "--no-plots")
    assert r.returncode == 0, r.stderr[-3000:]
    before = (run / "config.json").read_text()

    r = run_train_here("tiny", "--out-dir", str(run), "--resume", "--optim.lr", "1e-3")
    assert r.returncode == 2 and "--optim.lr: 0.0005 -> 0.001" in r.stderr.splitlines()[-1], r.stderr[-2000:]
    r = run_train_here("tiny", "--out-dir", str(run))  # the same command again, without --resume
    assert r.returncode == 2 and "pass --resume" in r.stderr.splitlines()[-1], r.stderr[-2000:]
    assert (run / "config.json").read_text() == before

    # constant lr: extend the run
    r = run_train_here("tiny", "--out-dir", str(run), "--resume", "--steps", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "preset is not applied" in r.stdout
    ms = metrics(run)
    assert [m["step"] for m in ms] == [1, 2, 3, 4] and {m["lr"] for m in ms} == {
        5e-4
    }  # not the preset's 1e-3
    saved = json.loads((run / "config.json").read_text())
    assert (saved["optim"]["lr"], saved["steps"], saved["resume"]) == (5e-4, 4, True)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--grpo.beta", "0.1"], "--grpo.beta has no effect with --grpo.kl-placement none"),
        (["--resume"], "config.json does not exist, so there is no run to continue"),
    ],
)
def test_startup_refusals_exit_2(tmp_path, args, needle):
    r = run_train_here("tiny", "--out-dir", str(tmp_path / "empty"), *args)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and lines[-1].startswith("error:") and needle in lines[-1], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "empty" / "metrics.jsonl").exists()


@pytest.mark.parametrize("old,scale", [(True, "group"), (False, "none")])
def test_a_config_saved_with_adv_std_norm_loads_as_scale_rewards(tmp_path, old, scale):
    """Runs saved before --grpo.scale-rewards replaced grpo.adv_std_norm resume with the same advantages."""
    cfg = saved_run(tmp_path)
    saved = asdict(cfg)
    grpo = {k: v for k, v in saved["grpo"].items() if k != "scale_rewards"}
    (tmp_path / "config.json").write_text(json.dumps({**saved, "grpo": {**grpo, "adv_std_norm": old}}))
    assert load_config(tmp_path) == replace(cfg, grpo=replace(cfg.grpo, scale_rewards=scale))
    assert cli(["--out-dir", str(tmp_path), "--resume"]).grpo.scale_rewards == scale


def test_the_trainer_state_loads_onto_the_host(tmp_path, monkeypatch):
    """A state saved from cuda:0 loads where the load puts it: without map_location every torchrun rank
    would put its optimizer state on cuda:0. The load is to the host; the optimizer moves each tensor to its
    parameter's device (load_state_dict)."""
    import torch

    from nanogrpo.infra import checkpoint as ckpt

    main(replace(TINY, out_dir=str(tmp_path), steps=1))
    seen = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.append(k) or load(*a, **k))
    state = ckpt.load_trainer_state(ckpt.latest_checkpoint(tmp_path / "ckpt"))
    assert seen and all(k.get("map_location") == "cpu" for k in seen), seen
    assert state["step"] == 1
