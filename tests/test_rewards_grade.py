"""`python -m rewards.grade` (the logic of `eval.py grade`) from the command line, for every grader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rewards.grade import GradeArgs, group_keys, main, percentile_ranks, run, score_rows

ROOT = Path(__file__).resolve().parents[1]
SHARE = "Open the report, click Share and pick the client."
WACC = "WACC ≈ 9.91%; cost of equity 10.34%; after-tax debt 4.15%; EV ≈ $1,705M."
KP = [["warfarin", "vitamin K", "INR"]]
KREF = "Stop warfarin, give vitamin K, check the INR."


def write(path: Path, rows: list, raw_lines: list[str] | None = None) -> Path:
    lines = [json.dumps(r, ensure_ascii=False) for r in rows] + (raw_lines or [])
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def grade_cli(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rewards.grade", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def rows_out(res) -> list[dict]:
    return [json.loads(line) for line in res.stdout.splitlines()]


# grader -> (rows as (completion, extra fields), expected scores: a float to 2 decimals, None = null, ANY = in [0, 1])
ANY = "any"
CASES = {
    "exact": ([("<answer>B</answer>", {"answer": "B"}), ("<answer>C</answer>", {"answer": "B"})], [1.0, 0.0]),
    "contains": ([("It is Paris.", {"answer": "paris"}), ("Rome", {"answer": "Paris"})], [1.0, 0.0]),
    "label": ([("<answer>yes</answer>", {"labels": ["yes", "no"]}), ("perhaps", {"labels": ["yes", "no"]})], [1.0, 0.0]),
    "json": ([('{"a": 1}', {}), ("{a: 1}", {})], [1.0, 0.0]),
    "format": ([("<think>x</think><answer>B</answer>", {}), ("<answer>B</answer>", {})], [1.0, 0.0]),
    "think": ([("<think>x</think>B", {}), ("B", {})], [1.0, 0.0]),
    "rouge_l": (
        [
            ("Click Share on the report and pick the client.", {"reference": SHARE}),
            ("Use the Share button in your report to send it to them.", {"reference": SHARE}),
            ("Open the report, click Share and pick the admin.", {"reference": SHARE}),
        ],
        [0.67, 0.19, 0.89],
    ),
    "numbers": (
        [
            ("WACC 9.95%, equity 10.3%, debt 4.2%, EV 1,700M", {"reference": WACC}),
            ("WACC is 1.33%", {"reference": WACC}),
            ("Fine.", {"reference": "It depends on the market."}),
        ],
        [0.875, 0.0, None],
    ),
    "consistency": ([("a b c d", {}), ("go go go go go", {})], [1.0, 0.33]),
    "concepts": ([("Give heparin.", {"reference": "Heparin now."}), ("Give warfarin.", {"reference": "Heparin now."})], [1.0, 0.0]),
    "keywords": (
        [("Stop warfarin, give vitamin K, INR.", {"reference": KREF, "key_points": KP}),
         ("INR, vitamin K, warfarin.", {"reference": KREF, "key_points": KP})],
        [1.0, 0.33],
    ),
    "style": ([("# Title\n- item", {"reference": "# Head\n- point"}), ("prose", {"reference": "# Head\n- point"})], [ANY, ANY]),
    "semantic": ([("Water boils at 100 C at sea level.", {"reference": "Water boils at 100 degrees Celsius at sea level."}),
                  ("I like trains.", {"reference": "Water boils at 100 degrees Celsius at sea level."})], [ANY, ANY]),
}  # fmt: skip


FILLER = {"reference": "zzz", "answer": "zzz", "labels": ["zzz"], "key_points": [["zzz"]]}


def test_grade_cli_every_grader(tmp_path):
    """One command line naming every grader ('exact:1,contains:1,...'): each row is built for one grader
    (the other fields are filler) and that grader's component must come out as computed by hand."""
    rows, expect = [], []
    for name in sorted(CASES):
        cases, want = CASES[name]
        for i, ((completion, extra), w) in enumerate(zip(cases, want)):
            rows.append({"id": f"{name}-{i}", "prompt": name, "completion": completion, **FILLER, **extra})
            expect.append((name, w))
    spec = ",".join(f"{n}:1" for n in sorted(CASES))
    res = grade_cli("--grader", spec, "--data", write(tmp_path / "rows.jsonl", rows))
    assert res.returncode == 0, res.stderr
    out = rows_out(res)
    assert [o["id"] for o in out] == [r["id"] for r in rows]
    for o, (name, w) in zip(out, expect):
        assert set(o) == {"id", "score", "components"} and set(o["components"]) == set(CASES)
        got = o["components"][name]
        if w is ANY:
            assert got is not None and 0.0 <= got <= 1.0, o
        elif w is None:
            assert got is None, o
        else:
            assert round(got, 2) == round(w, 2), (name, o)
    by_id = {o["id"]: o["components"] for o in out}
    for name in ("style", "semantic"):  # no hand value: the right answer must win
        assert by_id[f"{name}-0"][name] > by_id[f"{name}-1"][name]
    assert f"graded {len(rows)} rows" in res.stderr


@pytest.mark.parametrize("name", sorted(set(CASES) - {"semantic"}))
def test_grade_main_each_grader_alone(tmp_path, capsys, name):
    """The same cases through `main(argv)` (what `eval.py grade` calls), one grader at a time."""
    cases, want = CASES[name]
    rows = [{"id": i, "completion": c, **extra} for i, (c, extra) in enumerate(cases)]
    assert main(["--grader", name, "--data", str(write(tmp_path / "rows.jsonl", rows))]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for o, w in zip(out, want):
        assert o["components"] == {name: o["score"]}
        if w is ANY:
            assert 0.0 <= o["score"] <= 1.0
        else:
            assert o["score"] == w if w is None else round(o["score"], 2) == round(w, 2)


def test_grade_cli_human_column_agreement(tmp_path):
    scipy_stats = pytest.importorskip("scipy.stats")
    rows = []
    for g, ref in enumerate(["the cat sat on the mat", "green light means go now"]):
        texts = [
            (ref, 1.0),
            (ref.split()[0] + " " + ref.split()[-1], 0.6),
            ("nothing", 0.2),
            ("the mat", 0.8),
        ]
        for k, (text, human) in enumerate(texts):
            rows.append(
                {"id": f"{g}-{k}", "prompt": f"p{g}", "reference": ref, "completion": text, "human": human}
            )
    rows.append({"id": "unscored", "prompt": "p0", "reference": "x", "completion": "x"})  # no human mark
    data = write(tmp_path / "graded.jsonl", rows)
    res = grade_cli("--grader", "rouge_l", "--data", data, "--json", tmp_path / "agree.json", "--top", "2")
    assert res.returncode == 0, res.stderr
    out = rows_out(res)
    scores = [o["score"] for o in out[:-1]]
    human = [r["human"] for r in rows[:-1]]
    agree = json.loads((tmp_path / "agree.json").read_text())
    assert agree["n"] == 8
    assert agree["kendall_tau"] == pytest.approx(scipy_stats.kendalltau(scores, human).statistic)
    # within each prompt: 6 pairs; by hand, the grader swaps 'the mat' (0.8) and the first+last word (0.6)
    # in group 0 (rouge 0.5 vs 0.5: a tie, half) and ranks group 1's the same way as the human except there
    pairs, hits = 0, 0.0
    for g in ("0", "1"):
        idx = [i for i, r in enumerate(rows[:-1]) if r["id"].startswith(g)]
        for a in idx:
            for b in idx:
                if a < b:
                    pairs += 1
                    d = (scores[a] - scores[b]) * (human[a] - human[b])
                    hits += 0.5 if scores[a] == scores[b] else float(d > 0)
    assert agree["pairs"] == pairs == 12
    assert agree["pairwise_accuracy"] == pytest.approx(hits / pairs)
    assert len(agree["disagreements"]) == 2 and all(d["rank_gap"] > 0 for d in agree["disagreements"])
    assert "Kendall tau-b" in res.stderr and "pairwise accuracy" in res.stderr
    assert "largest disagreements" in res.stderr


@pytest.mark.parametrize(
    "lines, args, msg",
    [
        (['{"completion": "a", "reference": "a"}', "{not json"], (), "rows.jsonl:2: malformed JSON"),
        (['{"completion": "a", "reference": "a"}', "", '["a"]'], (), "rows.jsonl:3: a row must be a JSON object"),
        (['{"reference": "a"}'], (), "rows.jsonl:1: field 'completion' is missing"),
        (['{"completion": 7, "reference": "a"}'], (), "rows.jsonl:1: field 'completion' is of type int"),
        (['{"completion": "a", "reference": "a", "human": "good"}'], (), "rows.jsonl:1: field 'human' must be a number"),
        (['{"completion": "a", "reference": "a"}', "", '{"completion": "b"}'], (), "rows.jsonl:3: field 'reference' is missing, and grader 'rouge_l'"),
        (['{"completion": "a", "reference": 5}'], (), "rows.jsonl:1: field 'reference' must be a string"),
        (['{"completion": "a"}'], ("--grader", "keywords"), "rows.jsonl:1: field 'key_points' is missing"),
        (['{"completion": "a"}'], ("--grader", "bleu"), "unknown grader 'bleu'"),
        ([], (), "has no rows"),
    ],
)  # fmt: skip
def test_grade_bad_rows(tmp_path, capsys, lines, args, msg):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["--data", str(data), *(args or ("--grader", "rouge_l"))]) == 2
    captured = capsys.readouterr()
    assert msg in captured.err and captured.out == ""


def test_grade_cli_bad_rows_subprocess(tmp_path):
    data = write(
        tmp_path / "rows.jsonl", [{"completion": "a", "reference": "a"}], ["", '{"completion": "b"}']
    )
    res = grade_cli("--grader", "numbers", "--data", data)
    assert res.returncode == 2 and res.stdout == ""
    assert f"{data}:3: field 'reference' is missing, and grader 'numbers' needs it" in res.stderr


def test_grade_run_in_process_and_missing_file(tmp_path, capsys):
    rows = [{"completion": "pick the client", "reference": SHARE}]
    assert run(GradeArgs(data=write(tmp_path / "r.jsonl", rows), grader="rouge_l")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["id"] == 1 and out["score"] == pytest.approx(2 * 3 / (3 + 9))  # id defaults to the line
    assert run(GradeArgs(data=tmp_path / "missing.jsonl", grader="rouge_l")) == 2
    assert "no such file" in capsys.readouterr().err


def test_groups_are_scored_whole():
    rows = [{"prompt": p, "completion": str(i)} for i, p in enumerate("abacbca")]
    groups = group_keys(rows)
    seen = []

    def reward(batch):
        seen.append(sorted({s.group for s in batch}))
        by_group = {}
        for s in batch:
            by_group.setdefault(s.group, []).append(s.completion)
        for s in batch:  # a group grader needs every answer to its prompt in the batch
            assert len(by_group[s.group]) == groups.count(s.prompt)
        return [float(s.completion) for s in batch], {"x": [1.0] * len(batch)}

    scores, comps = score_rows(reward, rows, groups, batch_size=2)
    assert scores == [float(i) for i in range(7)]  # back in file order
    assert len(seen) == 3 and comps[0] == {"x": 1.0}
    assert (
        group_keys([{"group": 1, "prompt": "a"}, {"group": 1, "prompt": "b"}])[0]
        == group_keys([{"group": 1}])[0]
    )


def test_percentile_ranks_share_ties():
    assert percentile_ranks([0.1, 0.5, 0.5, 0.9]) == [0.0, 0.5, 0.5, 1.0]
    assert percentile_ranks([3.0]) == [0.5]
