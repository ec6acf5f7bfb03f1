"""The run page: one static index.html in the run folder, readable with no server and no network.

`write_report(run_dir)` (re)draws the run's PNGs (infra/plots.plot_metrics: a chart per panel of
metrics.METRICS, reward against length) and writes index.html from config.json, metrics.jsonl,
samples.jsonl (and eval.json when the run has a final base-vs-trained evaluation) with everything inline:
CSS, a few lines of JS, the PNGs embedded (each with the latest value of every line it draws), and every
logged group: prompt, reference, each completion with its reward, every grader's score, the judge's
marks per criterion and reason, and the advantage; the final eval's held-out answers (eval_base.jsonl,
eval_trained.jsonl) row by row, base against trained, changed rows first; for a run graded by the rubric
grader, each criterion's pass rate and the latest verdicts (report_rubric.py). It tolerates a run in
progress: the logs are read as the trainer reads them on resume (metrics.read_jsonl), so a half-written
last line is skipped and a damaged line before it is an error. A file the page cannot use (a torn config.json,
a log line that is not an object, bytes that are not UTF-8) is one error naming it (`run_json`, `run_log`).

Several runs on one page: overlay.py. The CSS and the cells every page shares: cells.py.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from nanogrpo.eval.cells import CSS, JS, figure_html, fmt, latest, num, score_cell
from nanogrpo.eval.report_rubric import rubric_cell, rubric_html
from nanogrpo.infra import plots
from nanogrpo.infra.config_file import flat_config
from nanogrpo.infra.metrics import TITLES, read_jsonl, replace_atomically
from nanogrpo.infra.sample_table import completion_text
from nanogrpo_base.rows import prompt_text
from rewards.episode import OUTCOMES
from rewards.spec import parse_spec


def curves_html(run_dir: Path, metrics: list[dict]) -> str:
    """The run's PNGs, (re)drawn by plot_metrics: a chart per panel with data (the reward carries every
    reward/<grader>), and reward against length next to the length panel."""
    pngs = {p.stem: p for p in plots.plot_metrics(run_dir)}
    if not pngs:
        return '<p class="muted">No metrics yet (metrics.jsonl is empty or missing).</p>'
    lines = plots.metric_lines(metrics)
    n = len(plots.length_points(read_jsonl(run_dir / "samples.jsonl")))
    order = [s for p in lines for s in ([p, "reward_vs_length"] if p == "length" else [p])]
    charts = []
    for name in dict.fromkeys(order + ["reward_vs_length"]):
        if name not in pngs:
            continue
        if name in lines:
            title, caption = TITLES.get(name, name), latest(lines[name])
        else:
            title, caption = "reward vs completion length", [f"{n} completions, coloured by step"]
        charts.append(figure_html(title, pngs[name].read_bytes(), caption))
    return f'<div class="grid">{"".join(charts)}</div>'


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
    x = num(v)
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
    if num(score) is not None:
        rows += f'<tr class="score"><th>score</th><td class="num">{fmt(score, 2)}</td></tr>'
    if reason:
        rows += f'<tr><td colspan="2" class="reason">{html.escape(reason)}</td></tr>'
    return f'<td class="judge"><table class="judge-marks">{rows}</table></td>'


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
        adv = num(c.get("advantage"))
        adv_style = (
            ""
            if adv is None
            else f' style="color:{"#1a7f37" if adv > 0 else "#c62828" if adv < 0 else "#555"}"'
        )
        rows.append(
            f'<tr class="completion"><td class="num">{i}</td>{score_cell(c.get("reward"))}'
            f'<td class="num adv"{adv_style}>{fmt(adv)}</td><td class="num">{fmt(c.get("length"), 0)}</td>'
            + "".join(score_cell((c.get("scores") or {}).get(k)) for k in graders)
            + (_judge_cell(c.get("judge")) if has_judge else "")
            + (rubric_cell(c.get("rubric")) if has_rubric else "")
            + f'<td class="text"><pre>{html.escape(completion_text(c))}</pre></td></tr>'
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
            r for g in groups for c in g.get("completions") or [] if (r := num(c.get("reward"))) is not None
        ]
        mean = f" · mean reward {sum(rewards) / len(rewards):.3f}" if rewards else ""
        parts.append(
            f'<details class="step" data-step="{html.escape(str(s.get("step")))}"{" open" if n == len(samples) - 1 else ""}>'
            f"<summary>step {html.escape(str(s.get('step')))} · {len(groups)} groups{mean}</summary>"
            + "".join(group_html(g) for g in groups)
            + "</details>"
        )
    return "".join(parts)


def config_html(cfg: dict | None) -> str:
    if not cfg:
        return '<p class="muted">No config.json.</p>'
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(json.dumps(v))}</td></tr>"
        for k, v in flat_config(cfg).items()
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
    trained = (trained & set(ev["metrics"])) - set(OUTCOMES)  # a game's own result is no judge
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
            f"<tr><th>{html.escape(m)}</th><td class='num'>{s['n']}</td><td class='num'>{fmt(s['mean_a'])}</td>"
            f"<td class='num'>{fmt(s['mean_b'])}</td><td class='num{' sig' if sig else ''}'>{s['diff']:+.3f}</td>"
            f"<td>[{s['low']:+.3f}, {s['high']:+.3f}]</td><td>{'' if not mc else fmt(mc['p'])}</td></tr>"
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
    base, trained = run_log(run_dir / "eval_base.jsonl"), run_log(run_dir / "eval_trained.jsonl")
    out = []
    for i, (b, t) in enumerate(zip(base, trained)):
        bs, ts = b.get("scores") or {}, t.get("scores") or {}
        diffs = [ts[m] - bs[m] for m in bs if num(bs[m]) is not None and num(ts.get(m)) is not None]
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
    x, y = num(b), num(t)
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
    return f'<td class="num pair"{style}>{fmt(x, 2)} &rarr; {fmt(y, 2)}</td>'


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


def run_json(path: Path) -> dict | None:
    """A run folder's JSON object file (config.json, eval.json), None when there is none; ValueError naming
    the file when it cannot be read or is not one JSON object (a write cut short, an edit gone wrong)."""
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(
            f"{path}: not a readable JSON file ({getattr(e, 'strerror', None) or e}); {_FIX}"
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: holds a JSON {type(obj).__name__}, not an object; {_FIX}")
    return obj


_FIX = "restore it, or move it out of the run folder, and run eval.py report again"


def run_log(path: Path) -> list[dict]:
    """A run folder's JSONL log as the trainer reads it (metrics.read_jsonl: a torn last line is dropped),
    each entry a JSON object whose step, if any, is a number; ValueError naming the file otherwise."""
    try:
        rows = read_jsonl(path)
    except ValueError as e:  # a damaged line names the file already; bytes that are not UTF-8 do not
        raise (e if str(path) in str(e) else ValueError(f"{path}: {e}; {_FIX}")) from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e}); {_FIX}") from None
    for i, r in enumerate(rows, 1):
        if not isinstance(r, dict) or ("step" in r and not _number(r["step"])):
            raise ValueError(
                f"{path}: entry {i} is not a log line nanogrpo writes (a JSON object with a numeric step): "
                f"{json.dumps(r)[:80]}; {_FIX}"
            )
    return rows


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def write_report(run_dir: str | Path, max_sample_steps: int = 60, out: str | Path | None = None) -> Path:
    """Write run_dir/index.html (or `out`) from the run's files and return its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(
            f"{run_dir} is not a run folder (expected config.json, metrics.jsonl, samples.jsonl)"
        )
    cfg, ev = run_json(run_dir / "config.json"), run_json(run_dir / "eval.json")
    metrics = run_log(run_dir / "metrics.jsonl")  # the trainer's reader: a torn last line is dropped
    samples = run_log(run_dir / "samples.jsonl")
    try:
        page = _page(run_dir, cfg, ev, metrics, samples, max_sample_steps)
    except (TypeError, AttributeError, KeyError) as e:  # an entry of a shape nanogrpo never logs
        raise ValueError(
            f"{run_dir}: metrics.jsonl or samples.jsonl holds an entry the page cannot draw "
            f"({type(e).__name__}: {e}); {_FIX}"
        ) from None
    out = Path(out) if out else run_dir / "index.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(out, page)  # a browser never sees half a page
    return out


def _page(
    run_dir: Path, cfg: dict | None, ev: dict | None, metrics: list, samples: list, max_sample_steps: int
) -> str:
    last = metrics[-1] if metrics else {}
    summary = " · ".join(
        f"{k} {last[k] if k == 'step' else fmt(last.get(k))}"
        for k in ("step", "reward", "kl", "entropy", "len_mean")
        if k in last
    )
    data = json.dumps({"metrics": metrics}).replace(
        "</", "<\\/"
    )  # the raw numbers, for anyone who wants them
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>nanogrpo · {html.escape(run_dir.name)}</title>"
        f"<style>{CSS}</style></head><body><header><h1>nanogrpo run · {html.escape(run_dir.name)}</h1>"
        f"<div class='muted'>{html.escape(summary)}</div></header>{eval_html(ev, cfg)}{heldout_html(heldout_rows(run_dir), ev)}"
        f"<section id='curves'><h2>Curves</h2>{curves_html(run_dir, metrics)}</section>"
        f"{rubric_html(run_dir, samples)}"
        f"<section id='samples'><h2>Samples</h2>{samples_html(samples, max_sample_steps)}</section>"
        f"<section id='config'><h2>Config</h2>{config_html(cfg)}</section>"
        f"<script type='application/json' id='run-data'>{data}</script><script>{JS}</script></body></html>"
    )
