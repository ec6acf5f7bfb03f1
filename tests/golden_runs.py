"""Four small runs whose outputs must not change when code moves: GRPO (`train.py tiny`), SFT, PPO and GRPO with
the KL in the reward. `python tests/golden_runs.py save` records them in tests/golden/ (metrics without timings,
the logged samples, the adapter's sha256); test_golden.py runs them again and compares. A run's bytes depend on
the CPU's float32 kernels, so each record names the CPU class it was made on (`cpu_class`) and the test
compares bitwise on that class only; elsewhere it compares the first step's metrics to 1e-4."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
TIMING = ("t_", "tok_per_s", "mem_")

# name -> train.py flags after the preset: each a few steps of the tiny model
RUNS: dict[str, list[str]] = {
    "grpo": ["tiny"],
    "sft": ["tiny", "--algo", "sft", "--steps", "3"],
    "ppo": ["tiny", "--algo", "ppo", "--steps", "3"],
    "kl_reward": ["tiny", "--steps", "3", "--grpo.kl-placement", "reward", "--grpo.beta", "0.05"],
}


def cpu_class() -> str:
    """The CPU's vendor and widest float32 ISA (and any ISA cap set in the environment): a run's bytes follow
    which kernels ATen, oneDNN and MKL pick, and those follow these."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    vendor = "intel" if "GenuineIntel" in info else "amd" if "AuthenticAMD" in info else "other"
    isa = next((name for name in ("amx_bf16", "avx512f", "avx2") if name in info), "none")
    caps = [
        os.environ.get(k, "")
        for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    ]
    return ":".join([vendor, isa, *caps]).rstrip(":")


def run(name: str, out: Path) -> dict:
    """Run `name` into `out` and return its record: metrics without timings, samples, adapter sha256."""
    args = [*RUNS[name], "--out-dir", str(out), "--no-plots"]
    # two threads, as recorded: the float32 sums split differently across another number of threads
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"{name}: exit {r.returncode}\n{r.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in m.items() if not k.startswith(TIMING)} for m in rows]
    samples = out / "samples.jsonl"
    adapter = out / "adapter" / "adapter_model.safetensors"
    return {
        "cpu_class": cpu_class(),
        "metrics": metrics,
        "samples": samples.read_text().splitlines() if samples.exists() else [],
        "adapter_sha256": hashlib.sha256(adapter.read_bytes()).hexdigest() if adapter.exists() else None,
    }


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["save"]:
        sys.exit("usage: python tests/golden_runs.py save   (records the runs in tests/golden/)")
    GOLDEN.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            rec = run(name, Path(tmp) / name)
            (GOLDEN / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
            print(name, len(rec["metrics"]), "steps", rec["adapter_sha256"])
