"""The small-LM half of the KL ablations: each grid cell is a `train.py` subprocess (see nanogrpo/lab/ablate.py).

A short SFT warm-up of the preset's model on the built-in demo task (once per output folder) makes the
reference; each cell then runs GRPO from it, and its curves are read back from metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from nanogrpo.config import GRPOConfig
from nanogrpo.infra.metrics import read_jsonl
from nanogrpo.lab.ablate import Run, detect_collapse
from nanogrpo.model.zoo import resolve_model
from nanogrpo.recipes.demo import demo_rows
from nanogrpo.recipes.presets import PRESETS

TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"
LM_ROWS = 16  # demo prompts the LM grid trains on: with 8 a step, each is seen every other step
# The flags of every cell (flags after `--` come later on the command line, so they override these).
# Full fine-tuning, so the KL reference is the warmed-up model itself; top-k off, so the sampler draws from
# the very pi whose log-probs, entropy and KL are logged; ROUGE-L against the one-word answer; a 5-step
# warm-up, because Adam's first steps have full size whatever the gradient and knock the reward down; no
# PNGs or run page per cell (the grid draws its own plots from metrics.jsonl).
LM_FLAGS = ["--lora.r", "0", "--optim.lr", "2e-3", "--prompts-per-step", "8", "--grpo.group-size", "8",
            "--reward.spec", "rouge_l:1", "--sampling.top-k", "0", "--sampling.max-new-tokens", "8",
            "--optim.warmup-steps", "5", "--log-samples-every", "10", "--no-plots"]  # fmt: skip


# --sft-steps 0: no warm-up, the preset as it is (its model, LoRA, task, reward and held-out evaluation); the
# cells only log less often and draw no plots
PRESET_FLAGS = ["--log-samples-every", "10", "--no-plots"]


@dataclass(frozen=True)
class LMSettings:
    """How the cells run train.py."""

    preset: str = "tiny"
    steps: int = 300
    mu: int = 4  # num_iterations of the off-policy cells
    extra: tuple[str, ...] = ()  # train.py flags placed after LM_FLAGS, so they override them
    model: str = ""  # the warmed-up model folder ('' = the preset's model)
    task: str = ""  # the JSONL task ('' = the preset's)
    threads: int = 1  # OMP_NUM_THREADS of each train.py
    jobs: int = 1  # cells run at once
    flags: tuple[str, ...] = tuple(LM_FLAGS)  # every cell's flags (PRESET_FLAGS: the preset as it is)


def lm_task(out: Path, n: int = LM_ROWS) -> Path:
    """n rows of the built-in demo task (a fixed shuffle) as JSONL in the output folder."""
    path = out / "task.jsonl"
    if not path.exists():
        rows = demo_rows("train", system=False)  # the layout the recorded grid ran on
        random.Random(0).shuffle(rows)
        out.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[:n]))
    return path


NON_FINITE_EXIT = 3  # train.py's exit status when a step's loss or gradient is not finite (it stops there)


def train_logged(cmd: list[str], rd: Path, threads: int, ok: tuple[int, ...] = (0,)) -> float:
    """Run train.py with its console in rd/train.log and its command, exit status and wall time in
    rd/ablate.json; returns the wall time in seconds (the lab's studies run their cells through it). An exit
    status not in `ok` raises, with the end of the log.

    threads: torch's intra-op threads (OMP_NUM_THREADS). The tiny model gains nothing from more than one, and
    on a CPU that other jobs also use, two threads that wait for each other made a 60-step cell take 320 s
    instead of 10 s."""
    rd.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with (rd / "train.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc not in ok:
        raise RuntimeError(f"train.py exited {rc}: {' '.join(cmd)}\n{(rd / 'train.log').read_text()[-3000:]}")
    wall = time.perf_counter() - t0
    (rd / "ablate.json").write_text(json.dumps({"cmd": cmd, "wall_s": wall, "rc": rc}))
    return wall


def lm_warmup(out: Path, task: Path, *, preset: str, steps: int, lr: float, threads: int = 1) -> Path:
    """SFT of the whole model on the task's references, once per output folder: the start of every cell and
    its KL reference. Returns an HF model folder (train.py saves weights + tokenizer; the base's config is
    copied next to them)."""
    model = out / "sft" / "model"
    if (model / "config.json").exists():
        return model
    shutil.rmtree(out / "sft", ignore_errors=True)
    n = sum(1 for line in task.read_text().splitlines() if line.strip())
    train_logged([sys.executable, str(TRAIN_PY), preset, "--algo", "sft", "--lora.r", "0", "--data.train", str(task),
            "--prompts-per-step", str(n), "--steps", str(steps), "--optim.lr", str(lr), "--seed", "0",
            "--out-dir", str(out / "sft"), "--no-plots"], out / "sft", threads)  # fmt: skip
    base = resolve_model(PRESETS[preset][1].model.path)
    for name in ("generation_config.json", "config.json"):  # config.json last: it marks the folder complete
        if (base / name).exists():
            shutil.copy(base / name, model / name)
    return model


def lm_command(run: Run, out_dir: Path, s: LMSettings) -> list[str]:
    """The train.py command line of one grid cell (tyro flags of nanogrpo.config.GRPOConfig)."""
    g = run.grpo(GRPOConfig(), s.mu)
    # no KL is KL off (train.py refuses a KL with beta 0, which would compute a reference for nothing): these
    # cells log no KL
    beta = [] if g.kl_placement == "none" else ["--grpo.beta", str(g.beta)]
    flag = lambda name, on: f"--grpo.{'' if on else 'no-'}{name}"  # noqa: E731
    start = (["--model.path", s.model] if s.model else []) + (["--data.train", s.task] if s.task else [])
    return [
        sys.executable, str(TRAIN_PY), s.preset, *start, *s.flags, "--out-dir", str(out_dir), "--seed", str(run.seed),
        "--steps", str(s.steps), "--grpo.kl-placement", g.kl_placement, "--grpo.kl-estimator", g.kl_estimator,
        *beta, "--grpo.num-iterations", str(g.num_iterations), "--grpo.scale-rewards", g.scale_rewards,
        flag("kl-is-weight", g.kl_is_weight), flag("kl-reward-to-go", g.kl_reward_to_go), *s.extra,
    ]  # fmt: skip


def read_metrics(run_dir: Path) -> dict[str, list[float]]:
    """Curves from a train.py run folder's metrics.jsonl (missing values become nan)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    get = lambda r, k: float(r[k]) if r.get(k) is not None else math.nan  # noqa: E731
    return {k: [get(r, k) for r in rows] for k in ("kl", "entropy", "reward", "grad_norm")}


def held_out(run_dir: Path) -> dict:
    """{'held_out': the final model's held-out exact match, the base model's, and the 95% bootstrap CI of the
    difference} from the run's summary.json, when the preset evaluates one ({} otherwise)."""
    path = run_dir / "summary.json"
    em = json.loads(path.read_text()).get("eval", {}).get("em") if path.exists() else None
    if not em:
        return {}
    keys = ("mean_b", "mean_a", "diff", "low", "high", "n")
    return {
        "held_out": dict(zip(("em", "em_base", "gain", "gain_lo", "gain_hi", "n"), (em[k] for k in keys)))
    }


def cell_name(run: Run) -> str:
    beta = "" if run.variant == "none" else f"_b{run.beta:g}"  # no-KL cells are the same run at every beta
    return f"{run.variant}{beta}_s{run.seed}_{'off' if run.off_policy else 'on'}_{'std' if run.std_norm else 'nostd'}"


def cell_done(rd: Path) -> bool:
    """The cell has run: train.py wrote summary.json (its last file), or it stopped at a step whose gradient
    was not finite, a collapse the curves show (metrics.jsonl logs that step), not a cell to run again."""
    done = rd / "ablate.json"
    return (rd / "summary.json").exists() or (
        done.exists() and json.loads(done.read_text()).get("rc") == NON_FINITE_EXIT
    )


def run_cell(run: Run, rd: Path, s: LMSettings) -> None:
    """Train one cell afresh in rd (a half-written cell would append to its metrics)."""
    shutil.rmtree(rd, ignore_errors=True)
    cmd = lm_command(run, rd, s)
    print("$ " + " ".join(cmd[1:]), flush=True)  # the cell by hand: python train.py ...
    train_logged(cmd, rd, s.threads, ok=(0, NON_FINITE_EXIT))


def run_lm(runs: list[Run], out: Path, s: LMSettings) -> list[dict]:
    """Each cell as a train.py subprocess, s.jobs at a time (in grid order), then the toy's collapse detection
    on its curves (reward and entropy smoothed over 5 steps: one LM step is a noisy sample). A cell whose
    summary.json exists (train.py writes it last), or that stopped at a non-finite step, is read back."""
    dirs = [out / "runs" / cell_name(run) for run in runs]
    pool = ThreadPoolExecutor(max(1, s.jobs))
    try:
        pending = {}  # one job per folder: the no-KL cells of every beta share one
        for run, rd in zip(runs, dirs):
            if rd not in pending and not cell_done(rd):
                pending[rd] = pool.submit(run_cell, run, rd, s)
        results = []
        for i, (run, rd) in enumerate(zip(runs, dirs)):
            if rd in pending:
                pending[rd].result()  # a failed cell raises here and cancels the cells not started
            done = rd / "ablate.json"  # absent when the folder came from elsewhere
            info = json.loads(done.read_text()) if done.exists() else {}
            wall, stopped = info.get("wall_s"), info.get("rc") == NON_FINITE_EXIT
            c = read_metrics(rd)
            col = detect_collapse(c["entropy"], c["reward"], c["grad_norm"], smooth=5)
            results.append(
                {"run": asdict(run), "curves": c, "collapse": col, "wall_s": wall, "stopped": stopped,
                 **held_out(rd)}
            )  # fmt: skip
            print(f"[{i + 1}/{len(runs)}] {run.variant:14} beta {run.beta:g} seed {run.seed} {run.setting}: "
                  f"KL {c['kl'][-1]:.3f} H {c['entropy'][-1]:.3f} reward {c['reward'][-1]:.3f} "
                  f"collapse {col['any']}{' (stopped: non-finite)' if stopped else ''} ({wall or 0:.0f} s)",
                  flush=True)  # fmt: skip
    finally:
        pool.shutdown(cancel_futures=True)
    return results


def lm_grid(runs: list[Run], out: Path, a, extra: tuple[str, ...], steps: int) -> tuple[list[dict], dict]:
    """`ablate lm`'s cells from its flags `a` (ablate.main): warmed-up on the demo task's rows with the grid's
    flags, or with --sft-steps 0 the preset as it is (its model, task, reward, LoRA and held-out evaluation).
    Returns the results and the run's record (meta)."""
    if a.sft_steps == 0:
        model, task, flags = "", "", PRESET_FLAGS
    else:
        task = lm_task(out, a.rows or LM_ROWS)
        model = lm_warmup(out, task, preset=a.preset, steps=a.sft_steps, lr=a.sft_lr, threads=a.threads)
        flags = LM_FLAGS
    s = LMSettings(a.preset, steps, a.mu, extra, str(model), str(task), a.threads, a.jobs, tuple(flags))
    meta = {"kind": "lm", "settings": asdict(s), "flags": list(flags), "tail": 5, "smooth": 5,
            "kl_title": "KL(pi || ref) per token (k3)"}  # fmt: skip
    return run_lm(runs, out, s), meta
