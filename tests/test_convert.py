"""nanogrpo/reward_data/convert.py: MedQA-style multiple-choice rows to open generation (DPO and the training
loader accept the output; bad rows named by file and line), and the seeded, stratified split."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import write_rows

from nanogrpo.data import DataError, load_rows
from nanogrpo.reward_data import convert
from nanogrpo.stages import dpo

ROOT = Path(__file__).resolve().parents[1]

# MedQA's layout (US, 4 options): the letter in answer_idx, the text in answer, meta_info the exam step
MEDQA = [
    {
        "question": "A 23-year-old pregnant woman has burning on urination. Which is the best treatment?",
        "answer": "Nitrofurantoin",
        "options": {"A": "Ampicillin", "B": "Ceftriaxone", "C": "Doxycycline", "D": "Nitrofurantoin"},
        "meta_info": "step2&3",
        "answer_idx": "D",
    },
    {
        "question": "Which vitamin deficiency causes scurvy?",
        "answer": "Vitamin C",
        "options": {"A": "Vitamin A", "B": "Vitamin C", "C": "Vitamin D", "D": "Vitamin K"},
        "meta_info": "step1",
        "answer_idx": "B",
    },
]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_convert(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "nanogrpo.reward_data.convert", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_medqa_row_converts_and_trains_dpo(tmp_path):
    src = write_rows(tmp_path / "test.jsonl", MEDQA)
    out = tmp_path / "open.jsonl"
    res = run_convert("mcq", src, "--out", out, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = read(out)
    assert rows[0] == {
        "id": "test-1",
        "prompt": MEDQA[0]["question"],
        "reference": "Nitrofurantoin",
        "answer": "Nitrofurantoin",
        "options": MEDQA[0]["options"],
        "meta_info": "step2&3",
    }
    assert [r["answer"] for r in rows] == ["Nitrofurantoin", "Vitamin C"]
    # the file feeds every stage: the loader, SFT/GRPO (reference) and DPO (options + answer)
    loaded = load_rows(out)
    dpo.check_rows(loaded, str(out))
    chosen, rejected = dpo.preference_pair(loaded[1], seed=0)
    assert chosen == "Vitamin C" and rejected in {"Vitamin A", "Vitamin D", "Vitamin K"}


def test_prompt_lists_options_and_instruction():
    f = convert.McqFields(list_options=True, instruction="Name the drug only.")
    row = convert.convert_row({**MEDQA[0], "id": 7}, f, "x.jsonl:1")
    assert row["prompt"] == (
        MEDQA[0]["question"] + "\n\nA. Ampicillin\nB. Ceftriaxone\nC. Doxycycline\nD. Nitrofurantoin"
        "\n\nName the drug only."
    )
    assert row["id"] == 7 and "answer_idx" not in row


@pytest.mark.parametrize(
    "row, answer",
    [
        ({"q": "2 + 2?", "choices": ["three", "four", "five"], "gold": "B"}, "four"),  # list, by letter
        ({"q": "2 + 2?", "choices": ["three", "four", "five"], "gold": "four"}, "four"),  # by text
        ({"q": "2 + 2?", "choices": ["three", "four", "five"], "gold": 2}, "five"),  # by index
        (
            {"q": "2 + 2?", "choices": [{"key": "A", "value": "3"}, {"key": "B", "value": "4"}], "gold": "b"},
            "4",
        ),
    ],
)
def test_option_forms_and_field_names(row, answer):
    f = convert.McqFields(question="q", options="choices", answer=("gold",))
    out = convert.convert_row({**row, "id": 1}, f, "x.jsonl:1")
    assert out["reference"] == out["answer"] == answer and "choices" not in out
    dpo.check_rows([out], "x.jsonl")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"answer_idx": "F"}, r"bad.jsonl:2: field 'answer_idx': the answer 'F' is not among the 4 options"),
        ({"answer": "Vitamin A"}, r"bad.jsonl:2: the answer fields disagree"),
        ({"question": ""}, r"bad.jsonl:2: field 'question' is missing"),
        ({"options": "A or B"}, r"bad.jsonl:2: the options must be a list"),
        (
            {"options": {"A": "Vitamin C", "B": "Vitamin C"}},
            r"bad.jsonl:2: .*'Vitamin C' is the text of 2 options",
        ),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, change, message):
    src = write_rows(tmp_path / "bad.jsonl", [MEDQA[0], {**MEDQA[1], **change}])
    with pytest.raises(DataError, match=message):
        convert.convert_mcq(src)
    rows, skipped = convert.convert_mcq(src, skip_bad=True)
    assert [r["id"] for r in rows] == ["bad-1"] and len(skipped) == 1


def test_row_dpo_would_misread_is_refused():
    """The gold text 'B' is also option B's letter: DPO could not tell which option it names."""
    row = {"id": 1, "question": "Which letter follows A?", "options": {"A": "B", "B": "C"}, "answer_idx": "A"}
    with pytest.raises(DataError, match=r"x.jsonl:1: converted: .*could name option A or option B"):
        convert.convert_row(row, convert.McqFields(), "x.jsonl:1")


def split_input(tmp_path: Path) -> tuple[Path, list[dict]]:
    groups = ["step1"] * 47 + ["step2&3"] * 31 + ["rare"] * 3
    rows = [{"id": f"q{i}", "prompt": f"question {i}?", "meta_info": g} for i, g in enumerate(groups)]
    return write_rows(tmp_path / "all.jsonl", rows), rows


def test_split_is_stratified_reproducible_disjoint_complete(tmp_path):
    src, rows = split_input(tmp_path)
    res = run_convert(
        "split", src, "--by", "meta_info", "--out-dir", tmp_path / "a", "--seed", 3, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    parts = {n: read(tmp_path / "a" / f"{n}.jsonl") for n in ("train", "val", "test")}
    ids = [r["id"] for p in parts.values() for r in p]
    assert sorted(ids) == sorted(r["id"] for r in rows)  # every row once: disjoint and complete
    group_sizes = Counter(r["meta_info"] for r in rows)
    for name, ratio in zip(parts, (0.8, 0.1, 0.1)):
        assert abs(len(parts[name]) - ratio * len(rows)) <= 1.5
        for g, n in Counter(r["meta_info"] for r in parts[name]).items():
            assert abs(n - ratio * group_sizes[g]) < 1  # each group in its share, to within a row
    # the same seed gives the same files; another seed another split
    run_convert("split", src, "--by", "meta_info", "--out-dir", tmp_path / "b", "--seed", 3, cwd=tmp_path)
    assert (tmp_path / "a" / "test.jsonl").read_text() == (tmp_path / "b" / "test.jsonl").read_text()
    other = convert.split_rows(load_rows(src), "meta_info", (0.8, 0.1, 0.1), seed=4)
    assert [r["id"] for r in other[2]] != [r["id"] for r in parts["test"]]
    # the files are not overwritten unless asked
    again = run_convert("split", src, "--by", "meta_info", "--out-dir", tmp_path / "a", cwd=tmp_path)
    assert again.returncode != 0 and "--overwrite" in again.stderr


def test_split_small_groups_keep_the_totals():
    """100 groups of 5 rows: per-group rounding alone would give every leftover row to one split."""
    counts = convert.allocate([5] * 100, (0.8, 0.1, 0.1))
    assert [sum(c[k] for c in counts) for k in range(3)] == [400, 50, 50]
    assert all(sum(c) == 5 for c in counts)


def test_split_errors(tmp_path):
    src, rows = split_input(tmp_path)
    write_rows(src, rows[:5] + [{"id": "x", "prompt": "no group"}])
    with pytest.raises(DataError, match=r"all.jsonl:6: field 'meta_info' is missing"):
        convert.split_rows(load_rows(src), "meta_info", (0.8, 0.1, 0.1), 0, str(src))
    with pytest.raises(ValueError, match="sum to 1"):
        convert.check_ratios((0.8, 0.1, 0.2), ("train", "val", "test"))
    with pytest.raises(ValueError, match="one ratio per split"):
        convert.check_ratios((0.9, 0.1), ("train", "val", "test"))
