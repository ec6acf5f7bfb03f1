"""The pieces every nanogrpo page shares (the run page, its rubric section, the overlay of runs): the
CSS and JS, number formats, shaded score cells and the embedded charts (PNGs drawn by infra/plots.py).
"""

from __future__ import annotations

import base64
import html
import math
from typing import Any

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header,section{max-width:1280px;margin:0 auto;padding:10px 20px}
h1{font-size:22px;margin:12px 0 4px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px}
.grid{display:flex;flex-wrap:wrap;gap:12px}
figure.chart{margin:0;background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:4px;width:380px}
figure.chart img{width:100%;display:block}figcaption{font-size:12px;color:#555;padding:2px 4px}
figcaption .key{margin-right:10px;white-space:nowrap}
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


def num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def fmt(x: Any, digits: int = 3) -> str:
    v = num(x)
    if v is None:
        return "-"
    return f"{v:.{digits}g}" if abs(v) >= 1e4 or (v != 0 and abs(v) < 1e-3) else f"{v:.{digits}f}"


def score_cell(x: Any) -> str:
    v = num(x)
    if v is None:
        return '<td class="num muted">-</td>'
    hue = 120 * min(1.0, max(0.0, v))  # red (0) to green (1): grader scores live in [0, 1]
    return f'<td class="num" style="background:hsl({hue:.0f},70%,88%)">{fmt(v)}</td>'


def verdict_text(v: Any) -> str:
    """A verdict as text: yes (1), no (0), '-' (none); a soft verdict (P(met)) as its number."""
    x = num(v)
    return "-" if x is None else "yes" if x == 1 else "no" if x == 0 else fmt(x, 2)


def figure_html(title: str, png: bytes, caption: list[str]) -> str:
    """A chart on the page: the PNG embedded (the page loads nothing) and under it a caption, each line's
    latest value (what a reader copies, and what a search of the page finds)."""
    keys = " ".join(f'<span class="key">{html.escape(c)}</span>' for c in caption)
    src = "data:image/png;base64," + base64.b64encode(png).decode()
    return (
        f'<figure class="chart" data-title="{html.escape(title)}"><img alt="{html.escape(title)}" src="{src}">'
        f"<figcaption>{keys}</figcaption></figure>"
    )


def latest(lines: list) -> list[str]:
    """'key: last value' of each line (its last value that is a number)."""
    return [f"{k}: last {fmt(next((y for y in reversed(ys) if y is not None), None))}" for k, _, ys in lines]
