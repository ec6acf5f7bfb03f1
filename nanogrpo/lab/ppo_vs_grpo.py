"""PPO against GRPO on a sparse 0/1 sequence-level reward: does PPO's loss run away where GRPO's stays put?

    python -m nanogrpo.lab.ppo_vs_grpo                    # the grid below, ~25 min on 2 CPU cores
    python -m nanogrpo.lab.ppo_vs_grpo --steps 10 --lrs 1e-4 --kls 0.05 --seeds 0    # one cell of each

Concept Overlap (section 3.5) reports PPO's loss above 28.9 by step 31 in all four configurations it tried, and
blames the value network, which must split one sequence-level score into per-token advantages with no
per-step signal; GRPO's group baseline needs no critic. Here both train SmolLM2-135M-Instruct with LoRA
on the built-in demo task (one-word answers), scored by the `contains` grader: 1 when the reference answer
appears in the completion, else 0; one number per completion. The grid: PPO at each learning rate x KL
coefficient x seed, GRPO at each learning rate x seed, the same prompts and the same number of
completions per step (PPO: --ppo.samples-per-prompt G, each its own episode; GRPO: groups of G).

Each cell is a train.py subprocess (its console in <out>/runs/<cell>/train.log); a cell whose
summary.json exists is read back, not run again. Writes <out>/ppo_vs_grpo.json (curves and summary),
the Markdown table to stdout and <out>/ppo_vs_grpo.md, and the plot to <out>/ppo_vs_grpo.png. The
checked-in figure is replaced only when asked for by name: --plot docs/img/ppo_vs_grpo.png.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from nanogrpo.infra.flag_checks import LAB
from nanogrpo.infra.metrics import read_jsonl, replace_atomically
from nanogrpo.infra.outputs import folder_or_exit
from nanogrpo.lab.ablate_lm import train_logged
from nanogrpo_base.ranges import check_or_exit

TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"
SEED_002_LOSS = 28.9  # Concept Overlap's PPO loss "exceeded 28.9 by step 31"
# Every cell: the demo preset (SmolLM2-135M-Instruct, LoRA r 16) with a binary reward, short answers, no
# entropy bonus and the symmetric clip, so the two algorithms differ only in their baselines (and PPO's
# value loss, epochs and per-token KL reward). log-samples 0: the samples are not what is compared.
COMMON = ["--reward.spec", "contains:1", "--grpo.entropy-coef", "0", "--grpo.eps-high", "0.2",
          "--eval-prompts", "0", "--log-samples-every", "0"]  # fmt: skip
CURVES = ("loss", "pg_loss", "vf_loss", "reward", "kl", "explained_variance", "grad_norm", "value_mean")


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    algo: str  # 'ppo' or 'grpo'
    lr: float
    kl: float  # PPO: --ppo.kl-coef; GRPO: --grpo.beta of an in-loss k3 KL (Concept Overlap's GRPO had 0.05)
    seed: int

    @property
    def name(self) -> str:
        return f"{self.algo}_lr{self.lr:g}_kl{self.kl:g}_s{self.seed}"

    @property
    def config(self) -> str:
        """The cell without its seed: what the table averages over."""
        return f"{self.algo.upper()} lr {self.lr:g} KL {self.kl:g}"


def grid(lrs: list[float], kls: list[float], seeds: list[int], grpo_kl: float) -> list[Cell]:
    """PPO over lrs x kls x seeds, then GRPO over lrs x seeds (its KL fixed at grpo_kl)."""
    ppo = [Cell("ppo", lr, kl, s) for lr in lrs for kl in kls for s in seeds]
    return ppo + [Cell("grpo", lr, grpo_kl, s) for lr in lrs for s in seeds]


@dataclass(frozen=True)
class Shape:
    """What every cell of a grid shares: the batch and the completion length."""

    steps: int = 30
    group: int = 4  # completions per prompt (GRPO's group; PPO's too unless ppo_samples is set)
    prompts: int = 4  # --prompts-per-step
    tokens: int = 8  # --sampling.max-new-tokens
    ppo_samples: int = 0  # PPO's --ppo.samples-per-prompt (0 = group)


def command(cell: Cell, out_dir: Path, shape: Shape) -> list[str]:
    """The train.py command line of one cell."""
    n_ppo = shape.ppo_samples or shape.group
    algo = (
        ["--algo", "ppo", "--ppo.kl-coef", str(cell.kl), "--ppo.samples-per-prompt", str(n_ppo)]
        if cell.algo == "ppo"
        else ["--grpo.group-size", str(shape.group), "--grpo.scale-rewards", "group"]
        + (["--grpo.kl-placement", "loss", "--grpo.beta", str(cell.kl)] if cell.kl > 0 else [])
    )
    batch = ["--prompts-per-step", str(shape.prompts), "--sampling.max-new-tokens", str(shape.tokens)]
    return [sys.executable, str(TRAIN_PY), "demo", *COMMON, *batch, *algo, "--optim.lr", str(cell.lr),
            "--seed", str(cell.seed), "--steps", str(shape.steps), "--out-dir", str(out_dir)]  # fmt: skip


def read_curves(run_dir: Path) -> dict[str, list[float]]:
    """Curves from a run folder's metrics.jsonl (a missing or null value is nan)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    get = lambda r, k: float(r[k]) if r.get(k) is not None else math.nan  # noqa: E731
    return {k: [get(r, k) for r in rows] for k in CURVES}


def run_cells(cells: list[Cell], out: Path, shape: Shape, threads: int) -> list[dict]:
    """Each cell as a train.py subprocess, one after the other (a shared CPU)."""
    results = []
    for i, cell in enumerate(cells):
        rd = out / "runs" / cell.name
        if not (rd / "summary.json").exists():
            shutil.rmtree(rd, ignore_errors=True)  # a half-written cell would append to its metrics
            cmd = command(cell, rd, shape)
            print("$ " + " ".join(cmd[1:]), flush=True)
            train_logged(cmd, rd, threads)
        record = (
            rd / "ablate.json"
        )  # the command and its wall time (absent when the folder came from elsewhere)
        wall = json.loads(record.read_text())["wall_s"] if record.exists() else None
        c = read_curves(rd)
        results.append({"cell": asdict(cell), "curves": c, "wall_s": wall})
        print(f"[{i + 1}/{len(cells)}] {cell.name}: loss end {c['loss'][-1]:.3g} max {_nanmax(c['loss']):.3g}, "
              f"reward end {c['reward'][-1]:.2f} ({wall or 0:.0f} s)", flush=True)  # fmt: skip
    return results


# ----------------------------------------------------------------------------- summary, table, plot


def _nanmax(xs: list[float], key=abs) -> float:
    """The value of largest key (|x| by default) among the finite ones (nan if none)."""
    ok = [x for x in xs if math.isfinite(x)]
    return max(ok, key=key) if ok else math.nan


def _tail(xs: list[float], n: int) -> float:
    ok = [x for x in xs[-n:] if math.isfinite(x)]
    return statistics.fmean(ok) if ok else math.nan


def _seed_mean(curves: list[dict], f) -> float:
    vals = [f(c) for c in curves]
    ok = [v for v in vals if math.isfinite(v)]
    return statistics.fmean(ok) if ok else math.nan


def summarise(results: list[dict], tail: int = 5) -> list[dict]:
    """One row per configuration (seeds pooled): the loss at the end (mean of the last `tail` steps, then
    over seeds), its peak (the largest |loss| of any seed, signed), the value loss's peak, the reward over
    the first and the last `tail` steps, the explained variance and KL at the end, and the runs whose
    |loss| ever exceeded Concept Overlap's 28.9."""
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(Cell(**r["cell"]).config, []).append(r)
    rows = []
    for config, rs in by.items():
        cs = [r["curves"] for r in rs]
        ppo = rs[0]["cell"]["algo"] == "ppo"
        rows.append(
            {
                "config": config,
                "seeds": len(rs),
                "loss_end": _seed_mean(cs, lambda c: _tail(c["loss"], tail)),
                "loss_peak": _nanmax([_nanmax(c["loss"]) for c in cs]),
                "vf_loss_peak": _nanmax([_nanmax(c["vf_loss"]) for c in cs]) if ppo else None,
                "reward_start": _seed_mean(cs, lambda c: _tail(c["reward"][:tail], tail)),
                "reward_end": _seed_mean(cs, lambda c: _tail(c["reward"], tail)),
                "ev_end": _seed_mean(cs, lambda c: _tail(c["explained_variance"], tail)) if ppo else None,
                "kl_end": _seed_mean(cs, lambda c: _tail(c["kl"], tail)),
                "over_28.9": sum(
                    any(abs(x) > SEED_002_LOSS for x in c["loss"] if math.isfinite(x)) for c in cs
                ),
            }
        )
    return rows


def markdown(rows: list[dict], tail: int = 5) -> str:
    """The summary as a Markdown table."""
    cols = [("config", "configuration"), ("seeds", "seeds"), ("loss_end", f"loss (last {tail})"),
            ("loss_peak", "peak loss"), ("vf_loss_peak", "peak value loss"),
            ("reward_start", f"reward (first {tail})"), ("reward_end", f"reward (last {tail})"),
            ("ev_end", f"expl. var. (last {tail})"), ("kl_end", f"KL (last {tail})"),
            ("over_28.9", "runs with loss > 28.9")]  # fmt: skip

    def f(row: dict, k: str) -> str:
        v = row.get(k)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if k == "over_28.9":
            return f"{v}/{row['seeds']}"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(f(r, k) for k, _ in cols) + " |" for r in rows]) + "\n"


def plot(results: list[dict], path: Path, shape: Shape = Shape()) -> Path:
    """Three panels against the step: the loss of both, PPO's value loss, the reward (3-step trailing
    mean); one line per run, a colour per configuration, PPO warm colours and GRPO cool ones."""
    from nanogrpo.infra.plots import pyplot

    plt = pyplot()

    configs = sorted({Cell(**r["cell"]).config for r in results})
    warm = [c for c in configs if c.startswith("PPO")]
    cool = [c for c in configs if c.startswith("GRPO")]
    colour = {c: plt.cm.autumn(i / max(len(warm), 1)) for i, c in enumerate(warm)}
    colour |= {c: plt.cm.winter(i / max(len(cool), 1)) for i, c in enumerate(cool)}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("loss", "loss (PPO: policy + vf_coef * value)"), ("vf_loss", "PPO value loss"),
              ("reward", "reward (contains, 0/1; 3-step mean)"))  # fmt: skip
    seen: set[str] = set()
    for ax, (key, title) in zip(axes, panels):
        for r in results:
            cell = Cell(**r["cell"])
            ys = r["curves"][key]
            if key == "vf_loss" and cell.algo != "ppo":
                continue
            if key == "reward":
                ys = [_tail(ys[: i + 1], 3) for i in range(len(ys))]
            label = cell.config if (key == "loss" and cell.config not in seen) else None
            seen.add(cell.config)
            ax.plot(range(1, len(ys) + 1), ys, color=colour[cell.config], lw=1.2,
                    ls="-" if cell.seed % 2 == 0 else "--", label=label)  # fmt: skip
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    per_step = f"{shape.prompts} prompts x {shape.group} (PPO {shape.ppo_samples or shape.group}) completions"
    fig.suptitle(
        "PPO (value head + GAE) vs GRPO (group baseline), SmolLM2-135M + LoRA, sparse 0/1 reward; "
        f"{per_step} of <= {shape.tokens} tokens a step"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python -m nanogrpo.lab.ppo_vs_grpo", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--lrs", nargs="+", type=float, default=[1e-4, 5e-4], help="learning rates (LoRA)")
    ap.add_argument("--kls", nargs="+", type=float, default=[0.05, 0.1], help="PPO's --ppo.kl-coef values")
    ap.add_argument("--grpo-kl", type=float, default=0.05, help="GRPO's in-loss --grpo.beta (0 = no KL)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--group", type=int, default=4, help="completions per prompt, both algorithms")
    ap.add_argument("--prompts", type=int, default=4, help="--prompts-per-step of every run")
    ap.add_argument("--tokens", type=int, default=8, help="--sampling.max-new-tokens of every run")
    ap.add_argument("--ppo-samples", type=int, default=0, help="PPO's completions per prompt (0 = --group)")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each train.py")
    ap.add_argument("--out", default="runs/ppo_vs_grpo", help="output folder: runs/, the table, the plot")
    ap.add_argument("--plot", type=Path, default=None,
                    help="where the plot goes (default <out>/ppo_vs_grpo.png; docs/img/ppo_vs_grpo.png to "
                    "update the docs' figure)")  # fmt: skip
    a = ap.parse_args(argv)
    check_or_exit(a, LAB["ppo_vs_grpo"])  # each number in its range (nanogrpo/infra/flag_checks.py)
    a.out = folder_or_exit(a.out, "--out", ("runs", "ppo_vs_grpo.json", "ppo_vs_grpo.md", "ppo_vs_grpo.png"))
    # a default run must not overwrite the documented figure with a smaller or different grid
    a.plot = a.plot or a.out / "ppo_vs_grpo.png"
    t0 = time.perf_counter()
    cells = grid(a.lrs, a.kls, a.seeds, a.grpo_kl)
    shape = Shape(a.steps, a.group, a.prompts, a.tokens, a.ppo_samples)
    results = run_cells(cells, a.out, shape, a.threads)
    rows = summarise(results)
    table = markdown(rows)
    meta = {**asdict(shape), "common_flags": COMMON, "wall_s": time.perf_counter() - t0}
    a.out.mkdir(parents=True, exist_ok=True)
    replace_atomically(
        a.out / "ppo_vs_grpo.json", json.dumps({"meta": meta, "summary": rows, "runs": results})
    )
    replace_atomically(a.out / "ppo_vs_grpo.md", table)
    plot(results, a.plot, shape)
    print(f"\n{len(cells)} runs, {a.steps} steps each, {meta['wall_s'] / 60:.1f} min; plot: {a.plot}\n")
    print(table)
    return rows


if __name__ == "__main__":
    main()
