"""The built-in environments' edges and the flags around them: `calc` answers every expression with a finite
value within its bound or `error: ...` (never a traceback, never inf, nan or a complex number), `search`
credits an answer only as whole words and reads a row's `sources` string as one id, --model.device names
what works when it names something this build cannot run on, and a FILE.meta.json that is not a JSON file of
ours is a one-line error (generate) or no provenance (score) instead of a traceback."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, run_eval, run_train_here, write_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from nanogrpo import startup
from nanogrpo.config import ModelConfig
from nanogrpo.envs import Step
from nanogrpo.envs.builtin import Calc, Search, arith
from nanogrpo.eval import generation, provenance

# -- calc ---------------------------------------------------------------------------------------------------

BAD = [
    "1e300 ** 2",  # float overflow
    "1e-300 ** -2",
    "1" + "0" * 199,  # a 200-digit literal: past the bound, not a value
    "1e999",  # inf as a constant
    "-1e999",
    "1e999 - 1e999",  # nan
    "(-1) ** 0.5",  # complex results
    "(-8) ** (1/3)",
    "1 // 1e-300",  # float floor division and modulo by a tiny number
    "1e15 // 1e-300",
    "1e15 % 1e-300 + 1e16",
    "0 ** -1",
    "0.0 ** -1.5",
    "1 % 0.0",
    "(" * 60 + "2" + ")" * 60 + " ** 65",
    "(" * 199 + "1",  # too deep for the parser
    "-" * 199 + "1 " + "x",
    "1 if 1 else 2",
    "1j",
    "True + 1",
    "\x00",
]


def _calc() -> Calc:
    c = Calc()
    c.reset({"answer": "1"}, 0)
    return c


def _checked(step: Step) -> Step:
    """A calc tool reply is a finite value within the bound, or `error: ...` marked invalid."""
    assert isinstance(step, Step)
    if step.info.get("invalid"):
        assert step.observation is None or step.observation.startswith("error: "), step
    elif not step.done:
        v = float(step.observation)
        assert math.isfinite(v) and abs(v) <= 1e15, step
    return step


@pytest.mark.parametrize("expr", BAD)
def test_calc_answers_an_error_for_what_has_no_finite_value(expr):
    step = _checked(_calc().step(f"<calc>{expr}</calc>"))
    assert step.info == {"invalid": True} and step.observation.startswith("error: "), step
    with pytest.raises(ValueError):
        arith(expr)


@pytest.mark.parametrize(
    "expr, value",
    [("27 * 52", "1404"), ("(" * 90 + "2" + ")" * 90, "2"), ("-" * 150 + "3", "3"), ("1e15", "1000000000000000"),
     ("2 ** 0.5", "1.41421"), ("7 // 2 + 7 % 2", "4"), ("1e-300 * 1e-300", "0"), (" 1 ", "1"), ("10 ** 15", "1000000000000000")],
)  # fmt: skip
def test_calc_still_computes(expr, value):
    assert _checked(_calc().step(f"<calc>{expr}</calc>")).observation == value


EXPR = st.text(alphabet="0123456789+-*/%().e ", max_size=40)


@settings(max_examples=400, deadline=None)
@given(expr=EXPR | st.lists(st.sampled_from(["1e308", "9" * 20, "**", "(", ")", "-", "0.5", "//", "%", "1e-300"]),
                            max_size=12).map(" ".join))  # fmt: skip
def test_calc_never_raises_on_arithmetic_text(expr):
    _checked(_calc().step(f"<calc>{expr}</calc>"))


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=300))
def test_calc_never_raises_on_any_text(text):
    _checked(_calc().step(text))
    _checked(_calc().step(f"<calc>{text}</calc>"))


# -- search -------------------------------------------------------------------------------------------------


def _answered(row: dict, answer: str, query: str = "") -> Step:
    s = Search()
    s.reset(row, 0)
    if query:
        s.step(f"<search>{query}</search>")
    return s.step(f"<answer>{answer}</answer>")


@pytest.mark.parametrize(
    "answer, text, right",
    [("4", "14", False), ("4", "1400 strings", False), ("4", "-4", False), ("4", "4.", True), ("4", "it has 4 strings", True),
     ("four", "fourteen", False), ("Four", "It has four.", True), ("North Africa", "in north-western Africa", False),
     ("North Africa", "In North  Africa!", True), ("Antarctica", "Antarctica [penguin]", True),
     ("3.14", "about 3.14.", True), ("3.14", "13.14", False)],
)  # fmt: skip
def test_search_credits_the_answer_as_whole_words(answer, text, right):
    step = _answered({"answer": answer}, text)
    assert step.info["solved"] is right and math.isclose(step.reward, 0.7 * right)


@pytest.mark.parametrize("sources", ["nile", ["nile"], ["moon", "nile"]])
def test_search_reads_a_sources_string_as_one_id(sources):
    step = _answered({"answer": "6650", "sources": sources}, "6650 km [nile]", query="how long is the Nile")
    assert step.info == {"solved": True, "cited": True} and math.isclose(step.reward, 1.0)
    # a letter of the id is no citation
    step = _answered({"answer": "6650", "sources": sources}, "6650 km [n]", query="how long is the Nile")
    assert step.info["cited"] is False


# -- --model.device -----------------------------------------------------------------------------------------


def nothing_loads(*a, **k):
    raise AssertionError("the model loaded before --model.device was refused")


@pytest.mark.parametrize("device", ["tpu", "foo", "meta", "mps", "cuda:x", "CPU", ""])
def test_a_device_this_build_cannot_use_is_one_line(device, monkeypatch, tmp_path):
    monkeypatch.setattr(startup, "load_policy", nothing_loads)
    res = run_train_here(
        "tiny", "--steps", "1", "--model.device", device, "--out-dir", tmp_path / "run", cwd=tmp_path
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert (
        lines[0].startswith(f"error: --model.device {device!r}") and "cpu, cuda, cuda:N or auto" in lines[0]
    )
    assert not (tmp_path / "run").exists()


def test_a_cuda_index_past_the_visible_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"--model.device 'cuda:3'.* 1 GPU is visible.*cuda:0"):
        from nanogrpo.infra.device import resolve_device_dtype

        resolve_device_dtype(ModelConfig(device="cuda:3", dtype="float32"))


def test_train_py_model_device_tpu_exits_2_without_a_traceback(tmp_path):
    res = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "tiny", "--model.device", "tpu", "--out-dir", str(tmp_path / "r")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    assert "--model.device 'tpu'" in lines[0] and "Traceback" not in res.stderr


# -- FILE.meta.json -----------------------------------------------------------------------------------------


def test_generate_names_a_meta_json_folder_in_one_line(tmp_path, monkeypatch):
    out = tmp_path / "completions.jsonl"
    (tmp_path / "completions.meta.json").mkdir()

    def no_model(*a):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(generation, "load_model", no_model)  # refused before the model loads
    res = run_eval(
        "generate", "--model", "tiny", "--data", "demo", "--limit", "2", "--out", out, cwd=tmp_path
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    assert "completions.meta.json" in lines[0] and "folder" in lines[0] and "remove" in lines[0]
    assert not out.exists()
    with pytest.raises(ValueError, match="is a folder"):
        provenance.write_meta(out, model="tiny", adapter="")


@pytest.mark.parametrize("meta", ["folder", '{"run": 5}', '{"run": ["x"]}', '{"run": {"a": 1}}', "[1]", "{"])
def test_score_and_compare_read_a_meta_json_they_cannot_use_as_none(meta, tmp_path):
    c = write_rows(tmp_path / "c.jsonl", [{"id": 1, "prompt": "p", "reference": "a", "completion": "a"}])
    d = write_rows(tmp_path / "d.jsonl", [{"id": 1, "prompt": "p", "reference": "a", "completion": "b"}])
    for f in (c, d):
        m = provenance.meta_path(f)
        m.mkdir() if meta == "folder" else m.write_text(meta)
        assert provenance.run_of(f) is None
        assert provenance.same_judge_warning(f, ["rouge_l"]) is None
    res = run_eval("score", c, "--graders", "rouge_l", cwd=tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    res = run_eval("compare", c, d, cwd=tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
