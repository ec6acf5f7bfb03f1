"""The CPU speed targets in one run: the sampler against transformers, a GRPO step against TRL, `make demo`.

    python bench/cpu_check.py runs/cpu_check            # float32: ~15-25 minutes on 2 cores
    python bench/cpu_check.py runs/cpu_check --avx2     # a CPU with AVX-512 running AVX2-only code paths
    python bench/cpu_check.py /tmp/cc --smoke           # tiny shapes, ~1 minute: checks the script

Runs, one after the other, each in its own process with its log in RESULTS_DIR:
1. `bench/generate.py --dtype float32`: tokens/s of nanogrpo's sampler and of transformers `generate`,
   taking turns, and the machine's ceilings (copy GB/s, matmul GFLOP/s);
2. `bench/step.py --dtype float32`: seconds per GRPO step and peak RSS against TRL (nanogrpo alone, with a
   line saying so, where TRL is not installed: it is not a dependency);
3. `python train.py` (what `make demo` runs, in its own dtype: float32 on a CPU without bf16 units): wall
   time, peak RSS and the held-out result (base vs trained, 95% paired bootstrap CI).
Then a table of each measure against its target (the CPU targets of docs/BENCHMARKS.md: sampler >= 2x
transformers, step <= 0.4x TRL, demo <= 6 minutes on 2 cores, a held-out gain whose CI excludes 0),
printed and written to summary.txt and summary.json, with the CPU's flags so that the numbers can be
recorded as they are. Meant for the CPUs nanogrpo's float32 path serves (AVX2-only ones), but runs on any.
--avx2 sets ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 for every step:
the code an AVX2-only CPU runs, on this CPU's cores, caches and memory (bench/README.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides the CPU paths (nanogrpo/infra/cpu.py)
TINY = ["--model", "tiny", "--prompts", "2", "--group", "2", "--new-tokens", "4", "--warmup", "0"]
STEPS = {  # name -> (command after the interpreter, its smoke variant's extra/replacing arguments)
    "generate": (["bench/generate.py", "--dtype", "float32"], [*TINY, "--repeats", "1"]),
    "step": (["bench/step.py", "--dtype", "float32", "--device", "cpu"], [*TINY, "--steps", "1"]),
    "demo": (["train.py"], ["--model.path", "tiny", "--steps", "2", "--eval-prompts", "4"]),
}


def cpu_line() -> str:
    """The CPU's model name, cores and the flags that pick nanogrpo's code paths, from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{os.cpu_count()} cores (no /proc/cpuinfo)"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    words = set(info.split())
    flags = " ".join(f for f in FLAGS if f in words) or "none of " + " ".join(FLAGS)
    return f"{name}, {os.cpu_count()} cores, flags: {flags}"


def run_step(name: str, cmd: list[str], out: Path, env: dict) -> dict:
    """Run one step with its output in out/NAME.log: wall seconds, exit code and peak RSS (GiB; the
    process's high-water mark, or its largest worker's where it runs them, as bench/step.py does)."""
    log = out / f"{name}.log"
    print(f"{name}: {' '.join(cmd)}  (log: {log})", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        # this child's own resource usage, its waited-for ones included
        _, status, usage = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    print(f"{name}: {'ok' if rc == 0 else f'exit {rc}'} in {wall:.0f} s", flush=True)
    return {"rc": rc, "wall_s": wall, "peak_rss_gib": usage.ru_maxrss / 2**20, "log": str(log)}  # KiB -> GiB


def sampler_row(gen: dict) -> dict:
    """generate.py's JSON -> the sampler's ratio to transformers (median tok/s, and each turn's)."""
    s = gen["samplers"]
    if "transformers" not in s:
        return {"measure": "sampler / transformers", "value": "transformers not installed", "met": None}
    ours, theirs = s["nanogrpo"]["tok_per_s_wall"], s["transformers"]["tok_per_s_wall"]
    turns = [t / o for o, t in zip(s["nanogrpo"]["wall_s"], s["transformers"]["wall_s"])]
    value = (
        f"{ours / theirs:.2f}x ({ours:.0f} vs {theirs:.0f} tok/s; turns {min(turns):.2f}-{max(turns):.2f}x)"
    )
    return {
        "measure": "sampler / transformers, float32",
        "value": value,
        "target": ">= 2x",
        "met": ours / theirs >= 2,
    }


def step_rows(step: dict, why_alone: str) -> list[dict]:
    """step.py's JSON -> the step's ratio to TRL and both peaks (`why_alone`: why TRL's side did not run)."""
    run = step["runs"][-1]
    mean = lambda x: sum(x) / len(x)  # noqa: E731
    ours = run["nanogrpo"]
    if "trl" not in run:
        t = f"{mean(ours['t_step']):.2f} s, nanogrpo alone ({why_alone})"
        return [{"measure": "GRPO step, float32", "value": t, "target": "<= 0.4x TRL", "met": None}]
    trl = run["trl"]
    r = mean(ours["t_step"]) / mean(trl["t_step"])
    t = f"{r:.2f}x ({mean(ours['t_step']):.2f} vs {mean(trl['t_step']):.2f} s)"
    peak = f"{ours['peak_rss_gib']:.2f} vs {trl['peak_rss_gib']:.2f} GiB (TRL)"
    return [
        {"measure": "GRPO step / TRL, float32", "value": t, "target": "<= 0.4x", "met": r <= 0.4},
        {"measure": "  peak RSS of the step", "value": peak, "target": "no higher than before", "met": None},
    ]


def demo_rows(res: dict, out: Path) -> list[dict]:
    """train.py's wall time and its held-out result (eval.json in the run folder)."""
    rows = [
        {
            "measure": "make demo (python train.py), wall",
            "value": f"{res['wall_s'] / 60:.1f} min ({res['wall_s']:.0f} s), peak RSS {res['peak_rss_gib']:.2f} GiB",
            "target": "<= 6 min on 2 cores",
            "met": res["wall_s"] <= 360 if os.cpu_count() == 2 else None,
        }
    ]
    ev = out / "demo" / "eval.json"
    metrics = json.loads(ev.read_text())["metrics"] if ev.is_file() else {}
    for m, s in metrics.items():
        ci = f"[{s['low']:+.2f}, {s['high']:+.2f}]"
        value = f"{s['mean_a']:.2f} -> {s['mean_b']:.2f}, diff CI {ci}, n={s['n']}"
        # the demo's learning result is its exact match; the other metrics are shown as they are
        target, met = ("CI excludes 0", s["low"] > 0) if m == "em" else ("", None)
        rows.append({"measure": f"  held-out {m}", "value": value, "target": target, "met": met})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="folder for the logs, JSON and the summary")
    ap.add_argument("--avx2", action="store_true", help="AVX2-only code paths on a CPU with AVX-512")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and a 2-step run: checks the script")
    ap.add_argument("--only", default="generate,step,demo", help="comma-separated subset of the steps")
    a = ap.parse_args()
    only = a.only.split(",")
    if unknown := [s for s in only if s not in STEPS]:
        sys.exit(f"--only {a.only}: unknown step(s) {unknown}; choose from {','.join(STEPS)}")
    out = a.results.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(AVX2_ENV if a.avx2 else {})}
    cpu = cpu_line() + (" | AVX2 code paths (--avx2)" if a.avx2 else "")
    t_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{t_start} | {cpu}", flush=True)
    # TRL is not a dependency: without it (and in a smoke run) the step bench runs nanogrpo's side alone
    trl_side = importlib.util.find_spec("trl") is not None and not a.smoke
    why_alone = "--smoke" if a.smoke else "TRL is not installed: pip install trl to compare"
    steps, rows = {}, []
    for name in only:
        cmd, smoke = STEPS[name]
        cmd = [*cmd, *(smoke if a.smoke else [])]
        cmd += {
            "generate": ["--json", str(out / "generate.json")],
            "step": ["--json", str(out / "step.json")],
        }.get(name, ["--out-dir", str(out / "demo")])
        if name == "step" and not trl_side:
            cmd += ["--side", "nanogrpo"]
        steps[name] = res = run_step(name, cmd, out, env)
        if res["rc"] != 0:
            rows.append(
                {"measure": name, "value": f"failed (exit {res['rc']}): see {res['log']}", "met": False}
            )
        elif name == "generate":
            rows.append(sampler_row(json.loads((out / "generate.json").read_text())))
        elif name == "step":
            rows += step_rows(json.loads((out / "step.json").read_text()), why_alone)
        else:
            rows += demo_rows(res, out)
    mark = {True: "yes", False: "NO", None: "-"}
    width = max(len(r["measure"]) for r in rows) + 2
    lines = [f"CPU targets, {t_start}: {cpu}", f"python bench/cpu_check.py {' '.join(sys.argv[1:])}", ""]
    lines += [f"{'measure':<{width}}{'target':<22}{'met':<5}value"]
    lines += [
        f"{r['measure']:<{width}}{r.get('target', ''):<22}{mark[r['met']]:<5}{r['value']}" for r in rows
    ]
    text = "\n".join(lines)
    print("\n" + text)
    (out / "summary.txt").write_text(text + "\n")
    summary = {
        "date": t_start,
        "cpu": cpu,
        "avx2_paths": a.avx2,
        "smoke": a.smoke,
        "steps": steps,
        "rows": rows,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    sys.exit(1 if any(s["rc"] != 0 for s in steps.values()) else 0)


if __name__ == "__main__":
    main()
