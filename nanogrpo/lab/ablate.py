"""KL ablations: a grid of GRPO runs, collapse detection, a table and plots.

    python -m nanogrpo.lab.ablate toy [--variants none k1-reward k3-loss ...] [--betas 0.01 0.05 0.2] [--seeds 0 1 2]
                                  [--policy on off] [--std-norm on off] [--steps 300] [--out runs/ablate-toy]
    python -m nanogrpo.lab.ablate lm  [same grid flags | --smoke] [--preset tiny] [--steps 300] [--jobs 1]
                                  [--out runs/ablate-lm] [-- extra train.py flags]

'toy': stochastic GRPO (sampled groups, noisy rewards, Adam, grpo.py's own advantages and loss) on the
enumerable tabular policy of nanogrpo.lab.toy, so KL(pi || ref), entropy, expected reward and the distance to the
analytic optimum pi* ∝ ref * exp(r / beta) are exact at every step. Seconds per run.
'lm' (nanogrpo/lab/ablate_lm.py): the same grid through `train.py` (one subprocess per run, curves read back
from metrics.jsonl): a short SFT warm-up of the preset's model on 16 prompts of the built-in demo task
(once per output folder), then GRPO from it with ROUGE-L against the one-word answers; the warmed-up model
is also the KL reference. About half a minute per 300-step on-policy cell of the tiny preset on one CPU thread,
a minute off-policy; `--jobs N` runs N cells at once (one thread each: give it N free cores). `--smoke` checks
that the machinery runs, not what it finds: both KL settings (none and k3-loss), one seed, 10 GRPO steps
after the usual warm-up, in runs/ablate-lm-smoke (half a minute).

Collapse (each criterion reported separately, first step where it holds): entropy below 25% of its start;
reward more than 50% below its running peak; grad norm above 10x the running median of the previous steps.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from nanogrpo.config import GRPOConfig
from nanogrpo.infra.flag_checks import LAB
from nanogrpo.infra.metrics import replace_atomically
from nanogrpo.infra.outputs import folder_or_exit
from nanogrpo.lab.toy import ToySettings, toy_optimum, train_toy
from nanogrpo_base.ranges import check_or_exit

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
# lm --smoke: the grid's defaults become these (KL off and on, one cell each, 10 steps)
SMOKE = dict(variants=["none", "k3-loss"], betas=[0.04], seeds=[0], policy=["on"], std_norm=["on"], steps=10)


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
            scale_rewards="group" if self.std_norm else "none",
            num_iterations=mu if self.off_policy else 1,
            **VARIANTS[self.variant],
        )


# ----------------------------------------------------------------------------- collapse


def _trailing_mean(x: list[float], n: int) -> list[float]:
    return [statistics.fmean(x[max(0, i - n + 1) : i + 1]) for i in range(len(x))] if n > 1 else list(x)


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

    Entropy and reward are first averaged over the last `smooth` steps (trailing). entropy: H_t < entropy_frac
    * H_0. reward: peak_t - r_t > reward_drop * |peak_t|, peak_t the running max from step smooth - 1 on. grad: g_t > grad_spike * the
    median of the non-zero g_0..g_{t-1}, t >= warmup (a step whose groups all tie has no gradient at all).
    """

    out: dict[str, int | None] = {"entropy": None, "reward": None, "grad": None}
    if entropy:
        h = _trailing_mean(entropy, smooth)
        out["entropy"] = next((t for t in range(len(h)) if h[t] < entropy_frac * h[0]), None)
    peak = -math.inf
    for t, r in enumerate(_trailing_mean(reward, smooth)):
        if t < smooth - 1:  # a partial window is one or two noisy steps: no peak to fall from
            continue
        peak = max(peak, r)
        if peak - r > reward_drop * abs(peak) > 0:
            out["reward"] = t
            break
    for t in range(warmup, len(grad_norm)):
        seen = [
            g for g in grad_norm[:t] if g > 0
        ]  # 0: every group tied, no gradient; not a sample of the norm
        if seen and grad_norm[t] > grad_spike * statistics.median(seen):
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


def _sd(xs: list[float]) -> float | None:
    """The sample standard deviation (n - 1) of finite values; None for one value, NaN when one is not finite
    (a cell without a KL logs NaN; statistics.stdev raises on it)."""
    if len(xs) < 2:
        return None
    if not all(math.isfinite(x) for x in xs):
        return math.nan
    m = statistics.fmean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def summarise(results: list[dict], tail: int = 1) -> list[dict]:
    """One row per (setting, beta, variant): means (and sample stds, `*_sd`) over seeds of the final values
    (each the mean of the last `tail` steps; the entropy fraction divides it by the mean of the first `tail`),
    collapse counts."""
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
        end = lambda x: statistics.fmean(x[-tail:])  # noqa: E731
        finals: dict[str, list[float]] = {}  # per seed, so the table gives mean ± std over seeds
        for k in ("kl", "entropy", "reward", "dist"):
            if all(c.get(k) for c in curves):
                finals[k] = [end(c[k]) for c in curves]
        if "kl" in finals:
            finals["kl_max"] = [max(c["kl"]) for c in curves]
        if "entropy" in finals:
            finals["entropy_frac"] = [end(c["entropy"]) / end(c["entropy"][:tail]) for c in curves]
        if all("held_out" in r for r in rs):  # the final models' held-out exact match (a preset that has one)
            finals["em"] = [r["held_out"]["em"] for r in rs]
        for k, xs in finals.items():
            row[k] = statistics.fmean(xs)
            row[f"{k}_sd"] = _sd(xs)
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
    if any("em" in r for r in rows):
        cols += [("em", "held-out EM")]
    cols += [("collapsed_entropy", "H<25%"), ("step_entropy", "at step"), ("collapsed_reward", "reward-50%")]
    cols += [("collapsed_grad", "grad x10"), ("collapsed_any", "any")]

    def f(row, k):
        v = row.get(k)
        if v is None or (isinstance(v, float) and math.isnan(v)):  # not logged (a cell without a KL)
            return "-"
        if k.startswith("collapsed"):
            return f"{v}/{row['seeds']}"
        if isinstance(v, bool):
            return "on" if v else "off"
        if row.get(f"{k}_sd") is not None:  # a value over seeds: mean ± sample std
            return f"{v:.3g} ± {row[f'{k}_sd']:.2g}"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f(r, k) for k, _ in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(
    results: list[dict],
    out: Path,
    prefix: str,
    optimum: dict | None = None,
    smooth: int = 1,
    kl_title: str = "KL(pi || ref)",
) -> list[Path]:
    """One PNG per (setting, beta): KL, entropy, reward against steps; a line per variant (seed mean), band min-max.

    optimum (toy): per beta, pi*'s KL / entropy fraction / reward, drawn dashed; the entropy panel also shows
    the collapse threshold (25% of the start) dotted. smooth > 1: each curve is first averaged over its last
    `smooth` steps (trailing), as the collapse detector sees it."""
    from nanogrpo.infra.plots import pyplot

    plt = pyplot()

    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in results:
        key = (r["run"]["off_policy"], r["run"]["std_norm"], r["run"]["beta"])
        groups.setdefault(key, {}).setdefault(r["run"]["variant"], []).append(r)
    paths = []
    for (off, norm, beta), by_var in groups.items():
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
        for ax, k, title in zip(axes, ("kl", "entropy", "reward"), (kl_title, "entropy", "reward")):
            for variant, rs in by_var.items():
                curves = [_trailing_mean(r["curves"][k], smooth) for r in rs if r["curves"].get(k)]
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
        sm = f" ({smooth}-step moving averages)" if smooth > 1 else ""
        fig.suptitle(
            f"{'off' if off else 'on'}-policy, std-norm {'on' if norm else 'off'}, beta {beta:g}{sm}"
        )
        fig.tight_layout()
        p = out / f"{prefix}_{'off' if off else 'on'}_{'std' if norm else 'nostd'}_b{beta:g}.png"
        fig.savefig(p, dpi=80)
        plt.close(fig)
        paths.append(p)
    return paths


def _is_ablate_file(name: str) -> bool:
    """What the ablation writes in its folder: the LM task, the SFT warm-up, the cells, the tables and plots."""
    return name in ("task.jsonl", "sft", "runs") or name.startswith(("toy_", "lm_"))


def write(results: list[dict], out: Path, prefix: str, meta: dict) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    rows = summarise(results, meta.get("tail", 1))
    replace_atomically(
        out / f"{prefix}_results.json", json.dumps({"meta": meta, "summary": rows, "runs": results})
    )
    replace_atomically(out / f"{prefix}_table.md", markdown(rows))
    plot(
        results,
        out,
        prefix,
        meta.get("optimum"),
        meta.get("smooth", 1),
        meta.get("kl_title", "KL(pi || ref)"),
    )
    return rows


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m nanogrpo.lab.ablate", description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=["toy", "lm"])
    ap.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), help=f"default {' '.join(DEFAULT_VARIANTS)}"
    )
    ap.add_argument("--betas", nargs="+", type=float, help="default 0.01 0.05 0.2")
    ap.add_argument("--seeds", nargs="+", type=int, help="default 0 1 2")
    ap.add_argument("--policy", nargs="+", choices=["on", "off"], help="default on off")
    ap.add_argument("--std-norm", nargs="+", choices=["on", "off"], help="default on off")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (300)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="lm: a quick check that it runs: none and k3-loss, beta 0.04, seed 0, on-policy, std-norm on, "
        "10 steps, in runs/ablate-lm-smoke",
    )
    ap.add_argument("--mu", type=int, default=4, help="num_iterations of the off-policy runs")
    ap.add_argument("--lr", type=float, default=ToySettings.lr, help="toy: Adam learning rate")
    ap.add_argument("--noise", type=float, default=ToySettings.noise, help="toy: reward noise std")
    ap.add_argument("--preset", default="tiny", help="lm: train.py preset")
    ap.add_argument("--rows", type=int, default=None, help="lm: prompts of the demo task to train on (16)")
    ap.add_argument(
        "--sft-steps", type=int, default=38,
        help="lm: SFT warm-up steps (every row each step); 0: no warm-up, the preset as it is (its model, LoRA, "
        "task, reward and held-out evaluation: --preset demo is SmolLM2 with LoRA)",
    )  # fmt: skip
    ap.add_argument("--sft-lr", type=float, default=1e-2, help="lm: SFT warm-up learning rate")
    ap.add_argument("--threads", type=int, default=1, help="lm: torch threads of each train.py")
    ap.add_argument("--jobs", type=int, default=1, help="lm: cells run at once (each --threads threads)")
    ap.add_argument("--out", default=None, help="output folder (runs/ablate-<kind>)")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    a, extra = ap.parse_args(argv[:cut]), argv[cut + 1 :]  # lm: flags after -- go to train.py as they are
    check_or_exit(a, LAB["ablate"])  # each number in its range (nanogrpo/infra/flag_checks.py)
    defaults = dict(variants=DEFAULT_VARIANTS, betas=[0.01, 0.05, 0.2], seeds=[0, 1, 2], policy=["on", "off"],
                    std_norm=["on", "off"], steps=300)  # fmt: skip
    g = {
        k: getattr(a, k) if getattr(a, k) is not None else (SMOKE if a.smoke else defaults)[k]
        for k in defaults
    }
    default = f"runs/ablate-{a.kind}{'-smoke' if a.smoke else ''}"  # never the full grid's cells
    # '' (the current folder), a file, or a folder of other files: refused before any run
    out = folder_or_exit(default if a.out is None else a.out, "--out", _is_ablate_file)
    runs = grid(g["variants"], g["betas"], g["seeds"], g["policy"], g["std_norm"])
    t0 = time.perf_counter()
    if a.kind == "toy":
        torch.set_num_threads(1)  # tensors of ~100 numbers: threads only add overhead
        s = ToySettings(steps=g["steps"], lr=a.lr, noise=a.noise, mu=a.mu)
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
        meta = {"kind": "toy", "settings": asdict(s), "argv": argv, "optimum": toy_optimum(g["betas"], s)}
    else:
        from nanogrpo.lab.ablate_lm import lm_grid

        results, meta = lm_grid(runs, out, a, tuple(extra), g["steps"])
        meta["argv"] = argv
    meta["wall_s"] = time.perf_counter() - t0
    write(results, out, a.kind, meta)
    print((out / f"{a.kind}_table.md").read_text())
    print(
        f"wrote {out}/{a.kind}_table.md, {a.kind}_results.json and {a.kind}_*.png in {meta['wall_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
