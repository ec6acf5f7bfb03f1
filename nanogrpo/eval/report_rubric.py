"""The run page's rubric section (Small-LM Judges): for a run graded by the rubric grader, each criterion's pass
rate over the logged steps (drawn to rubric_met.png and rubric_criteria.png) and the latest verdicts.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from nanogrpo.eval.cells import figure_html, fmt, latest, num, score_cell, verdict_text
from nanogrpo.infra import plots
from nanogrpo_base.rows import prompt_text


def rubric_cell(r: Any) -> str:
    """One completion's rubric verdicts: a line per criterion, pitfalls (weight < 0) in red."""
    if not isinstance(r, dict) or not r.get("criteria"):
        return '<td class="judge muted">-</td>'
    lines = []
    for c in r["criteria"]:
        cls = ' class="pitfall"' if (num(c.get("weight")) or 0) < 0 else ""
        text = html.escape(str(c.get("criterion", ""))[:60])
        lines.append(f"<span{cls}>{verdict_text(c.get('verdict'))}: {text}</span>")
    return f'<td class="judge">{"<br>".join(lines)}</td>'


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
                    v, w = num(c.get("verdict")), num(c.get("weight")) or 0.0
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
    x, w = num(v), num(weight) or 0.0
    if x is None:
        return '<td class="verdict muted">-</td>'
    good = x >= 0.5 if w >= 0 else x < 0.5
    return f'<td class="{"met" if good else "unmet"}">{verdict_text(x)}</td>'


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
                f"<td class='num'>{fmt(c.get('weight'), 2)}</td>{cells}</tr>"
            )
        score = "".join(score_cell(d.get("score")) for d in details)
        parts.append(
            f"<div class='group rubric' data-id='{html.escape(str(g.get('id', '')))}'>"
            f"<div class='label'>prompt · id {html.escape(str(g.get('id', '')))}</div>"
            f"<pre class='prompt'>{html.escape(prompt_text(g.get('prompt', ''))[:600])}</pre>"
            f"<table class='verdicts'>{head}</tr>{''.join(rows)}<tr><th>score</th><td></td>{score}</tr></table></div>"
        )
    return "".join(parts)


def rubric_html(run_dir: Path, samples: list[dict]) -> str:
    """The rubric section: pass rates over the logged steps (all criteria of each sign, then the most
    judged criteria one by one; drawn to rubric_met.png and rubric_criteria.png), a key to those, and the
    latest verdicts. '' for a run without a rubric."""
    steps, rates = rubric_rates(samples)
    if not rates:
        return ""
    summary = [k for k in ("criteria met", "pitfalls committed") if k in rates]
    crits = sorted((k for k in rates if k not in summary), key=lambda k: -rates[k]["n"])[:RUBRIC_LINES]
    keys = {k: f"c{i + 1}" for i, k in enumerate(crits)}
    charts = []
    for name, title, ks in (("rubric_met", "rubric: share of verdicts met", summary),
                            ("rubric_criteria", "rubric: share met per criterion", crits)):  # fmt: skip
        lines = [(keys.get(k, k), steps, rates[k]["rates"]) for k in ks]
        if not lines:
            continue
        png = plots.save_png(plots.line_figure(title, lines, marker=True), run_dir / f"{name}.png")
        charts.append(figure_html(title, png.read_bytes(), latest(lines)))
    rows = "".join(
        f"<tr><th>{keys[k]}</th><td>{html.escape(k)}</td><td class='num'>{fmt(rates[k]['weight'], 2)}</td>"
        f"<td class='num'>{rates[k]['n']}</td>"
        f"<td class='num'>{fmt(next((r for r in rates[k]['rates'] if r is not None), None))}</td>"
        f"<td class='num'>{fmt(next((r for r in reversed(rates[k]['rates']) if r is not None), None))}</td></tr>"
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
