"""The Elo report's plots (Shaping Explanations): `plot_elo`, each variant's mean Elo with min-max bars, and
`plot_accuracy_vs_elo`, its Fig. 3 (accuracy against Elo). The report itself: pairwise.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nanogrpo.infra.plots import pyplot, save_png


def _bars(report: dict) -> tuple[list[str], list[float], list[float], list[float], str]:
    """Per variant, by mean Elo: (names, mid, low, high, what the bars are). Shaping Explanations' bars: the min and
    max over judges and runs; with one judge and one run each, that judge's 95% bootstrap CI."""
    variants = report.get("variants") or {n: {"runs": [n], **report["spread"][n]} for n in report["systems"]}
    names = sorted(variants, key=lambda n: variants[n]["mean"])
    runs = max(len(v["runs"]) for v in variants.values())
    judges = len(report["judges"])
    if judges == 1 and runs == 1:
        fit = next(iter(report["judges"].values()))
        sys_of = {n: variants[n]["runs"][0] for n in names}
        mid = [fit[sys_of[n]]["elo"] for n in names]
        return (
            names,
            mid,
            [fit[sys_of[n]]["low"] for n in names],
            [fit[sys_of[n]]["high"] for n in names],
            "95% bootstrap CI",
        )
    what = f"min-max over {judges} judge{'s' * (judges > 1)}" + (f" x {runs} runs" if runs > 1 else "")
    return (
        names,
        [variants[n]["mean"] for n in names],
        [variants[n]["min"] for n in names],
        [variants[n]["max"] for n in names],
        what,
    )


def plot_elo(report: dict, path: str | Path) -> Path:
    """Bar plot per variant: mean Elo over judges and runs, min-max bars (see `_bars`)."""
    plt = pyplot()
    names, mid, lo, hi, what = _bars(report)
    yerr = np.array([np.subtract(mid, lo), np.subtract(hi, mid)])  # (2, k)
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 3, 4))
    base = min(lo) - 30
    ax.bar(names, np.subtract(mid, base), bottom=base, yerr=yerr, capsize=5, color="#4c78a8")
    for x, m in enumerate(mid):  # the value inside the bar's foot, clear of the error bar
        ax.text(x, base + 4, f"{m:.1f}", ha="center", va="bottom", fontsize=9, color="white")
    ax.axhline(1500, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("Elo")
    ax.set_title(f"Elo from pairwise preferences\n(error bars: {what})", fontsize=10)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    return save_png(fig, Path(path), dpi=120)


def plot_accuracy_vs_elo(acc: dict, path: str | Path, baseline: str = "") -> Path:
    """Shaping Explanations' Fig. 3 as a scatter: accuracy (x) against Elo (y) per variant, min-max bars over runs
    (accuracy) and over judges and runs (Elo); a dashed line at the `baseline` variant's accuracy."""
    plt = pyplot()
    vs = acc["variants"]
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for k, (name, v) in enumerate(vs.items()):
        color = f"C{k % 10}"
        ax.errorbar(
            v["accuracy"], v["elo"],
            xerr=[[v["accuracy"] - v["acc_min"]], [v["acc_max"] - v["accuracy"]]],
            yerr=[[v["elo"] - v["elo_min"]], [v["elo_max"] - v["elo"]]],
            fmt="o", color=color, capsize=4,
        )  # fmt: skip
        ax.annotate(
            name,
            (v["accuracy"], v["elo"]),
            textcoords="offset points",
            xytext=(6, 6),
            fontsize=9,
            color=color,
        )
    if baseline in vs:
        ax.axvline(vs[baseline]["accuracy"], color="grey", lw=0.8, ls="--")
    ax.axhline(1500, color="grey", lw=0.6, ls=":")
    ax.set_xlabel(f"accuracy ({acc['metric']})")
    ax.set_ylabel("Elo (pairwise preferences)")
    ax.set_title("Accuracy vs preference: up and right is better on both", fontsize=10)
    ax.margins(0.15)
    fig.tight_layout()
    return save_png(fig, Path(path), dpi=120)
