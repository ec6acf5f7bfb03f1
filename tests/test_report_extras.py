"""The run page's judge marks per criterion, held-out answers per row, and the overlay of several runs;
drawn by headless chromium (skipped when it is missing) with the new elements measured in the layout and
the overlay's run colours found in a screenshot."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, chromium, make_fake_run, needs_chromium

from nanogrpo.eval import report
from nanogrpo.eval.overlay import overlay_lines, write_overlay
from nanogrpo.eval.report import write_report
from nanogrpo.infra import plots

JUDGE = {"marks": {"correctness": 4, "helpfulness": 2, "tone": 5, "format": 1},
         "reason": "right answer, <terse> & curt", "score": 0.5, "position": 2}  # fmt: skip


def with_judge(run: Path) -> Path:
    """The fake run's judge details rewritten as rewards/judge.py logs them (marks, reason, score)."""
    lines = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    for s in lines:
        for c in s["groups"][0]["completions"]:
            c["judge"] = JUDGE
    (run / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in lines))
    return run


def with_eval(run: Path) -> Path:
    """eval_base.jsonl / eval_trained.jsonl / eval.json as evaluate.save_eval writes them: 4 rows, one
    trained better, one worse, one the same answer, one a new answer with the same scores."""
    from nanogrpo.eval import evaluate

    rows = [{"id": f"h{i}", "prompt": f"held-out question {i}?", "reference": f"ref {i}"} for i in range(4)]
    base_text = ["base a", "base b", "same", "base d"]
    trained_text = ["trained a", "trained <b>", "same", "trained d"]
    base_scores = [
        {"em": 0.0, "f1": 0.2},
        {"em": 1.0, "f1": 0.9},
        {"em": 1.0, "f1": 1.0},
        {"em": 0.0, "f1": 0.5},
    ]
    trained_scores = [
        {"em": 1.0, "f1": 1.0},
        {"em": 0.0, "f1": 0.4},
        {"em": 1.0, "f1": 1.0},
        {"em": 0.0, "f1": 0.5},
    ]
    summary = evaluate.paired_summary(base_scores, trained_scores, seed=0, n_resamples=200)
    res = {"base": base_text, "trained": trained_text, "base_scores": base_scores,
           "trained_scores": trained_scores, "summary": summary}  # fmt: skip
    evaluate.save_eval(run, rows, res)
    return run


def _between(page: str, start: str, end: str) -> str:
    part = page[page.index(start) :]
    return part[: part.index(end)]


def test_judge_marks_per_criterion(tmp_path):
    page = write_report(with_judge(make_fake_run(tmp_path))).read_text()
    table = _between(page, '<table class="judge-marks">', "</table>")
    for crit, mark in JUDGE["marks"].items():
        assert f"<th>{crit}</th>" in table and f">{mark}</td>" in table
    assert table.count('<tr class="criterion">') == 4
    assert "right answer, &lt;terse&gt; &amp; curt" in table and "<terse>" not in page
    assert ">0.50</td>" in table  # the judge's score
    # one marks table per judged completion: group 0 of each of the 3 logged steps, 4 completions each
    assert page.count('<table class="judge-marks">') == 12
    # a flat {criterion: mark, reason} still reads, and a bare marks dict needs no reason
    marks, reason, score = report.judge_marks({"correctness": 4, "tone": 3, "reason": "ok"})
    assert marks == {"correctness": 4, "tone": 3} and reason == "ok" and score is None
    assert "judge-marks" in report._judge_cell({"marks": {"tone": 3}}) and "-" in report._judge_cell(None)


def test_heldout_table_from_eval_files(tmp_path):
    run = with_eval(make_fake_run(tmp_path))
    rows = report.heldout_rows(run)
    assert [r["change"] for r in rows] == ["better", "worse", "same score", "same answer"]
    assert [r["id"] for r in rows] == ["h0", "h1", "h3", "h2"]  # changed first, largest |delta| first
    page = write_report(run).read_text()
    section = _between(page, "<section id='heldout'>", "</section>")
    assert section.count("<tr class='heldout-row'") == 4
    for i in range(4):
        assert f"held-out question {i}?" in section and f"ref {i}" in section
    assert "trained a" in section and "base a" in section and "trained &lt;b&gt;" in section
    assert "0.00 &rarr; 1.00" in section and "hsl(120,70%,88%)" in section and "hsl(0,70%,90%)" in section
    assert "1 trained better, 1 trained worse" in section and "id='heldout-filter'" in section
    assert section.index("data-id='h0'") < section.index("data-id='h2'")
    assert "<section id='eval'>" in page  # the summary table stays
    (run / "eval_trained.jsonl").unlink()
    assert "id='heldout'" not in write_report(run).read_text()  # no pair of files: no section


def two_runs(tmp_path: Path) -> list[Path]:
    a = with_eval(make_fake_run(tmp_path / "a"))
    (tmp_path / "b").mkdir()
    b = make_fake_run(tmp_path / "b")  # the same folder name: told apart by the parent
    lines = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()[:-1]]
    for m in lines[:8]:
        m["reward"] = 0.9 - 0.02 * m["step"]
        m["only_b"] = 1.0
    (b / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines[:8]))
    return [a, b]


def test_overlay_page_has_both_runs(tmp_path):
    (tmp_path / "a").mkdir()
    runs = two_runs(tmp_path)
    page = write_overlay(runs, tmp_path / "out" / "both.html").read_text()
    for needle in ("http://", "https://", "@import", "url("):
        assert needle not in page
    assert "a/fake-run" in page and "b/fake-run" in page
    srcs = page.split(" src=")[1:]  # the charts are PNGs inside the page
    assert srcs and all(x.startswith('"data:image/png;base64,') for x in srcs)
    chart = _between(page, 'data-title="reward"', "</figure>")
    assert "a/fake-run: last 0.560" in chart and "b/fake-run: last 0.740" in chart
    names = ["a/fake-run", "b/fake-run"]
    lines = overlay_lines(names, [[json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()
                                   if x.endswith("}")] for r in runs])  # fmt: skip
    assert [(n, len(xs)) for n, xs, _ in lines["reward"]] == [("a/fake-run", 12), ("b/fake-run", 8)]
    assert [n for n, _, _ in lines["only_b"]] == ["b/fake-run"]
    assert "b/fake-run: last 1.000" in _between(page, 'data-title="only_b"', "</figure>")
    kl = dict((n, ys) for n, _, ys in lines["kl"])["a/fake-run"]  # a gap in run a's KL at step 5
    assert kl[4] is None and sum(y is not None for y in kl) == 11
    # each run keeps its colour on every chart, also where only run b logs the key
    colors = [plots.COLORS[names.index(n)] for n, _, _ in lines["only_b"]]
    ax = plots.line_figure("only_b", lines["only_b"], colors, legend=True).axes[0]
    assert [ln.get_color() for ln in ax.get_lines()] == [plots.COLORS[1]]
    data = json.loads(
        _between(page, "id='run-data'>", "</script>")[len("id='run-data'>") :].replace("<\\/", "</")
    )
    assert (
        list(data["runs"]) == ["a/fake-run", "b/fake-run"] and len(data["runs"]["b/fake-run"]["metrics"]) == 8
    )
    assert "held-out em" in page  # run a's eval.json differences; run b has none


def test_report_cli_overlay(tmp_path):
    (tmp_path / "a").mkdir()
    runs = two_runs(tmp_path)
    out = tmp_path / "both.html"
    cmd = [sys.executable, str(ROOT / "eval.py"), "report", *map(str, runs)]
    res = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out) and "b/fake-run" in out.read_text()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "--out FILE.html" in res.stderr


MEASURE = """<script>window.addEventListener('load',()=>{document.querySelectorAll('details').forEach(d=>d.open=true);
const out={};for(const sel of SELECTORS){out[sel]=[...document.querySelectorAll(sel)].map(e=>{const r=e.getBoundingClientRect();
return [Math.round(r.width),Math.round(r.height)]})}
const p=document.createElement('pre');p.id='measured';p.textContent=JSON.stringify(out);document.body.appendChild(p)})</script>"""


def measure(page: Path, selectors: list[str], tmp: Path) -> dict:
    """Each selector's elements' laid-out (width, height) in chromium, from a copy of the page with a
    measuring script (the page itself stays as written)."""
    probe = tmp / f"probe-{page.name}"
    script = MEASURE.replace("SELECTORS", json.dumps(selectors))
    probe.write_text(page.read_text().replace("</body>", script + "</body>"))
    res = chromium("--dump-dom", probe.as_uri(), tmp=tmp)
    assert res.returncode == 0 and 'id="measured"' in res.stdout, res.stderr[-2000:]
    text = res.stdout.split('id="measured">')[1].split("</pre>")[0]
    return json.loads(text.replace("&quot;", '"').replace("&amp;", "&"))


@needs_chromium
def test_new_elements_are_drawn_in_chromium(tmp_path):
    (tmp_path / "a").mkdir()
    runs = two_runs(tmp_path)
    with_judge(runs[0])
    page = write_report(runs[0], max_sample_steps=10_000)
    sel = [
        "table.judge-marks",
        "td.mark",
        "table.heldout",
        "tr.heldout-row",
        "#heldout-filter",
        "figure.chart img",
    ]
    sizes = measure(page, sel, tmp_path)
    assert len(sizes["table.judge-marks"]) == 12 and len(sizes["td.mark"]) == 48
    assert len(sizes["tr.heldout-row"]) == 4 and len(sizes["figure.chart img"]) >= 10
    for s in sel:
        assert sizes[s] and all(w > 5 and h > 5 for w, h in sizes[s]), (s, sizes[s])
    assert sizes["table.heldout"][0][0] > 600  # prompt, reference, both answers and the scores side by side

    overlay = write_overlay(runs, tmp_path / "both.html")
    sizes = measure(overlay, ["ul.legend li", "figure.chart img"], tmp_path)
    assert len(sizes["ul.legend li"]) == 2 and len(sizes["figure.chart img"]) >= 10
    assert all(w > 20 for w, _ in sizes["ul.legend li"])
    shot = tmp_path / "overlay.png"
    res = chromium(f"--screenshot={shot}", "--window-size=1280,1000", overlay.as_uri(), tmp=tmp_path)
    assert shot.exists(), res.stderr[-2000:]
    import matplotlib.image

    img = (matplotlib.image.imread(shot)[..., :3] * 255).astype(int)
    for color in plots.COLORS[:2]:  # each run's colour is drawn (its lines, its legend swatch)
        rgb = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)])
        near = (np.abs(img - rgb).sum(-1) < 30).sum()
        assert near > 200, f"run colour {color} not drawn ({near} pixels)"


def test_overlay_rejects_a_missing_run(tmp_path):
    with pytest.raises(ValueError, match="not a run folder"):
        write_overlay([make_fake_run(tmp_path), tmp_path / "absent"], tmp_path / "x.html")
