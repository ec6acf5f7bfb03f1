"""Data loading and validation: every bad row names the file, the line and the field."""

import json

import pytest

from nanogrpo.data import DataError, PromptOrder, load_rows
from nanogrpo.recipes.demo import demo_rows


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


def test_demo_task_is_deterministic_and_splits_disjoint():
    tr, ev = demo_rows("train"), demo_rows("eval")
    assert tr == demo_rows("train") and len(tr) == 3 * len(ev) > 0
    q = lambda rows: {r["prompt"][-1]["content"] for r in rows}
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


# ----------------------------------------------------------------------------- hostile files, one reader


def _bad_files(tmp_path):
    """(file, what the error must say) for files train.py and eval.py grade must refuse with file and line."""
    ok = '{"prompt": "q", "reference": "a", "completion": "c"}\n'
    cases = []

    def add(name, data, needle):
        p = tmp_path / name
        if isinstance(data, str):
            data = data.encode("utf-8")
        p.write_bytes(data)
        cases.append((p, needle))

    (tmp_path / "a_dir").mkdir()
    cases.append((tmp_path / "a_dir", "is a directory"))
    add(
        "nested.jsonl",
        ok + '{"prompt": "q", "completion": "c", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
        ":2: ",
    )
    add(
        "surrogate.jsonl",
        ok + '{"prompt": "q\\ud800", "completion": "c"}\n',
        ":2: field 'prompt' holds a lone surrogate",
    )
    add(
        "latin1.jsonl",
        ok.encode() + '{"prompt": "caf\u00e9", "completion": "c"}\n'.encode("latin-1"),
        ":2: not UTF-8",
    )
    add("utf16.jsonl", ok.encode("utf-16"), "UTF-16 encoded")
    add(
        "bigint.jsonl",
        ok + '{"prompt": "q", "completion": "c", "id": ' + "9" * 5000 + "}\n",
        ":2: an integer of 5000 digits",
    )
    add("nan.jsonl", ok + '{"prompt": "q", "completion": "c", "human": NaN}\n', ":2: NaN is not JSON")
    add(
        "role.jsonl",
        ok + '{"prompt": [{"role": "wizard", "content": "q"}], "completion": "c"}\n',
        ":2: field 'prompt' message 0 has role 'wizard'",
    )
    add("empty.jsonl", ok + '{"prompt": "  ", "completion": "c"}\n', ":2: field 'prompt' is empty")
    return cases


def test_train_and_grade_refuse_hostile_files_with_file_and_line(tmp_path):
    from rewards.grade import read_rows as grade_rows

    for path, needle in _bad_files(tmp_path):
        for read in (load_rows, lambda p: grade_rows(p)):
            with pytest.raises(DataError) as e:
                read(path)
            msg = str(e.value)
            assert str(path) in msg and needle in msg, (path.name, msg)
            assert len(msg) < 400 and "\n" not in msg  # one line, never a megabyte of the input


def test_a_line_over_the_size_limit_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    from nanogrpo_base import rows

    p = tmp_path / "huge.jsonl"
    p.write_text('{"prompt": "q"}\n{"prompt": "' + "x" * 200_000 + '"}\n')
    read = []
    real = rows._lines

    def spy(path, limit):  # the reader asks for at most limit + 1 bytes of a line
        for lineno, text in real(path, limit):
            read.append(len(text))
            yield lineno, text

    monkeypatch.setattr(rows, "_lines", spy)
    with pytest.raises(DataError, match=r"huge.jsonl:2: the line is longer than 1000 bytes"):
        rows.read_rows(p, max_line_bytes=1000)
    assert max(read) < 1000


def test_long_prompts_are_refused_or_cut_to_their_last_tokens(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from nanogrpo.data import render_prompt, tokenize_prompts

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rows = load_rows(_write(tmp_path, ['{"prompt": "short"}', json.dumps({"prompt": "word " * 300})]))
    full = render_prompt(tok, rows[1])
    with pytest.raises(DataError, match=r"rows.jsonl:2: the prompt is \d+ tokens, over the limit of 50"):
        tokenize_prompts(rows, tok, "", 50, "refuse", str(tmp_path / "rows.jsonl"))
    assert tokenize_prompts(rows, tok, "", 50, "truncate", "x") == 1
    assert rows[1]["_prompt_ids"] == full[-50:] and rows[0]["_prompt_ids"] == render_prompt(tok, rows[0])


def test_train_refuses_a_long_prompt_before_the_model_loads(tmp_path):
    from helpers import run_train_here

    data = _write(tmp_path, [json.dumps({"prompt": "word " * 300, "reference": "a"})])
    r = run_train_here(
        "tiny",
        "--out-dir",
        str(tmp_path / "run"),
        "--data.train",
        str(data),
        "--data.max-prompt-tokens",
        "64",
    )
    assert r.returncode == 2 and "rows.jsonl:1: the prompt is" in r.stderr.splitlines()[-1], r.stderr[-2000:]
    assert not (tmp_path / "run" / "config.json").exists()
