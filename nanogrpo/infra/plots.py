"""Plots: nanogrpo's one plotting path (matplotlib). A run folder's PNGs, one per panel of metrics.METRICS
plus reward against length, which the run page (eval/report.py) embeds; and the helpers every other
figure uses: the overlay of runs, the rubric's pass rates, the Elo plots, the lab's ablations.

Every figure is drawn on the Agg backend (files only, no display); a PNG in a run folder is written
through open_run_file, never through a link.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from nanogrpo.infra.metrics import TITLES, open_run_file, panels, read_jsonl

COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d", "#bab0ac"]
"""A colour per line of a panel, or per run of the overlay: the same order on every chart."""

Line = tuple[str, list[float], list[float | None]]  # (label, xs, ys); None is a gap


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed): every plot starts here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path, dpi: int = 110) -> Path:
    """Write a figure as a PNG (never through a link) and free it."""
    with open_run_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=dpi)
    pyplot().close(fig)
    return path


def png_bytes(fig, dpi: int = 110) -> bytes:
    """A figure as PNG bytes (a page that embeds it has no folder to put a file in), and free it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    pyplot().close(fig)
    return buf.getvalue()


def _draw(ax, lines: list[Line], colors: list[str] | None = None, marker: bool = False) -> None:
    """Lines on one axis, each in its colour (COLORS in turn by default); a line 'K_std' beside a line 'K'
    is drawn as a +-1 std band around K instead."""
    by_label = {label: (xs, ys) for label, xs, ys in lines}
    colors = colors or [COLORS[j % len(COLORS)] for j in range(len(lines))]
    for (label, xs, ys), color in zip(lines, colors):
        if label.endswith("_std") and label[:-4] in by_label:
            continue
        y = [math.nan if v is None else v for v in ys]
        ax.plot(xs, y, label=label, color=color, lw=2 if label == "reward" else 1.2,
                marker="o" if marker or len(xs) == 1 else None, ms=3)  # fmt: skip
        if f"{label}_std" in by_label:
            sx, sd = by_label[f"{label}_std"]
            mid = dict(zip(xs, y))
            band = [(x, mid[x], s) for x, s in zip(sx, sd) if x in mid and s is not None]
            ax.fill_between([b[0] for b in band], [m - s for _, m, s in band], [m + s for _, m, s in band],
                            color=color, alpha=0.15, lw=0)  # fmt: skip


def line_figure(
    title: str, lines: list[Line], colors: list[str] | None = None, marker: bool = False, legend: bool = False
):
    """A line chart of (label, xs, ys) lines against the step; a legend when there are several, or asked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    _draw(ax, lines, colors, marker)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend or len(lines) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def grid_figure(title: str, lines: list[Line]):
    """One small chart per line (numbers of unrelated scales: the panel 'other')."""
    plt = pyplot()
    cols = min(3, len(lines))
    rows = math.ceil(len(lines) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 2.3 * rows + 0.4), squeeze=False)
    for ax, line in zip(axes.flat, lines):
        _draw(ax, [line])
        ax.set_title(line[0], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(lines) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def metric_lines(rows: list[dict]) -> dict[str, list[Line]]:
    """metrics.jsonl's numbers by panel (metrics.panels): per key, one line over the lines that log it
    (eval/* comes every K steps, and step 0's line holds nothing else); a null value is a gap."""
    keys = [k for r in rows for k, v in r.items() if k != "step" and _is_num(v)]
    out = {}
    for panel, ks in panels(keys).items():
        out[panel] = []
        for k in ks:
            has = [(i, r) for i, r in enumerate(rows) if k in r]
            xs = [float(r.get("step", i)) for i, r in has]
            out[panel].append((k, xs, [float(r[k]) if _is_num(r[k]) else None for _, r in has]))
    return out


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def plot_metrics(out_dir: Path) -> list[Path]:
    """<panel>.png for each panel with data (metrics.METRICS; the reward with each grader and a +-1 std
    band), then reward_vs_length.png from samples.jsonl. Returns the paths, in the run page's order."""
    rows = read_jsonl(out_dir / "metrics.jsonl")
    written = []
    for panel, lines in metric_lines(rows).items():
        title = TITLES.get(panel, panel)
        fig = (
            grid_figure(title, lines)
            if panel == "other"
            else line_figure(title, lines, marker=panel == "eval")
        )
        written.append(save_png(fig, out_dir / f"{panel}.png"))
    return written + plot_reward_vs_length(out_dir)


def length_points(samples: list[dict]) -> list[tuple[float, float, float]]:
    """(length in tokens, reward, step) of every logged completion that has both."""
    return [
        (float(c["length"]), float(c["reward"]), float(s.get("step", 0)))
        for s in samples
        for g in s.get("groups") or []
        for c in g.get("completions") or []
        if _is_num(c.get("reward")) and _is_num(c.get("length"))
    ]


def length_figure(points: list[tuple[float, float, float]]):
    """Reward against completion length, coloured by step: a cloud that tilts up over the run says the
    reward pays for length."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs, ys, steps = zip(*points) if points else ((), (), ())
    dots = ax.scatter(xs, ys, c=steps, cmap="viridis", s=8, alpha=0.6)
    if points:
        fig.colorbar(dots, ax=ax, label="step")
    ax.set_xlabel("completion length (tokens)")
    ax.set_ylabel("reward")
    ax.set_title("reward vs length")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_reward_vs_length(out_dir: Path) -> list[Path]:
    """reward_vs_length.png: every logged completion's reward against its length; [] with no samples."""
    points = length_points(read_jsonl(out_dir / "samples.jsonl"))
    return [save_png(length_figure(points), out_dir / "reward_vs_length.png")] if points else []
