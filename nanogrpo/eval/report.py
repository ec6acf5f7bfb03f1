"""The run page: one static index.html in the run folder, readable with no server and no network.

`write_report(run_dir)` reads config.json, metrics.jsonl, samples.jsonl (and eval.json when the run
has a final base-vs-trained evaluation) and writes index.html with everything inline: CSS, a few lines
of JS, the curves as SVG drawn here (no plotting library, no CDN), and every logged group: prompt,
reference, each completion with its reward, every grader's score, the judge's marks per criterion
and reason, and the advantage; the final eval's held-out answers (eval_base.jsonl, eval_trained.jsonl)
row by row, base against trained, changed rows first; and a scatter of every logged completion's reward against its length, coloured by step
(with the hack/* curves: does the reward pay for length?); for a run graded by the rubric grader,
each criterion's pass rate over the logged steps and the latest verdicts. It tolerates a run in
progress: the logs are read as the trainer reads them on resume (metrics.read_jsonl), so a
half-written last line is skipped and a damaged line before it is an error.

`write_overlay(run_dirs, out)` writes one static page with the curves of several runs overlaid (a chart
per metric, a colour per run, the run names in the legend): `python eval.py report A B --out FILE.html`.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from nanogrpo.infra.metrics import read_jsonl, replace_atomically
from rewards.registry import parse_spec
from rewards.rows import prompt_text

# Curves drawn first, in this order; every other numeric key of metrics.jsonl gets its own panel after.
PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["reward"]),  # plus every reward/<grader>
    ("KL", ["kl"]),
    ("sampler-trainer gap", ["sampler_abs_diff", "sampler_kl"]),
    ("entropy", ["entropy"]),
    ("length", ["len_mean", "len_max"]),
    ("score-length correlation in groups", []),  # every hack/len_corr/<grader>
    ("best is longest (fraction of groups)", []),  # every hack/best_is_longest/<grader>
    ("loss", ["loss"]),
    ("zero-std groups / truncation", ["frac_zero_std", "trunc_rate"]),
    ("clipped fraction", ["clip_low", "clip_high"]),
    ("grad norm", ["grad_norm"]),
    ("time per step (s)", ["t_sample", "t_score", "t_train"]),
    ("held-out eval", []),  # --eval-every: every eval/* (greedy means, pass@k, avg@k)
]
PREFIXES = {  # panels that carry every key with this prefix
    "reward": "reward/",
    "held-out eval": "eval/",
    "score-length correlation in groups": "hack/len_corr/",
    "best is longest (fraction of groups)": "hack/best_is_longest/",
}
COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d", "#bab0ac"]
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 380, 210, 52, 12, 28, 30

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header,section{max-width:1280px;margin:0 auto;padding:10px 20px}
h1{font-size:22px;margin:12px 0 4px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px}
.grid{display:flex;flex-wrap:wrap;gap:12px}.curve{background:#fff;border:1px solid #e3e3e3;border-radius:6px}
.curve text{font-size:11px;fill:#555}.curve .title{font-size:13px;fill:#222;font-weight:600}
.series,.rate{fill:none;stroke-width:1.6}.axis{fill:none;stroke:#999;stroke-width:1}.gridline{stroke:#eee}
details.step{background:#fff;border:1px solid #e3e3e3;border-radius:6px;margin:8px 0;padding:4px 10px}
details.step>summary{cursor:pointer;font-weight:600;padding:4px 0}
.group{border-top:1px solid #eee;padding:8px 0}.label{font-weight:600;color:#555;font-size:12px}
pre{white-space:pre-wrap;word-break:break-word;margin:2px 0 6px;font:13px/1.4 ui-monospace,monospace}
.prompt{background:#f3f6fa;padding:6px}.reference{background:#f4faf3;padding:6px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #e3e3e3;padding:3px 6px;vertical-align:top}
th{background:#f3f3f3;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}
td.text{min-width:420px;max-width:760px}.reason{color:#555;font-style:italic}
.muted{color:#888}.controls button{margin-right:6px}.sig{font-weight:700}
td.met{background:hsl(120,70%,88%);text-align:center}td.unmet{background:hsl(0,70%,90%);text-align:center}
td.verdict{text-align:center}.pitfall{color:#c62828}
table.judge-marks{font-size:12px;margin:0}table.judge-marks th{font-weight:600;background:#f8f8f8}
table.judge-marks td.reason{max-width:260px}td.mark{min-width:22px;text-align:center}
table.heldout td.answer{min-width:180px;max-width:360px}table.heldout pre{max-height:14em;overflow:auto}
td.pair{white-space:nowrap}ul.legend{list-style:none;padding:0;display:flex;flex-wrap:wrap;gap:14px}
.swatch{display:inline-block;width:14px;height:14px;border-radius:3px;margin-right:6px;vertical-align:-2px}
"""

JS = """
function setAll(open){document.querySelectorAll('details.step').forEach(d=>d.open=open)}
function filterHeldout(v){document.querySelectorAll('tr.heldout-row').forEach(r=>{const c=r.dataset.change;
r.style.display=(v==='all'||(v==='differs'?c!=='same answer':c===v))?'':'none'})}
"""


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _fmt(x: Any, digits: int = 3) -> str:
    v = _num(x)
    if v is None:
        return "-"
    return f"{v:.{digits}g}" if abs(v) >= 1e4 or (v != 0 and abs(v) < 1e-3) else f"{v:.{digits}f}"


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    step = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(step))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= step), default=step)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _span(vals: list[float]) -> tuple[float, float]:
    """The axis range of some values: widened when flat, padded 4% so marks stay off the frame."""
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5 * (abs(lo) or 1), hi + 0.5 * (abs(hi) or 1)
    return lo - 0.04 * (hi - lo), hi + 0.04 * (hi - lo)


def _frame(cls: str, title: str, xr: tuple[float, float], yr: tuple[float, float]):
    """An <svg> chart's opening, title, grid, ticks and axes, and its data-to-pixel maps px, py."""
    (x0, x1), (lo, hi) = xr, yr
    px = lambda x: PAD_L + (x - x0) / (x1 - x0) * (W - PAD_L - PAD_R)
    py = lambda y: H - PAD_B - (y - lo) / (hi - lo) * (H - PAD_T - PAD_B)
    out = [
        f'<svg class="{cls}" width="{W}" height="{H}" viewBox="0 0 {W} {H}" data-title="{html.escape(title)}">',
        f'<text class="title" x="{PAD_L}" y="16">{html.escape(title)}</text>',
    ]
    for t in _ticks(lo, hi):
        out.append(
            f'<line class="gridline" x1="{PAD_L}" x2="{W - PAD_R}" y1="{py(t):.1f}" y2="{py(t):.1f}"/>'
            f'<text x="{PAD_L - 4}" y="{py(t) + 4:.1f}" text-anchor="end">{t:.4g}</text>'
        )
    for t in _ticks(x0, x1):
        out.append(f'<text x="{px(t):.1f}" y="{H - PAD_B + 14}" text-anchor="middle">{t:g}</text>')
    out.append(f'<path class="axis" d="M{PAD_L},{PAD_T} V{H - PAD_B} H{W - PAD_R}"/>')
    return out, px, py


def svg_chart(
    title: str, steps: list[float], series: dict[str, list[float | None]], line_class: str = "series"
) -> str:
    """A line chart as an <svg class="curve">; each series is one <path class="series">, gaps where None.

    Lines that are not metrics.jsonl curves (the rubric's pass rates) take another `line_class` and keep
    their tooltip on a <g> around the path, so a page's series paths stay one per logged metric."""
    lines = [(name, steps, ys, COLORS[k % len(COLORS)]) for k, (name, ys) in enumerate(series.items())]
    return svg_lines(title, lines, line_class, legend=len(series) > 1)


def svg_lines(
    title: str,
    lines: list[tuple[str, list[float], list[float | None], str]],
    line_class: str = "series",
    legend: bool = True,
) -> str:
    """A line chart of (name, xs, ys, colour) lines, each with its own x values (the overlay of runs)."""
    xs = [x for _, xl, _, _ in lines for x in xl]
    x0, x1 = (min(xs), max(xs)) if xs else (0, 1)
    yr = _span([v for _, _, ys, _ in lines for v in ys if v is not None])
    out, px, py = _frame("curve", title, (x0, x1 if x1 > x0 else x0 + 1), yr)
    lx = PAD_L + 4
    for name, xl, ys, color in lines:
        d, pen = [], False
        for x, y in zip(xl, ys):
            if y is None:
                pen = False
                continue
            d.append(f"{'L' if pen else 'M'}{px(x):.1f},{py(y):.1f}")
            pen = True
        if len(d) == 1:  # a lone point is invisible as a path: make it a short tick
            d.append("h0.01")
        last = next((y for y in reversed(ys) if y is not None), None)
        tip = f"<title>{html.escape(name)}: last {_fmt(last)}</title>"
        path = f'<path class="{line_class}" stroke="{color}" d="{" ".join(d)}">'
        out.append(f"{path}{tip}</path>" if line_class == "series" else f"<g>{tip}{path}</path></g>")
        if legend:
            out.append(
                f'<text x="{lx}" y="{H - 4}" fill="{color}" style="fill:{color}">{html.escape(name)}</text>'
            )
            lx += 7 * len(name) + 16
    out.append("</svg>")
    return "".join(out)


def _mix(c0: str, c1: str, t: float) -> str:
    """The colour a fraction t of the way from c0 to c1 ('#rrggbb')."""
    a, b = (tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in (c0, c1))
    return "#" + "".join(f"{round(u + t * (v - u)):02x}" for u, v in zip(a, b))


def svg_scatter(title: str, points: list[tuple[float, float, float]], xlabel: str = "length") -> str:
    """(x, y, step) points as an <svg class="curve scatter"> of <circle class="point">, coloured from the
    first step (blue) to the last (orange)."""
    s0, s1 = (min(p[2] for p in points), max(p[2] for p in points)) if points else (0, 1)
    out, px, py = _frame("curve scatter", title, _span([p[0] for p in points]), _span([p[1] for p in points]))
    c0, c1 = COLORS[0], COLORS[1]
    for x, y, st in points:
        c = _mix(c0, c1, (st - s0) / (s1 - s0) if s1 > s0 else 1.0)
        out.append(
            f'<circle class="point" cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{c}" fill-opacity="0.6">'
            f"<title>step {st:g}: {xlabel} {x:g}, reward {_fmt(y)}</title></circle>"
        )
    out.append(f'<text x="{W - PAD_R}" y="{H - 4}" text-anchor="end">{xlabel} (tokens)</text>')
    out.append(f'<text x="{PAD_L + 4}" y="{H - 4}" style="fill:{c0}">step {s0:g}</text>')
    out.append(f'<text x="{PAD_L + 70}" y="{H - 4}" style="fill:{c1}">step {s1:g}</text></svg>')
    return "".join(out)


def length_scatter_html(samples: list[dict], max_steps: int) -> str:
    """The logged completions' reward against their length (tokens), coloured by step; at most
    `max_steps` logged steps, evenly spread over the run."""
    samples = samples[:: math.ceil(len(samples) / max_steps)] if len(samples) > max_steps else samples
    points = [
        (n, r, float(s.get("step", 0)))
        for s in samples
        for g in s.get("groups") or []
        for c in g.get("completions") or []
        if (n := _num(c.get("length"))) is not None and (r := _num(c.get("reward"))) is not None
    ]
    return svg_scatter("reward vs completion length", points) if points else ""


def curves_html(metrics: list[dict], scatter: str = "") -> str:
    """One chart per panel that has data (the reward panel carries every reward/<grader> line), and
    `scatter` (an <svg> of reward against length) after the length panel. A curve runs over the lines
    that log its key (eval/* comes every --eval-every steps; step 0's line holds nothing else); a null
    value is a gap."""
    if not metrics:
        return '<p class="muted">No metrics yet (metrics.jsonl is empty or missing).</p>'
    keys = list(dict.fromkeys(k for m in metrics for k in m if k != "step" and _num(m[k]) is not None))
    panels = [(t, ks + [k for k in keys if t in PREFIXES and k.startswith(PREFIXES[t])]) for t, ks in PANELS]
    used = {k for _, ks in panels for k in ks}
    panels += [(k, [k]) for k in keys if k not in used]
    charts = []
    for title, ks in panels:
        lines = []
        for j, k in enumerate(k for k in ks if k in keys):
            pts = [(float(m.get("step", i)), _num(m[k])) for i, m in enumerate(metrics) if k in m]
            lines.append((k, [x for x, _ in pts], [y for _, y in pts], COLORS[j % len(COLORS)]))
        if lines:
            charts.append(svg_lines(title, lines, legend=len(lines) > 1))
        if title == "length":  # the reward against length comes next to the length curves
            charts.append(scatter)
    return f'<div class="grid">{"".join(charts)}</div>'


def _score_cell(x: Any) -> str:
    v = _num(x)
    if v is None:
        return '<td class="num muted">-</td>'
    hue = 120 * min(1.0, max(0.0, v))  # red (0) to green (1): grader scores live in [0, 1]
    return f'<td class="num" style="background:hsl({hue:.0f},70%,88%)">{_fmt(v)}</td>'


def judge_marks(j: Any) -> tuple[dict[str, Any], str, Any]:
    """A completion's judge details as (marks per criterion, reason, score). train.py logs the judge's
    `{"marks": {criterion: 1-5}, "reason", "score", ...}`; a flat `{criterion: mark, "reason"}` reads too."""
    if not isinstance(j, dict):
        return {}, "", None
    if isinstance(j.get("marks"), dict):
        marks = dict(j["marks"])
    else:
        skip = {"reason", "score", "position", "cached"}
        marks = {k: v for k, v in j.items() if k not in skip and not isinstance(v, (dict, list))}
    return marks, str(j.get("reason") or ""), j.get("score")


def _mark_cell(v: Any) -> str:
    """A 1-5 judge mark, shaded from red (1) to green (5)."""
    x = _num(v)
    if x is None:
        return f'<td class="num mark muted">{html.escape(str(v)) if v is not None else "-"}</td>'
    hue = 120 * min(1.0, max(0.0, (x - 1) / 4))
    return f'<td class="num mark" style="background:hsl({hue:.0f},70%,88%)">{x:g}</td>'


def _judge_cell(j: Any) -> str:
    """One completion's judge details: a small table, a row per criterion with its mark, then the reason."""
    marks, reason, score = judge_marks(j)
    if not marks and not reason:
        return '<td class="judge muted">-</td>'
    rows = "".join(
        f'<tr class="criterion"><th>{html.escape(str(k))}</th>{_mark_cell(v)}</tr>' for k, v in marks.items()
    )
    if _num(score) is not None:
        rows += f'<tr class="score"><th>score</th><td class="num">{_fmt(score, 2)}</td></tr>'
    if reason:
        rows += f'<tr><td colspan="2" class="reason">{html.escape(reason)}</td></tr>'
    return f'<td class="judge"><table class="judge-marks">{rows}</table></td>'


def _mark(v: Any) -> str:
    """A verdict as text: yes (1), no (0), '-' (none); a soft verdict (P(met)) as its number."""
    x = _num(v)
    return "-" if x is None else "yes" if x == 1 else "no" if x == 0 else _fmt(x, 2)


def _rubric_cell(r: Any) -> str:
    """One completion's rubric verdicts: a line per criterion, pitfalls (weight < 0) in red."""
    if not isinstance(r, dict) or not r.get("criteria"):
        return '<td class="judge muted">-</td>'
    lines = []
    for c in r["criteria"]:
        cls = ' class="pitfall"' if (_num(c.get("weight")) or 0) < 0 else ""
        text = html.escape(str(c.get("criterion", ""))[:60])
        lines.append(f"<span{cls}>{_mark(c.get('verdict'))}: {text}</span>")
    return f'<td class="judge">{"<br>".join(lines)}</td>'


def group_html(g: dict) -> str:
    comps = g.get("completions") or []
    graders = list(dict.fromkeys(k for c in comps for k in (c.get("scores") or {})))
    has_judge = any(c.get("judge") for c in comps)
    has_rubric = any(isinstance(c.get("rubric"), dict) for c in comps)
    head = (
        "<tr><th>#</th><th>reward</th><th>advantage</th><th>length</th>"
        + "".join(f"<th>{html.escape(k)}</th>" for k in graders)
        + ("<th>judge</th>" if has_judge else "")
        + ("<th>rubric verdicts</th>" if has_rubric else "")
        + "<th>completion</th></tr>"
    )
    rows = []
    for i, c in enumerate(comps):
        adv = _num(c.get("advantage"))
        adv_style = (
            ""
            if adv is None
            else f' style="color:{"#1a7f37" if adv > 0 else "#c62828" if adv < 0 else "#555"}"'
        )
        rows.append(
            f'<tr class="completion"><td class="num">{i}</td>{_score_cell(c.get("reward"))}'
            f'<td class="num adv"{adv_style}>{_fmt(adv)}</td><td class="num">{_fmt(c.get("length"), 0)}</td>'
            + "".join(_score_cell((c.get("scores") or {}).get(k)) for k in graders)
            + (_judge_cell(c.get("judge")) if has_judge else "")
            + (_rubric_cell(c.get("rubric")) if has_rubric else "")
            + f'<td class="text"><pre>{html.escape(str(c.get("text", "")))}</pre></td></tr>'
        )
    ref = g.get("reference")
    ref_html = (
        f'<div class="label">reference</div><pre class="reference">{html.escape(str(ref))}</pre>'
        if ref is not None
        else ""
    )
    return (
        f'<div class="group" data-id="{html.escape(str(g.get("id", "")))}">'
        f'<div class="label">prompt · id {html.escape(str(g.get("id", "")))}</div>'
        f'<pre class="prompt">{html.escape(prompt_text(g.get("prompt", "")))}</pre>{ref_html}'
        f'<table class="completions">{head}{"".join(rows)}</table></div>'
    )


def samples_html(samples: list[dict], max_steps: int) -> str:
    if not samples:
        return '<p class="muted">No samples logged (samples.jsonl is empty or missing).</p>'
    note = ""
    if len(samples) > max_steps:  # keep the first logged step and the most recent ones
        note = f'<p class="muted">Showing {max_steps} of {len(samples)} logged steps (the first and the latest).</p>'
        samples = samples[:1] + samples[-(max_steps - 1) :]
    parts = [
        '<p class="controls"><button onclick="setAll(true)">expand all</button>'
        '<button onclick="setAll(false)">collapse all</button></p>',
        note,
    ]
    for n, s in enumerate(samples):
        groups = s.get("groups") or []
        rewards = [
            r for g in groups for c in g.get("completions") or [] if (r := _num(c.get("reward"))) is not None
        ]
        mean = f" · mean reward {sum(rewards) / len(rewards):.3f}" if rewards else ""
        parts.append(
            f'<details class="step" data-step="{html.escape(str(s.get("step")))}"{" open" if n == len(samples) - 1 else ""}>'
            f"<summary>step {html.escape(str(s.get('step')))} · {len(groups)} groups{mean}</summary>"
            + "".join(group_html(g) for g in groups)
            + "</details>"
        )
    return "".join(parts)


# ----------------------------------------------------------------------------- rubric verdicts (seed 004)

RUBRIC_LINES = 8
"""Most criteria drawn one by one (the most often judged); the table lists the same ones."""


def _rubric_verdicts(step: dict) -> list[tuple[dict, list[dict]]]:
    """(group, [each completion's rubric details]) for the groups of a logged step graded by the rubric."""
    out = []
    for g in step.get("groups") or []:
        details = [c["rubric"] for c in g.get("completions") or [] if isinstance(c.get("rubric"), dict)]
        if any(d.get("criteria") for d in details):
            out.append((g, details))
    return out


def rubric_rates(samples: list[dict]) -> tuple[list[float], dict[str, dict]]:
    """Per logged step with rubric verdicts, the share of answers that meet each criterion (the mean verdict:
    a pass rate, or the mean P(met) with soft verdicts). Criteria are keyed by their text, so a criterion
    shared by several prompts pools over them. Returns (steps, {criterion: {"weight", "n": verdicts over
    the run, "rates": [share or None per step]}}), plus two summary rows: "criteria met" (weight > 0) and
    "pitfalls committed" (weight < 0) over every criterion of that sign."""
    steps, per_step = [], []
    for s in samples:
        tally: dict[str, list[float]] = {}
        weights: dict[str, float] = {}
        for _, details in _rubric_verdicts(s):
            for d in details:
                for c in d.get("criteria") or []:
                    v, w = _num(c.get("verdict")), _num(c.get("weight")) or 0.0
                    if v is None or w == 0:
                        continue
                    name = str(c.get("criterion", ""))
                    weights.setdefault(name, w)
                    tally.setdefault(name, []).append(v)
                    tally.setdefault("criteria met" if w > 0 else "pitfalls committed", []).append(v)
        if tally:
            steps.append(float(s.get("step", len(steps))))
            per_step.append((tally, weights))
    out: dict[str, dict] = {}
    for k, (tally, weights) in enumerate(per_step):
        for name, vals in tally.items():
            row = out.setdefault(name, {"weight": weights.get(name), "n": 0, "rates": [None] * len(steps)})
            row["rates"][k] = sum(vals) / len(vals)
            row["n"] += len(vals)
    return steps, out


def _verdict_cell(v: Any, weight: Any) -> str:
    """A verdict, green when it is good news (a criterion met, a pitfall avoided), red when not."""
    x, w = _num(v), _num(weight) or 0.0
    if x is None:
        return '<td class="verdict muted">-</td>'
    good = x >= 0.5 if w >= 0 else x < 0.5
    return f'<td class="{"met" if good else "unmet"}">{_mark(x)}</td>'


def latest_verdicts_html(samples: list[dict]) -> str:
    """The latest logged step's verdicts: per group, a criterion-by-completion table."""
    last = next((s for s in reversed(samples) if _rubric_verdicts(s)), None)
    if last is None:
        return ""
    parts = [f"<h3>Latest verdicts (step {html.escape(str(last.get('step')))})</h3>"]
    for g, details in _rubric_verdicts(last):
        crit = next(d["criteria"] for d in details if d.get("criteria"))
        head = "<tr><th>criterion</th><th>weight</th>" + "".join(
            f"<th>#{k}</th>" for k in range(len(details))
        )
        rows = []
        for i, c in enumerate(crit):
            cells = "".join(
                _verdict_cell(
                    ((d.get("criteria") or [])[i : i + 1] or [{}])[0].get("verdict"), c.get("weight")
                )
                for d in details
            )
            rows.append(
                f"<tr class='criterion'><td>{html.escape(str(c.get('criterion', '')))}</td>"
                f"<td class='num'>{_fmt(c.get('weight'), 2)}</td>{cells}</tr>"
            )
        score = "".join(_score_cell(d.get("score")) for d in details)
        parts.append(
            f"<div class='group rubric' data-id='{html.escape(str(g.get('id', '')))}'>"
            f"<div class='label'>prompt · id {html.escape(str(g.get('id', '')))}</div>"
            f"<pre class='prompt'>{html.escape(prompt_text(g.get('prompt', ''))[:600])}</pre>"
            f"<table class='verdicts'>{head}</tr>{''.join(rows)}<tr><th>score</th><td></td>{score}</tr></table></div>"
        )
    return "".join(parts)


def rubric_html(samples: list[dict]) -> str:
    """The rubric section: pass rates over the logged steps (all criteria of each sign, then the most
    judged criteria one by one), a key to those, and the latest verdicts. '' for a run without a rubric."""
    steps, rates = rubric_rates(samples)
    if not rates:
        return ""
    summary = [k for k in ("criteria met", "pitfalls committed") if k in rates]
    crits = sorted((k for k in rates if k not in summary), key=lambda k: -rates[k]["n"])[:RUBRIC_LINES]
    keys = {k: f"c{i + 1}" for i, k in enumerate(crits)}
    charts = [
        svg_chart("rubric: share of verdicts met", steps, {k: rates[k]["rates"] for k in summary}, "rate"),
        svg_chart(
            "rubric: share met per criterion", steps, {keys[k]: rates[k]["rates"] for k in crits}, "rate"
        ),
    ]
    rows = "".join(
        f"<tr><th>{keys[k]}</th><td>{html.escape(k)}</td><td class='num'>{_fmt(rates[k]['weight'], 2)}</td>"
        f"<td class='num'>{rates[k]['n']}</td>"
        f"<td class='num'>{_fmt(next((r for r in rates[k]['rates'] if r is not None), None))}</td>"
        f"<td class='num'>{_fmt(next((r for r in reversed(rates[k]['rates']) if r is not None), None))}</td></tr>"
        for k in crits
    )
    more = len(rates) - len(summary) - len(crits)
    return (
        "<section id='rubric'><h2>Rubric criteria</h2>"
        f"<div class='grid'>{''.join(charts)}</div>"
        "<p class='muted'>Share met: the mean verdict over the logged answers judged on a criterion (1 = met). "
        "For a pitfall (weight &lt; 0) met means committed, so lower is better; in the tables green is good "
        f"news.{f' {more} more criteria are not drawn.' if more > 0 else ''}</p>"
        "<table class='criteria'><tr><th></th><th>criterion</th><th>weight</th><th>verdicts</th>"
        f"<th>first logged</th><th>latest</th></tr>{rows}</table>"
        f"{latest_verdicts_html(samples)}</section>"
    )


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(d, dict):
        return [kv for k, v in d.items() for kv in _flatten(v, f"{prefix}{k}.")]
    return [(prefix[:-1], d)]


def config_html(cfg: dict | None) -> str:
    if not cfg:
        return '<p class="muted">No config.json.</p>'
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(json.dumps(v))}</td></tr>" for k, v in _flatten(cfg)
    )
    return f'<table class="config">{rows}</table>'


def eval_html(ev: dict | None, cfg: dict | None = None) -> str:
    """The base-vs-trained table of eval.json, with a note when its graders are the ones trained on."""
    if not ev or not ev.get("metrics"):
        return ""
    try:
        trained = {n for n, w in parse_spec(((cfg or {}).get("reward") or {}).get("spec") or "") if w > 0}
    except ValueError:  # no reward spec (an SFT or DPO run): nothing was trained on a grader
        trained = set()
    trained &= set(ev["metrics"])
    note = (
        f"<p class='muted'>Scored with the graders the run trained on ({html.escape(', '.join(sorted(trained)))}):"
        " a check that training moved them, not a judgement of quality, since the policy learned their blind"
        " spots. Judge held-out completions with a grader or judge model it did not train on (docs/EVAL.md).</p>"
        if trained
        else ""
    )
    rows = []
    for m, s in ev["metrics"].items():
        sig = s["low"] > 0 or s["high"] < 0
        mc = s.get("mcnemar")
        rows.append(
            f"<tr><th>{html.escape(m)}</th><td class='num'>{s['n']}</td><td class='num'>{_fmt(s['mean_a'])}</td>"
            f"<td class='num'>{_fmt(s['mean_b'])}</td><td class='num{' sig' if sig else ''}'>{s['diff']:+.3f}</td>"
            f"<td>[{s['low']:+.3f}, {s['high']:+.3f}]</td><td>{'' if not mc else _fmt(mc['p'])}</td></tr>"
        )
    return (
        "<section id='eval'><h2>Held-out evaluation: base vs trained</h2><table><tr><th>metric</th><th>n</th>"
        "<th>base</th><th>trained</th><th>diff</th><th>paired bootstrap 95% CI</th><th>McNemar p</th></tr>"
        + "".join(rows)
        + f"</table><p class='muted'>Bold: the interval excludes 0.</p>{note}</section>"
    )


HELDOUT_ROWS = 500
"""Most held-out rows on the page (the ones whose answer changed most come first)."""


def heldout_rows(run_dir: Path) -> list[dict]:
    """The final eval's rows (eval_base.jsonl, eval_trained.jsonl, paired by line), each with both answers,
    both score dicts, `delta` (the mean over the shared metrics of trained - base) and `change`: 'better',
    'worse', 'same score' (a different answer, the same scores) or 'same answer'. Changed answers come
    first, the largest |delta| first; [] when the run has no such files."""
    base, trained = read_jsonl(run_dir / "eval_base.jsonl"), read_jsonl(run_dir / "eval_trained.jsonl")
    out = []
    for i, (b, t) in enumerate(zip(base, trained)):
        bs, ts = b.get("scores") or {}, t.get("scores") or {}
        diffs = [ts[m] - bs[m] for m in bs if _num(bs[m]) is not None and _num(ts.get(m)) is not None]
        delta = sum(diffs) / len(diffs) if diffs else 0.0
        same = str(b.get("completion", "")) == str(t.get("completion", ""))
        change = (
            "same answer"
            if same
            else "better"
            if delta > 1e-9
            else "worse"
            if delta < -1e-9
            else "same score"
        )
        out.append(
            {"i": i, "id": b.get("id", i), "prompt": b.get("prompt", ""), "reference": b.get("reference"),
             "base": b.get("completion", ""), "trained": t.get("completion", ""), "base_scores": bs,
             "trained_scores": ts, "delta": delta, "change": change}
        )  # fmt: skip
    return sorted(out, key=lambda r: (r["change"] == "same answer", -abs(r["delta"]), r["i"]))


def _pair_cell(b: Any, t: Any) -> str:
    """A metric's base and trained scores of one row, green when trained scored higher, red when lower."""
    x, y = _num(b), _num(t)
    if x is None and y is None:
        return '<td class="num muted">-</td>'
    bg = (
        ""
        if x is None or y is None or abs(y - x) < 1e-9
        else "hsl(120,70%,88%)"
        if y > x
        else "hsl(0,70%,90%)"
    )
    style = f' style="background:{bg}"' if bg else ""
    return f'<td class="num pair"{style}>{_fmt(x, 2)} &rarr; {_fmt(y, 2)}</td>'


def heldout_html(rows: list[dict], ev: dict | None = None) -> str:
    """The held-out answers per row: prompt, reference, base and trained answers and their scores, with a
    filter (all, changed answers, trained better, trained worse). '' when there are none."""
    if not rows:
        return ""
    metrics = list((ev or {}).get("metrics") or {}) or list(
        dict.fromkeys(m for r in rows for m in (*r["base_scores"], *r["trained_scores"]))
    )
    counts = {
        c: sum(r["change"] == c for r in rows) for c in ("better", "worse", "same score", "same answer")
    }
    note = f" Showing the first {HELDOUT_ROWS} of {len(rows)}." if len(rows) > HELDOUT_ROWS else ""
    head = (
        "<tr><th>#</th><th>prompt</th><th>reference</th><th>base answer</th><th>trained answer</th>"
        + "".join(
            f"<th>{html.escape(m)}<br><span class='muted'>base &rarr; trained</span></th>" for m in metrics
        )
        + "</tr>"
    )
    body = []
    for r in rows[:HELDOUT_ROWS]:
        ref = "" if r["reference"] is None else html.escape(str(r["reference"]))
        body.append(
            f"<tr class='heldout-row' data-change='{r['change']}' data-id='{html.escape(str(r['id']))}'>"
            f"<td class='num'>{html.escape(str(r['id']))}</td>"
            f"<td class='answer'><pre>{html.escape(prompt_text(r['prompt']))}</pre></td>"
            f"<td class='answer'><pre>{ref}</pre></td>"
            f"<td class='answer'><pre>{html.escape(str(r['base']))}</pre></td>"
            f"<td class='answer'><pre>{html.escape(str(r['trained']))}</pre></td>"
            + "".join(_pair_cell(r["base_scores"].get(m), r["trained_scores"].get(m)) for m in metrics)
            + "</tr>"
        )
    options = "".join(
        f"<option value='{v}'>{t}</option>"
        for v, t in (("all", "all rows"), ("differs", "answer changed"), ("better", "trained better"),
                     ("worse", "trained worse"))
    )  # fmt: skip
    return (
        "<section id='heldout'><h2>Held-out answers: base vs trained</h2>"
        f"<p class='muted'>{len(rows)} rows: {counts['better']} trained better, {counts['worse']} trained worse, "
        f"{counts['same score']} changed with the same scores, {counts['same answer']} the same answer. "
        f"Rows whose answer changed come first, the largest change in mean score first.{note}</p>"
        f"<p class='controls'>show <select id='heldout-filter' onchange='filterHeldout(this.value)'>{options}"
        f"</select></p><table class='heldout'>{head}{''.join(body)}</table></section>"
    )


def write_report(run_dir: str | Path, max_sample_steps: int = 60, out: str | Path | None = None) -> Path:
    """Write run_dir/index.html (or `out`) from the run's files and return its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(
            f"{run_dir} is not a run folder (expected config.json, metrics.jsonl, samples.jsonl)"
        )
    cfg_path, ev_path = run_dir / "config.json", run_dir / "eval.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else None
    ev = json.loads(ev_path.read_text()) if ev_path.exists() else None
    metrics = read_jsonl(run_dir / "metrics.jsonl")  # the trainer's reader: a torn last line is dropped
    samples = read_jsonl(run_dir / "samples.jsonl")
    last = metrics[-1] if metrics else {}
    summary = " · ".join(
        f"{k} {last[k] if k == 'step' else _fmt(last.get(k))}"
        for k in ("step", "reward", "kl", "entropy", "len_mean")
        if k in last
    )
    data = json.dumps({"metrics": metrics}).replace(
        "</", "<\\/"
    )  # the raw numbers, for anyone who wants them
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>nanogrpo · {html.escape(run_dir.name)}</title>"
        f"<style>{CSS}</style></head><body><header><h1>nanogrpo run · {html.escape(run_dir.name)}</h1>"
        f"<div class='muted'>{html.escape(summary)}</div></header>{eval_html(ev, cfg)}{heldout_html(heldout_rows(run_dir), ev)}"
        f"<section id='curves'><h2>Curves</h2>{curves_html(metrics, length_scatter_html(samples, max_sample_steps))}</section>"
        f"{rubric_html(samples)}"
        f"<section id='samples'><h2>Samples</h2>{samples_html(samples, max_sample_steps)}</section>"
        f"<section id='config'><h2>Config</h2>{config_html(cfg)}</section>"
        f"<script type='application/json' id='run-data'>{data}</script><script>{JS}</script></body></html>"
    )
    out = Path(out) if out else run_dir / "index.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(out, page)  # a browser never sees half a page
    return out


# ----------------------------------------------------------------------------- several runs on one page


def _run_names(run_dirs: list[Path]) -> list[str]:
    """Each run's folder name; the parent's name too where two folders share a name, then #k."""
    names = [d.name for d in run_dirs]
    names = [f"{d.parent.name}/{d.name}" if names.count(d.name) > 1 else n for d, n in zip(run_dirs, names)]
    return [f"{n} #{k}" if names.count(n) > 1 else n for k, n in enumerate(names)]


def overlay_keys(all_metrics: list[list[dict]]) -> list[str]:
    """Every numeric key logged by any run, in the run page's panel order, then the rest as logged."""
    keys = list(
        dict.fromkeys(
            k for ms in all_metrics for m in ms for k in m if k != "step" and _num(m[k]) is not None
        )
    )
    ordered = [
        k
        for t, ks in PANELS
        for k in ks + [k for k in keys if t in PREFIXES and k.startswith(PREFIXES[t])]
        if k in keys
    ]
    return list(dict.fromkeys(ordered + keys))


def write_overlay(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Write one static page to `out` with the curves of several runs overlaid: a chart per logged metric,
    a line per run (one colour per run throughout, the run names in the legend), and a table of each run's
    latest numbers and held-out eval (eval.json) differences. Returns its path."""
    dirs = [Path(d) for d in run_dirs]
    for d in dirs:
        if not d.is_dir():
            raise ValueError(f"{d} is not a run folder (expected config.json, metrics.jsonl, samples.jsonl)")
    names = _run_names(dirs)
    colors = [COLORS[k % len(COLORS)] for k in range(len(dirs))]
    metrics = [read_jsonl(d / "metrics.jsonl") for d in dirs]
    evals = [json.loads((d / "eval.json").read_text()) if (d / "eval.json").exists() else None for d in dirs]
    charts = []
    for key in overlay_keys(metrics):
        lines = []
        for name, color, ms in zip(names, colors, metrics):
            pts = [(m.get("step", i), _num(m.get(key))) for i, m in enumerate(ms) if key in m]
            if any(y is not None for _, y in pts):
                lines.append((name, [float(x) for x, _ in pts], [y for _, y in pts], color))
        charts.append(svg_lines(key, lines))
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
            f"<td class='num'>{html.escape(str(last[k])) if k == 'step' and k in last else _fmt(last.get(k))}</td>"
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
