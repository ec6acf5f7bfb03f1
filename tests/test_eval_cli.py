"""eval.py end to end through subprocesses (score, compare, grade, elo, generate), and the pairwise
judging protocol in process (position bias cancels, an OpenAI-compatible judge over real HTTP)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
from helpers import FakeServer, chat_body, closed_url, run_eval, write_rows

from nanogrpo.eval import evaluate, generation, pairwise, stats

ROOT = Path(__file__).resolve().parents[1]


def test_score_cli(tmp_path):
    rows = [
        {"id": "a", "prompt": "Capital of France?", "reference": "Paris", "completion": "The Paris."},
        {"id": "b", "prompt": "2+2?", "reference": "four", "completion": "It is four"},
        {"id": "c", "prompt": "Colour?", "reference": "red", "completion": "blue"},
    ]
    f = write_rows(tmp_path / "gen.jsonl", rows)
    res = run_eval("score", f, "--json", tmp_path / "summary.json", "--resamples", 500, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    scored = [json.loads(line) for line in (tmp_path / "gen.scored.jsonl").read_text().splitlines()]
    assert [r["id"] for r in scored] == ["a", "b", "c"]
    s = {r["id"]: r["scores"] for r in scored}
    assert s["a"]["em"] == 1.0 and s["a"]["f1"] == 1.0  # articles, case and punctuation normalised away
    assert s["b"]["em"] == 0.0 and s["b"]["f1"] == pytest.approx(2 * (1 / 3) / (1 / 3 + 1))
    assert s["c"]["f1"] == 0.0 and s["c"]["seqm"] == pytest.approx(stats.seq_match("blue", "red"))
    assert 0.0 <= s["b"]["rouge_l"] <= 1.0 and s["a"]["rouge_l"] > s["c"]["rouge_l"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["metrics"]["em"]["n"] == 3
    assert summary["metrics"]["em"]["mean"] == pytest.approx(1 / 3)
    assert summary["metrics"]["rouge_l"]["n"] == 3
    m = summary["metrics"]["f1"]
    assert m["low"] <= m["mean"] <= m["high"]
    assert "95% CI" in res.stdout and "rouge_l" in res.stdout


def test_rows_without_reference(tmp_path):
    """EM/F1/SeqM do not apply (None, not 0) to a row without a reference; a grader that needs the
    reference refuses the file at start-up, naming the line."""
    rows = [
        {"id": "a", "prompt": "q", "reference": "cat", "completion": "a cat"},
        {"id": "b", "prompt": "q", "completion": "whatever"},
    ]
    scores = evaluate.score_rows(rows, graders="")
    assert scores[0]["em"] == 1.0 and scores[1] == {"em": None, "f1": None, "seqm": None}
    assert evaluate.summarise(scores, n_resamples=100)["em"]["n"] == 1
    with pytest.raises(ValueError, match=r"gen.jsonl:2: field 'reference'"):
        evaluate.score_rows(rows, graders="rouge_l", path="gen.jsonl")


def test_score_names_file_and_line_of_bad_rows(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(
        json.dumps({"prompt": "q", "reference": "r", "completion": "c"}) + "\n" + json.dumps({"prompt": "q"})
    )
    res = run_eval("score", f, cwd=tmp_path)
    assert res.returncode != 0
    assert f"{f}:2" in res.stderr and "completion" in res.stderr and "Traceback" not in res.stderr


def test_compare_cli_json(tmp_path):
    rng = np.random.default_rng(0)
    words = ["paris", "rome", "oslo", "lima", "bern"]
    a_rows, b_rows = [], []
    for i in range(80):
        ref = words[i % 5]
        row = {"id": f"q{i}", "prompt": f"question {i}", "reference": ref}
        a_rows.append({**row, "completion": ref if rng.random() < 0.4 else "madrid"})
        b_rows.append({**row, "completion": f"the {ref}" if rng.random() < 0.7 else "madrid"})
    b_rows = b_rows[::-1] + [
        {"id": "extra", "prompt": "x", "reference": "y", "completion": "y"}
    ]  # pair by id
    fa, fb = write_rows(tmp_path / "base.jsonl", a_rows), write_rows(tmp_path / "trained.jsonl", b_rows)
    res = run_eval("compare", fa, fb, "--json", "-", "--graders", "", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["n"] == 80 and out["resamples"] == 10_000
    b_by_id = {r["id"]: r for r in b_rows}
    em_a = [stats.exact_match(r["completion"], r["reference"]) for r in a_rows]
    em_b = [stats.exact_match(b_by_id[r["id"]]["completion"], r["reference"]) for r in a_rows]
    em = out["metrics"]["em"]
    assert em["diff"] == pytest.approx(np.mean(em_b) - np.mean(em_a))
    assert em["low"] < em["diff"] < em["high"]
    only_a = sum(x > y for x, y in zip(em_a, em_b))
    only_b = sum(y > x for x, y in zip(em_a, em_b))
    assert (em["mcnemar"]["only_a"], em["mcnemar"]["only_b"]) == (only_a, only_b)
    assert em["mcnemar"]["p"] == pytest.approx(scipy.stats.binomtest(only_a, only_a + only_b).pvalue)
    assert set(out["metrics"]) == {"em", "f1", "seqm"}
    # the table form, and the same numbers for the same seed
    res2 = run_eval("compare", fa, fb, "--graders", "", cwd=tmp_path)
    assert (
        "McNemar" in res2.stdout
        and "80 paired ids" in res2.stdout
        and "1 ids in only one file" in res2.stdout
    )
    em_line = next(line for line in res2.stdout.splitlines() if line.startswith("em "))
    assert f"{em['diff']:+.3f}" in em_line and f"[{em['low']:+.3f}, {em['high']:+.3f}]" in em_line


def _systems(tmp_path, n=30):
    """Three systems of clearly different quality on the same ids."""
    rng = np.random.default_rng(1)
    files = {}
    for name, p_right in (("good", 0.9), ("fair", 0.5), ("poor", 0.1)):
        rows = []
        for i in range(n):
            ref = f"answer number {i}"
            text = ref if rng.random() < p_right else f"something else {rng.integers(1000)}"
            rows.append({"id": i, "prompt": f"q{i}", "reference": ref, "completion": text})
        files[name] = write_rows(tmp_path / f"{name}.jsonl", rows)
    return files


def test_elo_cli_with_deterministic_judges(tmp_path):
    files = _systems(tmp_path)
    res = run_eval(
        "elo", files["poor"], files["good"], files["fair"], "--judges", "f1", "grader:rouge_l",
        "--out", tmp_path / "elo", "--resamples", 200, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rep = json.loads((tmp_path / "elo.json").read_text())
    assert set(rep["judges"]) == {"f1", "grader:rouge_l"}
    for table in [rep["pooled"], *rep["judges"].values()]:
        assert table["good"]["elo"] > table["fair"]["elo"] > table["poor"]["elo"]
        assert table["good"]["low"] > table["poor"]["high"]
    recs = [json.loads(x) for x in (tmp_path / "elo_comparisons.jsonl").read_text().splitlines()]
    assert len(recs) == 30 * 3 * 2 * 2  # ids x pairs x both orders x judges
    shown = {(r["id"], r["judge"], r["first"], r["second"]) for r in recs}
    assert all((i, j, b, a) in shown for i, j, a, b in shown)  # every question asked in both orders
    assert (tmp_path / "elo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = res.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[1:4]] == ["good", "fair", "poor"]  # sorted by pooled Elo


def test_position_bias_cancels():
    """A judge that always prefers the first answer shown rates every system the same."""
    systems = {n: [{"id": i, "prompt": "q", "reference": "r", "completion": f"{n} {i}"} for i in range(10)]
               for n in ("x", "y", "z")}  # fmt: skip
    recs = pairwise.run_pairwise(systems, {"first": lambda p, r, a, b: "A"}, progress=False)
    rep = pairwise.elo_report(recs, list(systems), n_resamples=50)
    np.testing.assert_allclose([rep["pooled"][n]["elo"] for n in systems], 1500.0, atol=1e-6)


class _FakeJudgeServer(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint whose 'model' prefers the answer containing 'good', else the first."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = body["messages"][-1]["content"]
        a = content.split("Answer A:\n")[1].split("\n\nAnswer B:")[0]
        b = content.split("Answer B:\n")[1].split("\n\nWhich answer")[0]
        verdict = "tie" if ("good" in a) == ("good" in b) else ("A" if "good" in a else "B")
        reply = {"choices": [{"message": {"role": "assistant", "content": f"Reasoning.\nVerdict: {verdict}"}}],
                 "usage": {"prompt_tokens": 10, "completion_tokens": 3}}  # fmt: skip
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_openai_judge_over_http():
    from rewards.options import JudgeConfig

    server = HTTPServer(("127.0.0.1", 0), _FakeJudgeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = JudgeConfig(base_url=f"http://127.0.0.1:{server.server_port}/v1", max_retries=0, timeout_s=10)
        judge = pairwise.make_judge("openai:fake-model", cfg)
        systems = {
            "good": [{"id": i, "prompt": "q", "reference": "r", "completion": f"good {i}"} for i in range(6)],
            "bad": [{"id": i, "prompt": "q", "reference": "r", "completion": f"bad {i}"} for i in range(6)],
        }
        recs = pairwise.run_pairwise(systems, {"llm": judge}, progress=False)
    finally:
        server.shutdown()
    assert len(recs) == 12 and all(r["reply"].endswith(r["verdict"]) for r in recs)
    assert all((r["verdict"] == "A") == (r["first"] == "good") for r in recs)  # anonymous, both orders
    rep = pairwise.elo_report(recs, ["good", "bad"], n_resamples=50)
    assert rep["pooled"]["good"]["elo"] > rep["pooled"]["bad"]["elo"] + 200


@pytest.mark.parametrize(
    "reply, verdict",
    [("Verdict: A", "A"), ("...\nverdict: b", "B"), ("**Verdict:** tie", "tie"), ("A is better", None),
     ("Verdict: B\nOn reflection, Verdict: A", "A")],
)  # fmt: skip
def test_parse_verdict(reply, verdict):
    assert pairwise.parse_verdict(reply) == verdict


def test_grade_cli_with_human_column(tmp_path):
    rows = []
    for g, ref in enumerate(["the cat sat on the mat", "green light means go"]):
        for k, (text, human) in enumerate(
            [(ref, 1.0), (ref.split()[0] + " " + ref.split()[-1], 0.6), ("nothing", 0.0)]
        ):
            rows.append(
                {"id": f"{g}-{k}", "prompt": f"p{g}", "reference": ref, "completion": text, "human": human}
            )
    f = write_rows(tmp_path / "graded.jsonl", rows)
    res = run_eval(
        "grade", "--grader", "rouge_l", "--data", f, "--json", tmp_path / "agree.json", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    out = [json.loads(line) for line in res.stdout.splitlines()]
    assert [o["id"] for o in out] == [r["id"] for r in rows]
    assert all(set(o) == {"id", "score", "components"} and "rouge_l" in o["components"] for o in out)
    agree = json.loads((tmp_path / "agree.json").read_text())
    ref_tau = scipy.stats.kendalltau([o["score"] for o in out], [r["human"] for r in rows]).statistic
    assert agree["kendall_tau"] == pytest.approx(ref_tau)
    assert agree["pairs"] == 6 and agree["pairwise_accuracy"] == 1.0  # 3 pairs in each of 2 prompt groups
    assert "Kendall tau" in res.stderr


@pytest.mark.slow
def test_generate_cli_tiny_model(tmp_path):
    """Greedy generation through the CLI equals in-process generation one prompt at a time (batching,
    length sorting and reordering change nothing), with and without a LoRA adapter."""
    import torch
    from transformers import AutoTokenizer

    from nanogrpo.model import lora
    from nanogrpo.model.transformer import Transformer
    from nanogrpo.model.zoo import resolve_model

    rows = [
        {"id": "a", "prompt": "What is the capital of France?", "reference": "Paris"},
        {"id": "b", "prompt": [{"role": "user", "content": "Name a colour, please, any colour you like."}]},
        {"id": "c", "prompt": "Two plus two?", "reference": "four", "answer": "4"},
    ]
    data = write_rows(tmp_path / "held.jsonl", rows)
    path = resolve_model("tiny")
    tok = AutoTokenizer.from_pretrained(path)
    model = Transformer.from_pretrained(path, dtype=torch.float32, device="cpu")
    torch.manual_seed(0)
    lora.inject_lora(model, r=4, alpha=8.0, targets=("q_proj", "v_proj"))
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_B.weight.normal_(0, 0.5)  # a non-trivial adapter
    lora.save_adapter(model, tmp_path / "adapter")
    kw = dict(batch_size=1, max_new_tokens=6, temperature=0.0, progress=False, system_prompt="")
    want_lora = [c[0] for c in generation.generate_completions(model, tok, rows, **kw)]
    with lora.disabled(model):
        want_base = [c[0] for c in generation.generate_completions(model, tok, rows, **kw)]

    for adapter, want in (("", want_base), (tmp_path / "adapter", want_lora)):
        out = tmp_path / f"gen{bool(adapter)}.jsonl"
        args = ["generate", "--model", "tiny", "--data", data, "--out", out, "--max-new-tokens", 6,
                "--batch-size", 2, "--dtype", "float32", "--device", "cpu"]  # fmt: skip
        res = run_eval(*args, *(["--adapter", adapter] if adapter else []), cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        got = [json.loads(line) for line in out.read_text().splitlines()]
        assert [g["completion"] for g in got] == want
        assert [
            {k: v for k, v in g.items() if k != "completion"} for g in got
        ] == rows  # fields kept, no extras


def test_openai_elo_judge_sends_a_valid_max_tokens():
    """The pairwise judge asks for a reply of a few sentences: max_tokens >= 1, which servers require."""
    from rewards.options import JudgeConfig

    def script(payload, n):  # refuses max_tokens < 1 with a 400, as vLLM and OpenAI do
        if payload.get("max_tokens", 1) < 1:
            return 400, {}, {"error": {"message": "max_tokens must be at least 1"}}, 0
        return 200, {}, chat_body("A is closer to the reference.\nVerdict: A"), 0

    srv = FakeServer(script)
    try:
        judge = pairwise.make_judge("openai:fake-model", JudgeConfig(base_url=srv.url, max_retries=0))
        systems = {n: [{"id": 0, "prompt": "q", "reference": "r", "completion": n}] for n in ("x", "y")}
        recs = pairwise.run_pairwise(systems, {"llm": judge}, progress=False)
    finally:
        srv.close()
    assert [r["verdict"] for r in recs] == ["A", "A"]
    assert all(1 <= r["payload"]["max_tokens"] <= 1024 for r in srv.requests)


def test_elo_cli_stops_at_once_when_no_judge_server_answers(tmp_path):
    url = closed_url()
    files = _systems(tmp_path, n=3)
    res = run_eval("elo", files["poor"], files["good"], "--judges", "openai:m", "--server.base-url", url,
                   "--server.max-retries", 0, cwd=tmp_path)  # fmt: skip
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no OpenAI-compatible server answered at " + url), last
    assert "--server.base-url" in last
    assert not (tmp_path / "elo_comparisons.jsonl").exists()


def test_score_cli_stops_at_once_when_no_judge_server_answers(tmp_path):
    url = closed_url()
    f = write_rows(tmp_path / "gen.jsonl", [{"id": "a", "prompt": "q", "reference": "r", "completion": "c"}])
    res = run_eval("score", f, "--graders", "judge", "--reward.judge.base-url", url,
                   "--reward.judge.model", "m", cwd=tmp_path)  # fmt: skip
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode != 0 and last.startswith(f"error: no OpenAI-compatible server answered at {url} ")
    assert "--reward.judge.base-url" in last and not (tmp_path / "gen.scored.jsonl").exists()
