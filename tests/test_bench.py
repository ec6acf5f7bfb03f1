"""The benchmarks still run: bench/gpu_check.sh --cpu-smoke runs every bench of bench/ at tiny shapes on the
CPU (kernels, a random model, the sampler against the roofline, one GRPO step through train.py against the
memory plan, length groups in the training forward). Benchmarks are not tests and their timings gate
nothing; this only catches a bench that no longer runs against the code it measures."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="bench/gpu_check.sh needs bash")
def test_every_bench_runs_at_tiny_shapes(tmp_path):
    out = tmp_path / "results"
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
    status = {line.split()[0]: line for line in (out / "status.txt").read_text().splitlines() if line.strip()}
    assert set(status) == {"kernels", "model", "generate", "step", "groups"}, status
    for name, line in status.items():
        assert line.split()[1] == "ok", (
            f"bench step {name} did not run: {line}\n" + (out / f"{name}.log").read_text()[-2000:]
        )
    step = json.loads((out / "step.json").read_text())
    assert step, "bench/step.py wrote no measurements"
    assert "machine ceilings" in (out / "generate.log").read_text()  # the roofline's ceilings are printed
    assert "length groups:" in (out / "groups.log").read_text()
    assert "length groups:" in res.stdout  # and in the table printed last


def test_length_groups_bench_runs_on_the_tiny_model():
    res = subprocess.run(
        [sys.executable, "bench/length_groups.py", "--model", "tiny", "--repeat", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "length groups:" in res.stdout and "4 group(s)" in res.stdout, res.stdout
    # one 16-token straggler among 2-5-token completions: it runs in a group of its own
    assert "in 2 groups: 31x4, 1x15" in res.stdout, res.stdout
