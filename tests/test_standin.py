"""The training paths on a device that is not the CPU (tests/standin.py): every stage, the final eval and a
resume run on the `standin` device, where combining a CPU tensor with the model's raises as on CUDA.

One subprocess makes every run (the device is registered once per process, and an accelerator then
reports as available, which the rest of the suite must not see); each test reads its part."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = ("grpo", "grpo-dynamic", "grpo-kl-reward", "grpo-full-kl-loss", "grpo-mu2-truncated", "ppo")
STAGES = (*SAMPLING, "dpo", "sft", "cpt", "grpo-resume")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("standin")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "standin.py"), str(root)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return root, json.loads((root / "results.json").read_text())


def test_the_device_behaves_as_cuda_does(runs):
    checks = runs[1]["_self_check"]
    assert checks and all(checks.values()), checks


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_runs_on_a_device_that_is_not_the_cpu(runs, stage):
    root, results = runs
    res = results[stage]
    assert res["ok"], res.get("error")
    run = root / ("grpo" if stage == "grpo-resume" else stage)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == ([1, 2, 3] if stage.startswith("grpo") and run.name == "grpo" else [1, 2])  # resumed to 3
    env = json.loads((run / "environment.json").read_text())
    assert "standin" in json.dumps(env), env  # the run says where it ran
    if stage in SAMPLING or stage == "grpo-resume":  # the sampler's generators are on the model's device
        assert res["generators"] and all(d.startswith("standin") for d in res["generators"]), res


def test_a_full_fine_tune_samples_in_its_compute_dtype(runs):
    """float32 master weights trained under bf16 autocast: the sampler runs under it too (a bf16 KV cache),
    not in float32 (twice the bytes a decode step, and a larger sampler-trainer gap); LoRA runs of the tiny
    float32 model keep their float32 cache."""
    results = runs[1]
    assert results["grpo-full-kl-loss"]["kv_cache"] == ["torch.bfloat16"], results["grpo-full-kl-loss"]
    assert results["grpo"]["kv_cache"] == ["torch.float32"], results["grpo"]


def test_the_final_eval_ran_on_it(runs):
    ev = json.loads((runs[0] / "grpo" / "eval.json").read_text())
    assert ev["n"] == 3 and {"em", "rouge_l"} <= set(ev["metrics"]), ev  # base and trained, scored
