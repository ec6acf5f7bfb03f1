"""The run page: rendered by a real headless browser (Debian's chromium, installed by .ci/run), with the
DOM's groups, completions and curves counted against what the run folder holds, and a screenshot that
is not blank. The browser tests run over every entry of RUNS (a factory that returns a run folder);
NANOGRPO_REPORT_RUN=path adds an existing run folder."""

import json
import math
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, chromium, make_fake_run, needs_chromium

from nanogrpo.eval.report import write_report
from nanogrpo.infra import plots

RUNS = {"fake": make_fake_run}
if os.environ.get("NANOGRPO_REPORT_RUN"):
    RUNS["env"] = lambda root: Path(os.environ["NANOGRPO_REPORT_RUN"])


@pytest.fixture(params=list(RUNS))
def run_dir(request, tmp_path):
    return RUNS[request.param](tmp_path)


def _jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def expected(run: Path) -> dict:
    """What the page must show, read from the run's files independently of nanogrpo.eval.report."""
    metrics, samples = _jsonl(run / "metrics.jsonl"), _jsonl(run / "samples.jsonl")
    series = {}
    for m in metrics:
        for k, v in m.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                series[k] = series.get(k, 0) + 1  # points of each curve
    return {
        "steps": len(samples),
        "groups": sum(len(s["groups"]) for s in samples),
        "completions": sum(len(g["completions"]) for s in samples for g in s["groups"]),
        "series": series,
    }


class DomCounter(HTMLParser):
    """Counts elements by tag.class and collects each chart's caption entries ('key: last value')."""

    def __init__(self):
        super().__init__()
        self.counts, self.stack, self.keys = {}, [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for cls in (a.get("class") or "").split() or [""]:
            key = f"{tag}.{cls}" if cls else tag
            self.counts[key] = self.counts.get(key, 0) + 1
        self.stack.append((tag, a.get("class")))

    def handle_endtag(self, tag):
        if self.stack and self.stack[-1][0] == tag:
            self.stack.pop()

    def handle_data(self, data):
        if self.stack and self.stack[-1] == ("span", "key"):
            self.keys.append(data)


@needs_chromium
def test_page_renders_in_chromium(run_dir, tmp_path):
    page = write_report(run_dir, max_sample_steps=10_000)
    want = expected(run_dir)
    res = chromium("--dump-dom", page.as_uri(), tmp=tmp_path)
    assert res.returncode == 0 and "</html>" in res.stdout, res.stderr[-2000:]
    dom = DomCounter()
    dom.feed(res.stdout)
    c = dom.counts
    assert c.get("details.step", 0) == want["steps"]
    assert c.get("div.group", 0) == want["groups"] > 0
    assert c.get("tr.completion", 0) == want["completions"]
    # every numeric metric is drawn in exactly one chart (its caption names it); the points of each line
    # are checked in test_every_metric_is_one_line_with_a_point_per_value
    keys = [k.split(": last")[0] for k in dom.keys if ": last" in k]
    assert sorted(keys) == sorted(want["series"])
    assert c.get("figure.chart", 0) >= 4 and c.get("img", 0) == c["figure.chart"]  # reward, KL, length, ...
    assert c.get("script", 0) == 2  # the data and the page's own script: completions stay text
    assert c.get("table.config", 0) == 1
    for name in ("reward", "KL and entropy", "length", "score-length correlation in groups"):
        assert f'data-title="{name}"' in res.stdout
    assert 'data-title="reward vs completion length"' in res.stdout
    assert f"{want['completions']} completions, coloured by step" in res.stdout

    shot = tmp_path / "page.png"
    res = chromium(f"--screenshot={shot}", "--window-size=1280,1600", page.as_uri(), tmp=tmp_path)
    assert shot.exists(), res.stderr[-2000:]
    import matplotlib.image

    img = matplotlib.image.imread(shot)[..., :3]  # (H, W, 3) in [0, 1]
    assert img.shape[:2] == (1600, 1280)
    background = np.median(img.reshape(-1, 3), axis=0)
    ink = np.abs(img - background).sum(-1) > 0.1  # pixels that differ from the page background
    assert ink.mean() > 0.02, f"screenshot looks blank ({ink.mean():.4f} of the pixels drawn)"
    colours = len(np.unique((img.reshape(-1, 3) * 255).astype(np.uint8), axis=0))
    assert colours > 20  # curves in several colours, text, tinted score cells


def test_page_is_self_contained_and_escaped(tmp_path):
    page = write_report(make_fake_run(tmp_path)).read_text()
    for needle in ("http://", "https://", "@import", "url("):
        assert needle not in page, f"the page must load nothing ({needle!r} found)"
    srcs = page.split(" src=")[1:]  # the charts are PNGs inside the page, not files beside it
    assert srcs and all(s.startswith('"data:image/png;base64,') for s in srcs)
    assert "<script>alert(" not in page and "&lt;script&gt;alert(" in page
    assert "<b>not bold</b>" not in page
    assert (
        "close to the reference" in page and '<th>correctness</th><td class="num mark"' in page
    )  # judge marks, reason


def test_reward_length_scatter_and_hacking_curves(tmp_path):
    """One point per logged completion with a reward and a length, coloured from the first logged step to
    the last; each hack/len_corr/<grader> is one line of one panel; the PNGs are in the run folder."""
    run = make_fake_run(tmp_path)
    with (run / "samples.jsonl").open("a") as f:  # no reward, no length: no point
        f.write(json.dumps({"step": 12, "groups": [{"completions": [{"text": "x", "reward": None, "length": 3},
                                                                    {"text": "y", "reward": 0.5}]}]}) + "\n")  # fmt: skip
    page = write_report(run).read_text()
    samples = _jsonl(run / "samples.jsonl")
    n = sum(
        c.get("reward") is not None and "length" in c
        for s in samples
        for g in s["groups"]
        for c in g["completions"]
    )
    points = plots.length_points(samples)
    assert len(points) == n == 12 + 8 + 12  # 3, 2 and 3 groups of 4
    dots = plots.length_figure(points).axes[0].collections[0]
    assert len(dots.get_offsets()) == n and (dots.get_array().min(), dots.get_array().max()) == (1, 11)
    assert f"{n} completions, coloured by step" in page
    for png in ("reward", "kl_entropy", "length", "len_corr", "reward_vs_length"):
        assert (run / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    panel = page[page.index('data-title="score-length correlation in groups"') :]
    panel = panel[: panel.index("</figure>")]
    assert panel.count('<span class="key">') == 2 and "hack/len_corr/reward: last 0.480" in panel
    assert [k for k, _, _ in plots.metric_lines(_jsonl(run / "metrics.jsonl"))["len_corr"]] == [
        "hack/len_corr/reward", "hack/len_corr/rouge_l"]  # fmt: skip
    assert plots.length_figure([]).axes[0].collections[0].get_offsets().shape[0] == 0  # no points, no error


def test_every_metric_is_one_line_with_a_point_per_value(tmp_path):
    """Each numeric key of metrics.jsonl is one line of one panel, a point per finite value (a null is a
    gap), in the panels of nanogrpo.infra.metrics.METRICS; the figure draws those lines."""
    run = make_fake_run(tmp_path)
    want = expected(run)["series"]
    lines = plots.metric_lines(_jsonl(run / "metrics.jsonl"))
    got = {k: sum(y is not None for y in ys) for ls in lines.values() for k, _, ys in ls}
    assert got == want
    assert [k for k, _, _ in lines["reward"]] == ["reward", "reward/exact", "reward/rouge_l", "reward_std"]
    assert {k for k, _, _ in lines["other"]} == {"ratio_max", "lr", "tok_per_s"}  # no row of the table
    ax = plots.line_figure("reward", lines["reward"]).axes[0]
    assert [ln.get_label() for ln in ax.get_lines()] == ["reward", "reward/exact", "reward/rouge_l"]
    assert len(ax.collections) == 1  # reward_std: the band around the reward, not a line
    kl = dict((k, ys) for k, _, ys in lines["kl_entropy"])["kl"]
    assert kl[4] is None and len(kl) == 12  # step 5's null stays a gap


def test_page_of_an_empty_or_missing_run(tmp_path):
    (tmp_path / "empty").mkdir()
    page = write_report(tmp_path / "empty").read_text()
    assert "No metrics yet" in page and "No samples logged" in page
    with pytest.raises(ValueError, match="not a run folder"):
        write_report(tmp_path / "absent")


def test_page_reads_the_logs_as_the_trainer_does(tmp_path):
    """The logs are JSON lines split on newlines only: a completion holding U+2028 or NEL (written raw, as
    ensure_ascii=False writes them) keeps its step; a damaged line before the last names the file and line."""
    run = make_fake_run(tmp_path)
    step = {"step": 12, "groups": [{"id": "odd", "prompt": "p", "completions": [{"text": "a\u2028b\x85c"}]}]}
    with (run / "samples.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(step, ensure_ascii=False) + "\n")
    assert 'data-step="12"' in write_report(run).read_text(encoding="utf-8")
    lines = (run / "metrics.jsonl").read_text().split("\n")
    (run / "metrics.jsonl").write_text("\n".join(lines[:3] + ['{"step": 4, "lo'] + lines[4:]))
    with pytest.raises(ValueError, match=r"metrics\.jsonl, line 4"):
        write_report(run)


def test_page_keeps_first_and_latest_steps(tmp_path):
    run = make_fake_run(tmp_path)
    page = write_report(run, max_sample_steps=2).read_text()
    assert page.count('<details class="step"') == 2
    assert 'data-step="1"' in page and 'data-step="11"' in page and 'data-step="6"' not in page


def test_eval_section_from_eval_json(tmp_path):
    from nanogrpo.eval import evaluate

    run = make_fake_run(tmp_path)
    base = [{"em": 0.0, "f1": 0.2}] * 5 + [{"em": 1.0, "f1": 1.0}] * 5
    trained = [{"em": 1.0, "f1": 0.9}] * 8 + [{"em": 0.0, "f1": 0.1}] * 2
    summary = evaluate.paired_summary(base, trained, seed=0, n_resamples=500)
    (run / "eval.json").write_text(json.dumps({"n": 10, "metrics": summary}))
    page = write_report(run).read_text()
    assert "base vs trained" in page and f"{summary['em']['diff']:+.3f}" in page


def test_report_cli(tmp_path):
    run = make_fake_run(tmp_path)
    res = subprocess.run([sys.executable, str(ROOT / "eval.py"), "report", str(run)], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(run / "index.html") and (run / "index.html").stat().st_size > 1000
