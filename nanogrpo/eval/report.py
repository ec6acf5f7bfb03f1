"""The run page: one static index.html in the run folder, readable with no server and no network.

`write_report(run_dir)` reads config.json, metrics.jsonl, samples.jsonl (and eval.json when the run
has a final base-vs-trained evaluation) and writes index.html with everything inline: CSS, a few lines
of JS, the curves as SVG drawn here (no plotting library, no CDN), and every logged group: prompt,
reference, each completion with its reward, every grader's score, the judge's marks and reason, and
the advantage, and a scatter of every logged completion's reward against its length, coloured by step
(with the hack/* curves: does the reward pay for length?); for a run graded by the rubric grader,
each criterion's pass rate over the logged steps and the latest verdicts. It tolerates a run in
progress: the logs are read as the trainer reads them on resume (metrics.read_jsonl), so a
half-written last line is skipped and a damaged line before it is an error.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from nanogrpo.metrics import read_jsonl, replace_atomically
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
]
PREFIXES = {  # panels that carry every key with this prefix
    "reward": "reward/",
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
"""

JS = """
function setAll(open){document.querySelectorAll('details.step').forEach(d=>d.open=open)}
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
    x0, x1 = (min(steps), max(steps)) if steps else (0, 1)
    yr = _span([v for ys in series.values() for v in ys if v is not None])
    out, px, py = _frame("curve", title, (x0, x1 if x1 > x0 else x0 + 1), yr)
    lx = PAD_L + 4
    for k, (name, ys) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        d, pen = [], False
        for x, y in zip(steps, ys):
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
        if len(series) > 1:
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
    `scatter` (an <svg> of reward against length) after the length panel."""
    if not metrics:
        return '<p class="muted">No metrics yet (metrics.jsonl is empty or missing).</p>'
    steps = [m.get("step", i) for i, m in enumerate(metrics)]
    keys = list(dict.fromkeys(k for m in metrics for k in m if k != "step" and _num(m[k]) is not None))
    panels = [(t, ks + [k for k in keys if t in PREFIXES and k.startswith(PREFIXES[t])]) for t, ks in PANELS]
    used = {k for _, ks in panels for k in ks}
    panels += [(k, [k]) for k in keys if k not in used]
    charts = []
    for title, ks in panels:
        series = {k: [_num(m.get(k)) for m in metrics] for k in ks if k in keys}
        if series:
            charts.append(svg_chart(title, steps, series))
        if title == "length":  # the reward against length comes next to the length curves
            charts.append(scatter)
    return f'<div class="grid">{"".join(charts)}</div>'


def _score_cell(x: Any) -> str:
    v = _num(x)
    if v is None:
        return '<td class="num muted">-</td>'
    hue = 120 * min(1.0, max(0.0, v))  # red (0) to green (1): grader scores live in [0, 1]
    return f'<td class="num" style="background:hsl({hue:.0f},70%,88%)">{_fmt(v)}</td>'


def _judge_cell(j: Any) -> str:
    if not isinstance(j, dict) or not j:
        return '<td class="judge muted">-</td>'
    marks = ", ".join(
        f"{html.escape(str(k))} {html.escape(f'{v:g}' if _num(v) is not None else str(v))}"
        for k, v in j.items()
        if k != "reason"
    )
    reason = f'<div class="reason">{html.escape(str(j["reason"]))}</div>' if j.get("reason") else ""
    return f'<td class="judge">{marks}{reason}</td>'


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


def write_report(run_dir: str | Path, max_sample_steps: int = 60) -> Path:
    """Write run_dir/index.html from the run's files and return its path."""
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
        f"<div class='muted'>{html.escape(summary)}</div></header>{eval_html(ev, cfg)}"
        f"<section id='curves'><h2>Curves</h2>{curves_html(metrics, length_scatter_html(samples, max_sample_steps))}</section>"
        f"{rubric_html(samples)}"
        f"<section id='samples'><h2>Samples</h2>{samples_html(samples, max_sample_steps)}</section>"
        f"<section id='config'><h2>Config</h2>{config_html(cfg)}</section>"
        f"<script type='application/json' id='run-data'>{data}</script><script>{JS}</script></body></html>"
    )
    out = run_dir / "index.html"
    replace_atomically(out, page)  # a browser never sees half a page
    return out
