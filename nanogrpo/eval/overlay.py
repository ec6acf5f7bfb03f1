"""Several runs on one page: `write_overlay(run_dirs, out)` draws each logged number's curves, a line per
run (one colour per run throughout, the run names in the legend), beside a table of each run's latest
numbers and held-out eval differences: `python eval.py report A B --out FILE.html`.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from nanogrpo.eval.cells import CSS, figure_html, fmt, latest
from nanogrpo.eval.report import run_json, run_log
from nanogrpo.infra import plots
from nanogrpo.infra.metrics import panels, replace_atomically


def _run_names(run_dirs: list[Path]) -> list[str]:
    """Each run's folder name; the parent's name too where two folders share a name, then #k."""
    names = [d.name for d in run_dirs]
    names = [f"{d.parent.name}/{d.name}" if names.count(d.name) > 1 else n for d, n in zip(run_dirs, names)]
    return [f"{n} #{k}" if names.count(n) > 1 else n for k, n in enumerate(names)]


def overlay_lines(names: list[str], all_metrics: list[list[dict]]) -> dict[str, list[plots.Line]]:
    """Per logged number (in the panels' order of metrics.METRICS), one line per run that logs it,
    labelled with the run's name: {key: [(run name, xs, ys), ...]}."""
    per_run = [{k: line for ls in plots.metric_lines(ms).values() for k, *line in ls} for ms in all_metrics]
    keys = [k for ks in panels(k for r in per_run for k in r).values() for k in ks]
    return {k: [(n, *r[k]) for n, r in zip(names, per_run) if k in r] for k in keys}


def write_overlay(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Write one static page to `out` with the curves of several runs overlaid: a chart per logged metric,
    a line per run (one colour per run throughout, the run names in the legend), and a table of each run's
    latest numbers and held-out eval (eval.json) differences. Returns its path."""
    dirs = [Path(d) for d in run_dirs]
    for d in dirs:
        if not d.is_dir():
            raise ValueError(f"{d} is not a run folder (expected config.json, metrics.jsonl, samples.jsonl)")
    names = _run_names(dirs)
    colors = [plots.COLORS[k % len(plots.COLORS)] for k in range(len(dirs))]
    metrics = [run_log(d / "metrics.jsonl") for d in dirs]  # a file it cannot use: one error naming it
    evals = [run_json(d / "eval.json") for d in dirs]
    charts = []
    for key, lines in overlay_lines(names, metrics).items():
        color = [colors[names.index(n)] for n, _, _ in lines]
        fig = plots.line_figure(key, lines, color, legend=True)
        charts.append(figure_html(key, plots.png_bytes(fig), latest(lines)))
    legend = "".join(
        f"<li data-run='{html.escape(n)}'><span class='swatch' style='background:{c}'></span>{html.escape(n)}"
        f" <span class='muted'>({html.escape(str(d))})</span></li>"
        for n, c, d in zip(names, colors, dirs)
    )
    ev_metrics = list(dict.fromkeys(m for ev in evals for m in ((ev or {}).get("metrics") or {})))
    cols = ("step", "reward", "kl", "entropy", "len_mean")
    rows = []
    for n, c, ms, ev in zip(names, colors, metrics, evals):
        last = ms[-1] if ms else {}
        cells = "".join(
            f"<td class='num'>{html.escape(str(last[k])) if k == 'step' and k in last else fmt(last.get(k))}</td>"
            for k in cols
        )
        for m in ev_metrics:
            s = ((ev or {}).get("metrics") or {}).get(m)
            cells += (
                "<td class='num muted'>-</td>"
                if not s
                else f"<td class='num{' sig' if s['low'] > 0 or s['high'] < 0 else ''}'>{s['diff']:+.3f} "
                f"[{s['low']:+.3f}, {s['high']:+.3f}]</td>"
            )
        rows.append(f"<tr><th style='color:{c}'>{html.escape(n)}</th>{cells}</tr>")
    head = "".join(f"<th>latest {k}</th>" for k in cols) + "".join(
        f"<th>held-out {html.escape(m)}: trained - base [95% CI]</th>" for m in ev_metrics
    )
    body = (
        f"<div class='grid'>{''.join(charts)}</div>"
        if charts
        else '<p class="muted">No metrics in any of these runs.</p>'
    )
    data = json.dumps({"runs": {n: {"dir": str(d), "metrics": ms} for n, d, ms in zip(names, dirs, metrics)}})
    data = data.replace("</", "<\\/")  # no </script> inside the data
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>nanogrpo · {html.escape(' vs '.join(names))}</title>"
        f"<style>{CSS}</style></head><body><header><h1>nanogrpo runs · {len(dirs)} overlaid</h1>"
        f"<ul class='legend'>{legend}</ul></header>"
        f"<section id='runs'><h2>Runs</h2><table class='runs'><tr><th>run</th>{head}</tr>{''.join(rows)}</table>"
        "<p class='muted'>Bold: the interval excludes 0. Each run's own page (index.html in its folder) has its "
        f"samples and held-out answers.</p></section><section id='curves'><h2>Curves</h2>{body}</section>"
        f"<script type='application/json' id='run-data'>{data}</script></body></html>"
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(out, page)
    return out
