"""Data loading and validation: every bad row names the file, the line and the field."""

import json

import pytest

from nanogrpo.data import DataError, PromptOrder, demo_rows, load_rows, require_fields


def _write(tmp_path, lines):
    p = tmp_path / "rows.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"prompt": "hi"', "malformed JSON"),
        ('{"reference": "x"}', "missing field 'prompt'"),
        ('{"prompt": "   "}', "field 'prompt' is empty"),
        ('{"prompt": []}', "field 'prompt' must be"),
        ('{"prompt": [{"role": "user"}]}', "message 0"),
        ('{"prompt": "q", "reference": 3}', "field 'reference' must be a string"),
        ('["prompt"]', "must be a JSON object"),
    ],
)
def test_bad_rows_name_file_line_field(tmp_path, line, needle):
    p = _write(tmp_path, ['{"prompt": "fine", "reference": "ok"}', line])
    with pytest.raises(DataError) as e:
        load_rows(p)
    assert f"{p}:2" in str(e.value) and needle in str(e.value)


def test_rows_get_line_ids_and_chat_prompts(tmp_path):
    chat = {"prompt": [{"role": "user", "content": "q"}], "reference": "a"}
    p = _write(tmp_path, [json.dumps({"prompt": "x"}), "", json.dumps(chat)])
    rows = load_rows(p)
    assert [r["id"] for r in rows] == [1, 3]


def test_grader_needing_missing_field_is_refused(tmp_path):
    rows = load_rows(_write(tmp_path, ['{"prompt": "q", "reference": "a"}', '{"prompt": "q2"}']))
    with pytest.raises(DataError, match=r"rows.jsonl:2: field 'reference' is missing, and rouge_l needs it"):
        require_fields(rows, ("reference",), str(tmp_path / "rows.jsonl"), "rouge_l")


def test_demo_task_is_deterministic_and_splits_disjoint():
    tr, ev = demo_rows("train"), demo_rows("eval")
    assert tr == demo_rows("train") and len(tr) == 3 * len(ev) > 0
    q = lambda rows: {r["prompt"][0]["content"] for r in rows}
    assert not q(tr) & q(ev)


def test_prompt_order_crosses_epochs_and_resumes():
    a = PromptOrder(5, seed=3)
    first = a.take(3) + a.take(4)
    assert sorted(first[:5]) == list(range(5))  # one epoch is a permutation
    b = PromptOrder(5, seed=3)
    b.take(3)
    c = PromptOrder(5, seed=3)
    c.load_state_dict(b.state_dict())
    assert c.take(4) == first[3:]
