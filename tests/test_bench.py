"""The benchmarks still run: bench/gpu_check.sh --cpu-smoke runs every bench of bench/ at tiny shapes on the
CPU (kernels, a random model, the sampler against the roofline, one GRPO step through train.py against the
memory plan, length groups in the training forward), and bench/cpu_check.py --smoke its table of the CPU
targets. Benchmarks are not tests and their timings gate nothing; this only catches a bench that no longer
runs against the code it measures."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One run of `bash bench/gpu_check.sh --cpu-smoke` (about a minute) for the tests that read its output:
    (its stdout, its results folder)."""
    if shutil.which("bash") is None:
        pytest.skip("bench/gpu_check.sh needs bash")
    out = tmp_path_factory.mktemp("gpu_check") / "results"
    env = {**os.environ, "PYTHON": sys.executable}  # this interpreter, with the packages the suite has
    res = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--cpu-smoke", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout, out


@pytest.mark.slow
def test_every_bench_runs_at_tiny_shapes(smoke):
    stdout, out = smoke
    status = {line.split()[0]: line for line in (out / "status.txt").read_text().splitlines() if line.strip()}
    trains = {"train-grpo", "train-dynamic", "train-ppo", "train-full"}
    benches = {
        "model",
        "generate",
        "generate-graph",
        "generate-compiled",
        "attention",
        "step",
        "groups",
        "kernels",
    }
    assert set(status) == {*trains, "tests", *benches}
    skipped = {
        "tests",
        "generate-graph",
        "generate-compiled",
    }  # the CPU suite runs the tests and compiles the step
    for name, line in status.items():
        assert (line.split()[1] == "skipped") == (name in skipped), (
            f"bench step {name} did not run: {line}\n" + (out / f"{name}.log").read_text()[-2000:]
        )
    for name in trains:  # a user's first run, two steps of each stage that samples, printed in the table
        assert f"{name}: step 2 | " in stdout, stdout[-3000:]
    gen = json.loads((out / "generate.json").read_text())
    assert [r["batch"] for r in gen["roofline"]] == [1, 4]  # with LoRA, ops and time per launch counted
    assert gen["args"]["lora_r"] == 4 and all(
        r["aten_ops_step"] > 0 and r["us_per_launch"] for r in gen["roofline"]
    )
    step = json.loads((out / "step.json").read_text())
    assert step, "bench/step.py wrote no measurements"
    assert "machine ceilings" in (out / "generate.log").read_text()  # the roofline's ceilings are printed
    assert "length groups:" in stdout  # and in the table printed last


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the dev extra)")
def test_kernels_bench_tables_the_triton_lcs_row(smoke):
    """bench/kernel_timings.py --cpu-smoke (the smoke's last step) runs the LCS kernel in Triton's interpreter
    and tables its row: the results a CUDA run writes and reads, on the CPU."""
    log = (smoke[1] / "kernels.log").read_text()
    lcs = [line for line in log.splitlines() if "triton (interpreter)" in line]
    assert lcs and "(matches: True)" in lcs[0], log[-3000:]
    assert "NOT MEASURED" not in log, log[-3000:]


@pytest.mark.slow
def test_length_groups_bench_puts_the_straggler_in_a_group_of_its_own(smoke):
    """bench/length_groups.py in the smoke: 7 completions of 2-4 tokens and one of 12 on a narrow Qwen2
    shape; the straggler runs in a group of its own."""
    log = (smoke[1] / "groups.log").read_text()
    assert "length groups:" in log and "in 2 groups: 7x3, 1x11" in log, log[-3000:]


@pytest.mark.slow
def test_cpu_check_runs_the_three_targets_and_tables_them(tmp_path):
    """bench/cpu_check.py --smoke: the sampler bench, the step bench and train.py at tiny shapes on the AVX2
    code paths, each row of the table from its own JSON (the check's verdicts mean nothing at these sizes)."""
    res = subprocess.run(
        [sys.executable, "bench/cpu_check.py", str(tmp_path), "--smoke", "--avx2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["avx2_paths"] and set(summary["steps"]) == {"generate", "step", "demo"}
    measures = [r["measure"].strip() for r in summary["rows"]]
    assert measures[:3] == [
        "sampler / transformers, float32",
        "GRPO step, float32",
        "make demo (python train.py), wall",
    ]
    assert "held-out em" in measures
    assert "nanogrpo alone (--smoke)" in summary["rows"][1]["value"]
    assert "AVX2 (" in (tmp_path / "generate.log").read_text()  # the children ran the AVX2 code paths
    assert summary["steps"]["demo"]["peak_rss_gib"] > 0.1
    assert (tmp_path / "summary.txt").read_text().startswith("CPU targets, ")


def test_cpu_check_verdicts_follow_the_targets():
    """The table's verdicts: sampler >= 2x transformers (medians), step <= 0.4x TRL, exact match's CI > 0."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cpu_check", ROOT / "bench" / "cpu_check.py")
    cc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cc)
    side = lambda tps, walls: {"tok_per_s_wall": tps, "wall_s": walls}  # noqa: E731
    gen = {"samplers": {"nanogrpo": side(200.0, [1.0, 2.0]), "transformers": side(100.0, [2.5, 3.0])}}
    assert cc.sampler_row(gen)["met"] and "turns 1.50-2.50x" in cc.sampler_row(gen)["value"]
    gen["samplers"]["transformers"]["tok_per_s_wall"] = 101.0
    assert cc.sampler_row(gen)["met"] is False
    run = lambda t: {"t_step": t, "peak_rss_gib": 1.0}  # noqa: E731
    rows = cc.step_rows({"runs": [{"nanogrpo": run([3.0, 5.0]), "trl": run([10.0, 10.0])}]}, "")
    assert rows[0]["met"] and rows[0]["value"].startswith("0.40x")
    rows = cc.step_rows({"runs": [{"nanogrpo": run([4.2]), "trl": run([10.0])}]}, "")
    assert rows[0]["met"] is False
    assert cc.step_rows({"runs": [{"nanogrpo": run([4.2])}]}, "why")[0]["met"] is None


def test_gpu_steps_runs_only_the_steps_named(tmp_path):
    """GPU_STEPS="model groups": a GPU session short of time runs just those; the rest are listed as skipped."""
    if shutil.which("bash") is None:
        pytest.skip("bench/gpu_check.sh needs bash")
    env = {**os.environ, "PYTHON": sys.executable, "GPU_STEPS": "model groups"}
    res = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--cpu-smoke", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    status = dict(line.split(maxsplit=1) for line in (tmp_path / "status.txt").read_text().splitlines())
    assert status["model"].startswith("ok") and status["groups"].startswith("ok"), status
    for name in ("train-grpo", "train-ppo", "generate", "attention", "step", "kernels"):
        assert status[name].split() == ["skipped", "not", "in", "GPU_STEPS"], (name, status[name])
