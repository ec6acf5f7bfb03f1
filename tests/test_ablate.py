"""nanogrpo.ablate and the toy task: a tiny grid end to end, the collapse detector, the train.py hook."""

import json
import math
from dataclasses import replace

import pytest
import torch

from nanogrpo import ablate
from nanogrpo.config import GRPOConfig
from nanogrpo.toy import TabularPolicy, ToySettings, optimal_policy_logp, toy_optimum, toy_reward, train_toy


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
    c = train_toy(replace(cfg, adv_std_norm=False), 0, s)
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
    cmd = ablate.lm_command(run, tmp_path / "r", preset="tiny", steps=7, mu=2, extra=["--lora.r", "4"])
    s = " ".join(cmd)
    for part in ("train.py tiny", "--seed 3", "--steps 7", "--grpo.kl-placement loss", "--grpo.kl-estimator k2",
                 "--grpo.beta 0.02", "--grpo.num-iterations 2", "--grpo.no-adv-std-norm", "--grpo.kl-reward-to-go",
                 "--grpo.no-kl-is-weight", "--lora.r 4"):  # fmt: skip
        assert part in s, part
    # a finished run folder is read back, not re-run
    rd = tmp_path / "out" / "runs" / "k2-seq-loss_b0.02_s3_off_nostd"
    rd.mkdir(parents=True)
    rows = [
        {"step": i, "reward": 0.5, "kl": 0.01 * i, "entropy": 2.0 - 0.1 * i, "grad_norm": 1.0}
        for i in range(20)
    ]
    (rd / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setattr(ablate.subprocess, "run", lambda *a, **k: pytest.fail("should not run train.py"))
    res = ablate.run_lm([run], tmp_path / "out", preset="tiny", steps=20, mu=2, extra=[])
    assert res[0]["curves"]["kl"][3] == pytest.approx(0.03)
    assert res[0]["collapse"]["entropy"] == 16  # 2.0 - 1.6 = 0.4 < 0.5
    rows_ = ablate.write(res, tmp_path / "out", "lm", {"kind": "lm"})
    assert rows_[0]["collapsed_entropy"] == 1 and (tmp_path / "out" / "lm_off_nostd_b0.02.png").exists()
