"""KL ablations: a grid of GRPO runs, collapse detection, a table and plots.

    python -m nanogrpo.ablate toy [--variants none k1-reward k3-loss ...] [--betas 0.01 0.05 0.2] [--seeds 0 1 2]
                                  [--policy on off] [--std-norm on off] [--steps 300] [--out runs/ablate-toy]
    python -m nanogrpo.ablate lm  [same grid flags] [--preset tiny] [--steps 40] [--out runs/ablate-lm]

'toy': stochastic GRPO (sampled groups, noisy rewards, Adam, grpo.py's own advantages and loss) on the
enumerable tabular policy of nanogrpo.toy, so KL(pi || ref), entropy, expected reward and the distance to the
analytic optimum pi* ∝ ref * exp(r / beta) are exact at every step. Seconds per run.
'lm': the same grid through `train.py` (one subprocess per run, curves read back from metrics.jsonl).

Collapse (each criterion reported separately, first step where it holds): entropy below 25% of its start;
reward more than 50% below its running peak; grad norm above 10x the running median of the previous steps.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from nanogrpo.config import GRPOConfig
from nanogrpo.toy import ToySettings, toy_optimum, train_toy

# name -> GRPOConfig fields; the names are what tables and plots show
VARIANTS: dict[str, dict] = {
    "none": dict(kl_placement="none"),
    "k1-reward": dict(kl_placement="reward", kl_estimator="k1"),
    "k3-reward": dict(kl_placement="reward", kl_estimator="k3"),
    "k1-loss": dict(kl_placement="loss", kl_estimator="k1"),
    "k3-loss": dict(kl_placement="loss", kl_estimator="k3"),  # GRPO paper / TRL
    "k2-seq-loss": dict(kl_placement="loss", kl_estimator="k2", kl_reward_to_go=True),
    "k3-is-loss": dict(kl_placement="loss", kl_estimator="k3", kl_is_weight=True),  # DeepSeek-V3.2
    "k3-is-seq-loss": dict(kl_placement="loss", kl_estimator="k3", kl_is_weight=True, kl_reward_to_go=True),
}
DEFAULT_VARIANTS = ["none", "k1-loss", "k3-loss", "k2-seq-loss", "k3-is-loss", "k1-reward"]


@dataclass(frozen=True)
class Run:
    """One cell of the grid."""

    variant: str
    beta: float
    seed: int
    off_policy: bool
    std_norm: bool

    @property
    def setting(self) -> str:
        return f"{'off' if self.off_policy else 'on'}-policy, std-norm {'on' if self.std_norm else 'off'}"

    def grpo(self, base: GRPOConfig, mu: int) -> GRPOConfig:
        return replace(
            base,
            beta=self.beta,
            adv_std_norm=self.std_norm,
            num_iterations=mu if self.off_policy else 1,
            **VARIANTS[self.variant],
        )


# ----------------------------------------------------------------------------- collapse


def detect_collapse(
    entropy: list[float],
    reward: list[float],
    grad_norm: list[float],
    *,
    entropy_frac: float = 0.25,
    reward_drop: float = 0.5,
    grad_spike: float = 10.0,
    warmup: int = 10,
    smooth: int = 1,
) -> dict[str, int | None]:
    """First step at which each collapse criterion holds (None: never); 'any' is the earliest of them.

    entropy: H_t < entropy_frac * H_0. reward (moving average over `smooth` steps): peak_t - r_t >
    reward_drop * |peak_t|, peak_t the running max. grad: g_t > grad_spike * median(g_0..g_{t-1}), t >= warmup.
    """

    def ma(x: list[float]) -> list[float]:
        return (
            [statistics.fmean(x[max(0, i - smooth + 1) : i + 1]) for i in range(len(x))] if smooth > 1 else x
        )

    out: dict[str, int | None] = {"entropy": None, "reward": None, "grad": None}
    if entropy:
        out["entropy"] = next((t for t, h in enumerate(entropy) if h < entropy_frac * entropy[0]), None)
    peak = -math.inf
    for t, r in enumerate(ma(reward)):
        peak = max(peak, r)
        if peak - r > reward_drop * abs(peak) > 0:
            out["reward"] = t
            break
    for t in range(warmup, len(grad_norm)):
        if grad_norm[t] > grad_spike * statistics.median(grad_norm[:t]):
            out["grad"] = t
            break
    hits = [v for v in out.values() if v is not None]
    out["any"] = min(hits) if hits else None
    return out


# ----------------------------------------------------------------------------- grid, table, plots


def grid(variants, betas, seeds, policies, std_norms) -> list[Run]:
    return [
        Run(v, b, sd, p == "off", n == "on")
        for p in policies
        for n in std_norms
        for b in betas
        for v in variants
        for sd in seeds
    ]


def summarise(results: list[dict]) -> list[dict]:
    """One row per (setting, beta, variant): means over seeds of the final exact values, collapse counts."""
    cells: dict[tuple, list[dict]] = {}
    for r in results:
        u = r["run"]
        cells.setdefault((u["off_policy"], u["std_norm"], u["beta"], u["variant"]), []).append(r)
    out = []
    for (off, norm, beta, variant), rs in cells.items():
        row = {
            "policy": "off" if off else "on",
            "std_norm": norm,
            "beta": beta,
            "variant": variant,
            "seeds": len(rs),
        }
        curves = [r["curves"] for r in rs]
        for k in ("kl", "entropy", "reward", "dist"):
            if all(c.get(k) for c in curves):
                row[k] = statistics.fmean(c[k][-1] for c in curves)
        if "kl" in row:
            row["kl_max"] = statistics.fmean(max(c["kl"]) for c in curves)
        if "entropy" in row:
            row["entropy_frac"] = statistics.fmean(c["entropy"][-1] / c["entropy"][0] for c in curves)
        for c in ("entropy", "reward", "grad", "any"):
            steps = [r["collapse"][c] for r in rs if r["collapse"][c] is not None]
            row[f"collapsed_{c}"] = len(steps)
            row[f"step_{c}"] = statistics.fmean(steps) if steps else None
        out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    cols = [
        ("policy", "policy"),
        ("std_norm", "std"),
        ("beta", "beta"),
        ("variant", "variant"),
        ("kl", "KL end"),
    ]
    cols += [
        ("kl_max", "KL max"),
        ("entropy_frac", "H end/H0"),
        ("reward", "reward end"),
        ("dist", "KL(pi|pi*) end"),
    ]
    cols += [("collapsed_entropy", "H<25%"), ("step_entropy", "at step"), ("collapsed_reward", "reward-50%")]
    cols += [("collapsed_grad", "grad x10"), ("collapsed_any", "any")]

    def f(row, k):
        v = row.get(k)
        if v is None:
            return "-"
        if k.startswith("collapsed"):
            return f"{v}/{row['seeds']}"
        if isinstance(v, bool):
            return "on" if v else "off"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f(r, k) for k, _ in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path, prefix: str, optimum: dict | None = None) -> list[Path]:
    """One PNG per (setting, beta): KL, entropy, reward against steps; a line per variant (seed mean), band min-max.

    optimum (toy): per beta, pi*'s KL / entropy fraction / reward, drawn dashed; the entropy panel also shows
    the collapse threshold (25% of the start) dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in results:
        key = (r["run"]["off_policy"], r["run"]["std_norm"], r["run"]["beta"])
        groups.setdefault(key, {}).setdefault(r["run"]["variant"], []).append(r)
    paths = []
    for (off, norm, beta), by_var in groups.items():
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
        for ax, k, title in zip(axes, ("kl", "entropy", "reward"), ("KL(pi || ref)", "entropy", "reward")):
            for variant, rs in by_var.items():
                curves = [r["curves"][k] for r in rs if r["curves"].get(k)]
                if not curves:
                    continue
                n = min(len(c) for c in curves)
                cols = list(zip(*(c[:n] for c in curves)))
                mean = [statistics.fmean(c) for c in cols]
                (line,) = ax.plot(range(n), mean, label=variant, lw=1.4)
                ax.fill_between(
                    range(n),
                    [min(c) for c in cols],
                    [max(c) for c in cols],
                    color=line.get_color(),
                    alpha=0.2,
                )
            ax.set_title(title)
            h0 = next(iter(by_var.values()))[0]["curves"]["entropy"][0]
            opt = (optimum or {}).get(f"{beta:g}")
            if opt:
                ax.axhline(opt["entropy_frac"] * h0 if k == "entropy" else opt[k], color="k", ls="--", lw=0.8)
            if k == "entropy":
                ax.axhline(0.25 * h0, color="k", ls=":", lw=0.8)
            ax.set_xlabel("step")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{'off' if off else 'on'}-policy, std-norm {'on' if norm else 'off'}, beta {beta:g}")
        fig.tight_layout()
        p = out / f"{prefix}_{'off' if off else 'on'}_{'std' if norm else 'nostd'}_b{beta:g}.png"
        fig.savefig(p, dpi=80)
        plt.close(fig)
        paths.append(p)
    return paths


def write(results: list[dict], out: Path, prefix: str, meta: dict) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    rows = summarise(results)
    (out / f"{prefix}_results.json").write_text(json.dumps({"meta": meta, "summary": rows, "runs": results}))
    (out / f"{prefix}_table.md").write_text(markdown(rows))
    plot(results, out, prefix, meta.get("optimum"))
    return rows


# ----------------------------------------------------------------------------- small LM (train.py)


def lm_command(run: Run, out_dir: Path, *, preset: str, steps: int, mu: int, extra: list[str]) -> list[str]:
    """The train.py command line of one grid cell (tyro flags of nanogrpo.config.GRPOConfig)."""
    g = run.grpo(GRPOConfig(), mu)
    flag = lambda name, on: f"--grpo.{'' if on else 'no-'}{name}"  # noqa: E731
    return [
        sys.executable, "train.py", preset, "--out-dir", str(out_dir), "--seed", str(run.seed), "--steps", str(steps),
        "--grpo.kl-placement", g.kl_placement, "--grpo.kl-estimator", g.kl_estimator, "--grpo.beta", str(g.beta),
        "--grpo.num-iterations", str(g.num_iterations), flag("adv-std-norm", g.adv_std_norm),
        flag("kl-is-weight", g.kl_is_weight), flag("kl-reward-to-go", g.kl_reward_to_go), *extra,
    ]  # fmt: skip


def read_metrics(run_dir: Path) -> dict[str, list[float]]:
    """Curves from a train.py run folder's metrics.jsonl (missing values become nan)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    get = lambda r, k: float(r[k]) if r.get(k) is not None else math.nan  # noqa: E731
    return {k: [get(r, k) for r in rows] for k in ("kl", "entropy", "reward", "grad_norm")}


def run_lm(runs: list[Run], out: Path, *, preset: str, steps: int, mu: int, extra: list[str]) -> list[dict]:
    """Each cell as a train.py subprocess (sequential: one CPU), then the toy's collapse detection on its curves."""
    results = []
    for run in runs:
        rd = (
            out
            / "runs"
            / f"{run.variant}_b{run.beta:g}_s{run.seed}_{'off' if run.off_policy else 'on'}_{'std' if run.std_norm else 'nostd'}"
        )
        if not (rd / "metrics.jsonl").exists():
            subprocess.run(lm_command(run, rd, preset=preset, steps=steps, mu=mu, extra=extra), check=True)
        c = read_metrics(rd)
        results.append(
            {
                "run": asdict(run),
                "curves": c,
                "collapse": detect_collapse(c["entropy"], c["reward"], c["grad_norm"], smooth=5),
            }
        )
    return results


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m nanogrpo.ablate", description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=["toy", "lm"])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--betas", nargs="+", type=float, default=[0.01, 0.05, 0.2])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--policy", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--std-norm", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (toy 300, lm 40)")
    ap.add_argument("--mu", type=int, default=4, help="num_iterations of the off-policy runs")
    ap.add_argument("--lr", type=float, default=ToySettings.lr, help="toy: Adam learning rate")
    ap.add_argument("--noise", type=float, default=ToySettings.noise, help="toy: reward noise std")
    ap.add_argument("--preset", default="tiny", help="lm: train.py preset")
    ap.add_argument("--out", default=None, help="output folder (runs/ablate-<kind>)")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    a, extra = ap.parse_args(argv[:cut]), argv[cut + 1 :]  # lm: flags after -- go to train.py as they are
    out = Path(a.out or f"runs/ablate-{a.kind}")
    runs = grid(a.variants, a.betas, a.seeds, a.policy, a.std_norm)
    if a.kind == "toy":
        torch.set_num_threads(1)  # tensors of ~100 numbers: threads only add overhead
        s = ToySettings(steps=a.steps or 300, lr=a.lr, noise=a.noise, mu=a.mu)
        results = []
        for i, run in enumerate(runs):
            c = train_toy(run.grpo(GRPOConfig(group_size=s.group_size), s.mu), run.seed, s)
            results.append(
                {
                    "run": asdict(run),
                    "curves": c,
                    "collapse": detect_collapse(c["entropy"], c["reward"], c["grad_norm"]),
                }
            )
            print(f"[{i + 1}/{len(runs)}] {run.variant:14} beta {run.beta:g} seed {run.seed} {run.setting}: "
                  f"KL {c['kl'][-1]:.3f} H {c['entropy'][-1]:.3f} reward {c['reward'][-1]:.3f}", flush=True)  # fmt: skip
        meta = {"kind": "toy", "settings": asdict(s), "argv": argv, "optimum": toy_optimum(a.betas, s)}
    else:
        results = run_lm(runs, out, preset=a.preset, steps=a.steps or 40, mu=a.mu, extra=extra)
        meta = {"kind": "lm", "argv": argv, "preset": a.preset, "steps": a.steps or 40}
    write(results, out, a.kind, meta)
    print((out / f"{a.kind}_table.md").read_text())
    print(f"wrote {out}/{a.kind}_table.md, {a.kind}_results.json and {a.kind}_*.png")


if __name__ == "__main__":
    main()
