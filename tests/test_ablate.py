"""nanogrpo.lab.ablate and the toy task: a tiny grid end to end, the collapse detector, the train.py hook."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nanogrpo.config import GRPOConfig
from nanogrpo.lab import ablate, ablate_lm
from nanogrpo.lab.toy import (
    TabularPolicy,
    ToySettings,
    optimal_policy_logp,
    toy_optimum,
    toy_reward,
    train_toy,
)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # ~100-number tensors: threads only contend with the other tests
    yield
    torch.set_num_threads(n)


def test_tiny_grid_writes_sane_outputs(tmp_path, one_thread):
    argv = ["toy", "--variants", "none", "k1-reward", "--betas", "0.05", "--seeds", "0", "1"]
    argv += ["--policy", "on", "off", "--std-norm", "on", "--steps", "15", "--out", str(tmp_path)]
    ablate.main(argv)
    assert (tmp_path / "toy_table.md").read_text().count(
        "\n"
    ) == 2 + 4  # header, rule, 2 variants x 2 settings
    data = json.loads((tmp_path / "toy_results.json").read_text())
    assert len(data["runs"]) == 8 and len(data["summary"]) == 4
    assert set(data["meta"]["optimum"]) == {"0.05"}
    for r in data["runs"]:
        c = r["curves"]
        assert len(c["kl"]) == 16 and len(c["grad_norm"]) == 15
        assert c["kl"][0] == pytest.approx(0.0, abs=1e-12)  # every run starts at the reference
        assert all(k >= -1e-12 for k in c["kl"]) and all(0 <= x <= 1 for x in c["reward"])
        assert all(h > 0 for h in c["entropy"]) and all(math.isfinite(g) for g in c["grad_norm"])
        assert set(r["collapse"]) == {"entropy", "reward", "grad", "any"}
    pngs = sorted(p.name for p in tmp_path.glob("toy_*.png"))
    assert pngs == ["toy_off_std_b0.05.png", "toy_on_std_b0.05.png"]
    assert all((tmp_path / p).stat().st_size > 10_000 for p in pngs)


def test_unbiased_kl_runs_converge_to_the_analytic_optimum(one_thread):
    """k1 in the reward with an RLOO baseline is an unbiased gradient of E[r] - beta KL: it reaches pi*."""
    s = ToySettings(steps=200, lr=0.02)
    cfg = GRPOConfig(group_size=8, beta=0.2, kl_placement="reward", kl_estimator="k1", adv_estimator="rloo")
    c = train_toy(replace(cfg, scale_rewards="none"), 0, s)
    assert c["dist"][-1] < 0.1 * c["dist"][0]
    assert c["kl"][-1] == pytest.approx(toy_optimum([0.2], s)["0.2"]["kl"], rel=0.3)


def test_optimum_is_ref_tilted_by_the_reward():
    pol = TabularPolicy()
    theta_ref = pol.init(1.0, torch.Generator().manual_seed(0))
    r = toy_reward(pol)
    ls = optimal_policy_logp(pol, theta_ref, r, 0.5)
    want = pol.seq_logp(theta_ref) + r / 0.5
    torch.testing.assert_close(ls, want - torch.logsumexp(want, 0))
    assert int((r == 1).sum()) == 16


def test_collapse_detector_on_synthetic_curves():
    n = 100
    flat = [1.0] * n
    decay = [math.exp(-t / 20) for t in range(n)]  # below 25% of the start at t = 28
    assert ablate.detect_collapse(decay, flat, flat)["entropy"] == 28
    rise_fall = [min(t, 50) / 50 - max(0, t - 50) / 40 for t in range(n)]  # peak 1 at 50, half at 70
    got = ablate.detect_collapse(flat, rise_fall, flat)
    assert got["reward"] == 71 and got["entropy"] is None and got["any"] == 71
    spike = [1.0 + 0.1 * (t % 3) for t in range(n)]
    spike[60] = 12.0
    assert ablate.detect_collapse(flat, flat, spike)["grad"] == 60
    assert ablate.detect_collapse(flat, flat, flat) == {
        "entropy": None,
        "reward": None,
        "grad": None,
        "any": None,
    }
    noisy = [0.5 + (0.3 if t % 2 else -0.3) for t in range(n)]  # alternating 0.8 / 0.2: smoothing removes it
    assert ablate.detect_collapse(flat, noisy, flat)["reward"] == 2
    assert ablate.detect_collapse(flat, noisy, flat, smooth=4)["reward"] is None


def test_lm_hook_builds_train_commands_and_reads_metrics(tmp_path, monkeypatch):
    run = ablate.Run("k2-seq-loss", 0.02, 3, off_policy=True, std_norm=False)
    lm = ablate_lm.LMSettings("tiny", steps=7, mu=2, extra=("--lora.r", "4"))
    cmd = ablate_lm.lm_command(run, tmp_path / "r", lm)
    s = " ".join(cmd)
    for part in ("train.py tiny", "--seed 3", "--steps 7", "--grpo.kl-placement loss", "--grpo.kl-estimator k2",
                 "--grpo.beta 0.02", "--grpo.num-iterations 2", "--grpo.scale-rewards none", "--grpo.kl-reward-to-go",
                 "--grpo.no-kl-is-weight", "--lora.r 4"):  # fmt: skip
        assert part in s, part
    assert s.index("--lora.r 0") < s.index("--lora.r 4")  # flags after `--` come last: they win
    # no KL is KL off, a command train.py's start-up checks accept (a KL with beta 0 is refused there)
    from nanogrpo.infra.flag_checks import check_config
    from train import cli

    none_cmd = ablate_lm.lm_command(ablate.Run("none", 0.2, 0, False, True), tmp_path, ablate_lm.LMSettings())
    none = " ".join(none_cmd)
    assert (
        "--grpo.kl-placement none" in none and "--grpo.beta" not in none and "--grpo.num-iterations 1" in none
    )
    check_config(cli(none_cmd[2:]))
    check_config(cli(cmd[2:]))
    assert ablate_lm.cell_name(ablate.Run("none", 0.2, 0, False, True)) == "none_s0_on_std"  # shared by betas
    # a finished run folder (summary.json written) is read back, not re-run
    rd = tmp_path / "out" / "runs" / "k2-seq-loss_b0.02_s3_off_nostd"
    rd.mkdir(parents=True)
    rows = [
        {"step": i, "reward": 0.5, "kl": 0.01 * i, "entropy": 2.05 - 0.1 * i, "grad_norm": 1.0}
        for i in range(20)
    ]
    (rd / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (rd / "summary.json").write_text("{}")
    monkeypatch.setattr(ablate_lm.subprocess, "run", lambda *a, **k: pytest.fail("should not run train.py"))
    res = ablate_lm.run_lm([run], tmp_path / "out", ablate_lm.LMSettings(steps=20, mu=2))
    assert res[0]["curves"]["kl"][3] == pytest.approx(0.03)
    # 5-step trailing mean of 2.05 - 0.1 t is 2.05 - 0.1 (t - 2): below 0.25 * 2.05 first at t = 18
    assert res[0]["collapse"]["entropy"] == 18
    rows_ = ablate.write(res, tmp_path / "out", "lm", {"kind": "lm", "tail": 5, "smooth": 5})
    assert rows_[0]["kl"] == pytest.approx(0.17) and rows_[0]["entropy_frac"] == pytest.approx(0.35 / 1.85)
    assert rows_[0]["collapsed_entropy"] == 1 and (tmp_path / "out" / "lm_off_nostd_b0.02.png").exists()


def test_collapse_detector_on_lm_noise():
    """An LM step whose groups all tie has grad norm exactly 0; those steps do not make the median 0. A lucky
    first batch is not a reward peak: with smoothing, the peak counts from the first full window."""
    lucky = [0.5] + [0.2] * 10 + [0.3] * 10
    assert ablate.detect_collapse([1.0] * 21, lucky, [1.0] * 21, smooth=5)["reward"] is None
    assert ablate.detect_collapse([1.0] * 21, lucky, [1.0] * 21)["reward"] == 1
    flat = [1.0] * 30
    grads = [0.0] * 6 + [0.5, 0.0, 0.6, 0.0, 0.0, 0.55] + [0.5] * 18
    assert ablate.detect_collapse(flat, flat, grads)["grad"] is None
    grads[20] = 6.0
    assert ablate.detect_collapse(flat, flat, grads)["grad"] == 20


def test_lm_grid_end_to_end(tmp_path):
    """SFT warm-up, then one GRPO cell through train.py: the cell starts from, and measures KL against, the
    warmed-up model; flags after `--` reach train.py; a second call re-runs nothing."""
    argv = "lm --variants k3-loss --betas 0.05 --seeds 0 --policy on --std-norm on --steps 2".split()
    argv += ["--out", str(tmp_path), "--", "--grpo.group-size", "4"]
    ablate.main(argv)
    assert len((tmp_path / "task.jsonl").read_text().splitlines()) == ablate_lm.LM_ROWS
    sft = tmp_path / "sft" / "model"
    assert (sft / "config.json").exists() and (sft / "model.safetensors").exists()
    rd = tmp_path / "runs" / "k3-loss_b0.05_s0_on_std"
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["model"]["path"] == str(sft) and cfg["lora"]["r"] == 0 and cfg["grpo"]["group_size"] == 4
    assert cfg["grpo"]["kl_placement"] == "loss" and cfg["grpo"]["beta"] == 0.05
    data = json.loads((tmp_path / "lm_results.json").read_text())
    (r,) = data["runs"]
    c = r["curves"]
    assert len(c["kl"]) == 2 and all(math.isfinite(x) for v in c.values() for x in v)
    # step 1 is sampled from the warmed-up model, which is also the reference: its KL is exactly 0, and its
    # entropy is far below the random model's log(1024) = 6.9 nats (0.8 measured)
    assert c["kl"][0] == pytest.approx(0.0, abs=1e-6) and 0 < c["entropy"][0] < 2.0
    assert (tmp_path / "lm_on_std_b0.05.png").stat().st_size > 10_000
    mtime = (rd / "metrics.jsonl").stat().st_mtime
    ablate.main(argv)
    assert (rd / "metrics.jsonl").stat().st_mtime == mtime


def test_lm_smoke_command_prints_every_variant(tmp_path):
    """`python -m nanogrpo.lab.ablate lm --smoke` as a user types it (about 30 s on two idle cores): the warm-up
    and one cell per smoke variant, KL off ('none') included, each through train.py; exit 0, and the table
    printed with a row per variant, every cell run for the smoke's steps."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "nanogrpo.lab.ablate", "lm", "--smoke", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [line.split(" | ") for line in p.stdout.splitlines() if line.startswith("| on | on | 0.04 |")]
    assert [r[3] for r in rows] == ablate.SMOKE["variants"] and "none" in ablate.SMOKE["variants"]
    assert "wrote" in p.stdout and (tmp_path / "lm_table.md").exists()
    data = json.loads((tmp_path / "lm_results.json").read_text())
    assert len(data["runs"]) == len(ablate.SMOKE["variants"]) * len(ablate.SMOKE["seeds"])
    for r in data["runs"]:
        assert len(r["curves"]["reward"]) == ablate.SMOKE["steps"]
        assert all(0 <= x <= 1 for x in r["curves"]["reward"])


def test_a_cell_stopped_at_a_non_finite_gradient_is_a_collapse_not_a_failure(tmp_path, monkeypatch):
    """train.py exits 3 at a step whose gradient is not finite (it logs that step, saves nothing): the grid goes
    on, the cell counts as run (not re-run), and its curves show the grad collapse at that step."""
    run = ablate.Run("k3-loss", 0.05, 0, off_policy=True, std_norm=True)
    rd = tmp_path / "runs" / ablate_lm.cell_name(run)

    def stopped_train(cmd, *a, **k):  # what train.py leaves behind when it stops at step 12
        rows = [
            {"step": i + 1, "reward": 0.5, "kl": 0.1, "entropy": 1.0, "grad_norm": 1.0} for i in range(11)
        ]
        rows.append({"step": 12, "reward": 0.0, "kl": 40.0, "entropy": 0.1, "grad_norm": math.inf})
        (rd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return subprocess.CompletedProcess(cmd, ablate_lm.NON_FINITE_EXIT)

    monkeypatch.setattr(ablate_lm.subprocess, "run", stopped_train)
    (res,) = ablate_lm.run_lm([run], tmp_path, ablate_lm.LMSettings(steps=20))
    assert res["stopped"] and res["collapse"]["grad"] == 11 and ablate_lm.cell_done(rd)
    monkeypatch.setattr(ablate_lm.subprocess, "run", lambda *a, **k: pytest.fail("should not run train.py"))
    assert ablate_lm.run_lm([run], tmp_path, ablate_lm.LMSettings(steps=20))[0]["stopped"]


def test_table_gives_mean_and_std_over_seeds_and_survives_nan_kl():
    """Three seeds a cell: each final value as mean ± sample std (n - 1); a cell without a KL (NaN curves)
    still gets its row."""
    from nanogrpo.lab.ablate import markdown, summarise

    def result(variant, seed, reward, kl):
        run = {"off_policy": False, "std_norm": True, "beta": 0.04, "variant": variant, "seed": seed}
        curves = {"kl": [kl, kl], "entropy": [1.0, 0.5], "reward": [0.1, reward]}
        return {"run": run, "curves": curves, "collapse": dict.fromkeys(("entropy", "reward", "grad", "any"))}

    results = [result("k3-loss", s, r, 0.1) for s, r in enumerate((0.2, 0.4, 0.6))]
    results += [result("none", s, 0.5, math.nan) for s in range(3)]
    rows = {r["variant"]: r for r in summarise(results)}
    assert rows["k3-loss"]["reward"] == pytest.approx(0.4) and rows["k3-loss"]["reward_sd"] == pytest.approx(
        0.2
    )
    assert rows["k3-loss"]["kl_sd"] == pytest.approx(0.0) and math.isnan(rows["none"]["kl_sd"])
    table = markdown(list(rows.values()))
    assert "| 0.4 ± 0.2 |" in table and "| 0/3 |" in table


def test_the_preset_grid_runs_the_preset_as_it_is_and_reads_its_held_out_score(tmp_path):
    """--sft-steps 0 (the grid on SmolLM2: --preset demo): no warm-up, no model, task or full fine-tuning flag
    of the tiny grid; a cell's held-out exact match comes back from its summary.json into the table."""
    run = ablate.Run("k3-loss", 0.05, 1, off_policy=True, std_norm=True)
    s = ablate_lm.LMSettings("demo", 60, 2, (), "", "", 1, 2, tuple(ablate_lm.PRESET_FLAGS))
    cmd = ablate_lm.lm_command(run, tmp_path, s)
    assert cmd[2] == "demo" and "--model.path" not in cmd and "--data.train" not in cmd
    assert "--lora.r" not in cmd and cmd[cmd.index("--grpo.num-iterations") + 1] == "2"
    em = {"n": 27, "mean_a": 0.0, "mean_b": 0.7, "diff": 0.7, "low": 0.5, "high": 0.85}
    (tmp_path / "summary.json").write_text(json.dumps({"eval": {"em": em}}))
    got = ablate_lm.held_out(tmp_path)["held_out"]
    assert got["em"] == 0.7 and (got["gain_lo"], got["gain_hi"]) == (0.5, 0.85)
    result = {"run": dataclasses.asdict(run), "curves": {"kl": [0.1], "entropy": [1.0], "reward": [0.5]},
              "collapse": dict.fromkeys(("entropy", "reward", "grad", "any")), "held_out": got}  # fmt: skip
    (row,) = ablate.summarise([result])
    assert row["em"] == 0.7 and "held-out EM" in ablate.markdown([row])
    assert ablate_lm.held_out(tmp_path / "none") == {}
