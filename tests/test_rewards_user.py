"""Graders of your own from a Python file: 'file.py:function:weight' in --reward.spec (rewards/user.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from helpers import run_train_here

import train
from nanogrpo import startup
from rewards import RewardConfig, Sample, build_reward
from rewards.spec import parse_spec, spec_entries
from rewards.user import DEFAULT_TIMEOUT_S, UserGraderError

ROOT = Path(__file__).resolve().parents[1]

TRL = """
def brevity(prompts, completions, **columns):
    assert len(columns["reference"]) == len(completions)  # one entry per completion
    return [1.0 / (1 + len(c.split())) for c in completions]
"""

NATIVE = """
from rewards.base import Sample

def first_word(batch: list[Sample]) -> list[float | None]:
    return [None if s.row.get("skip") else float(s.completion[:1].isalpha()) for s in batch]
"""


def user_file(tmp_path: Path, body: str, name: str = "my_rewards.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def batch(*rows: dict) -> list[Sample]:
    return [Sample("p", f"answer {i}", i, dict(r)) for i, r in enumerate(rows)]


def reward(path: Path, func: str, **kw):
    return build_reward(RewardConfig(spec=f"{path}:{func}:1", allow_user_code=True, **kw))


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------- the spec


def test_spec_reads_a_file_function_and_weight():
    assert spec_entries("my_rewards.py:brevity:0.3,rouge_l:0.7") == [
        ("brevity", "my_rewards.py:brevity", 0.3),
        ("rouge_l", "rouge_l", 0.7),
    ]
    assert parse_spec("/abs/dir/r.py:f, rouge_l") == [("f", 1.0), ("rouge_l", 1.0)]
    with pytest.raises(ValueError, match=r"'file.py:function:weight'"):
        parse_spec("my_rewards.py:0.3")  # the function is missing
    with pytest.raises(ValueError, match="weight 'x' of 'brevity' is not a number"):
        parse_spec("my_rewards.py:brevity:x")
    with pytest.raises(ValueError, match="are both named 'f'"):
        parse_spec("a.py:f:1,b.py:f:1")
    with pytest.raises(ValueError, match="weight 'b:c' of 'a' is not a number"):
        parse_spec("a:b:c")  # malformed specs are still refused


def test_user_code_needs_the_opt_in(tmp_path):
    path = user_file(tmp_path, "raise SystemExit('imported!')\n")
    with pytest.raises(ValueError, match="runs your Python code.*add --reward.allow-user-code"):
        build_reward(RewardConfig(spec=f"{path}:brevity:1"))  # refused before the file is imported


def test_missing_file_or_function_and_a_builtin_name(tmp_path):
    with pytest.raises(ValueError, match="no file"):
        reward(tmp_path / "nope.py", "f")
    path = user_file(tmp_path, TRL)
    with pytest.raises(ValueError, match="has no function 'brevty' \\(its functions: brevity\\)"):
        reward(path, "brevty")
    user_file(
        tmp_path, "def rouge_l(prompts, completions, **kw):\n    return [1.0] * len(completions)\n", "r.py"
    )
    with pytest.raises(ValueError, match="name of a built-in grader"):
        reward(tmp_path / "r.py", "rouge_l")
    user_file(tmp_path, "def one(x):\n    return [1.0]\n", "one.py")
    with pytest.raises(ValueError, match="takes neither"):
        reward(tmp_path / "one.py", "one")


def test_a_relative_path_is_read_from_the_working_directory(tmp_path, monkeypatch):
    user_file(tmp_path, TRL)
    monkeypatch.chdir(tmp_path)
    fn = build_reward(RewardConfig(spec="my_rewards.py:brevity:0.3,rouge_l:0.7", allow_user_code=True))
    rewards, comps = fn(batch({"reference": "answer 0"}, {"reference": "x y"}))
    assert comps["brevity"] == [1 / 3, 1 / 3] and set(comps) == {"brevity", "rouge_l"}
    assert rewards[0] == pytest.approx(0.3 / 3 + 0.7 * 1.0)


# ------------------------------------------------------------------------------------- both signatures


def test_trl_signature_gets_columns_as_lists(tmp_path):
    path = user_file(tmp_path, """
        seen = {}
        def f(prompts, completions, answer, **columns):
            seen.update(columns, answer=answer, prompts=prompts)
            return [float(c.endswith(a)) for c, a in zip(completions, answer)]
    """)  # fmt: skip
    fn = reward(path, "f")
    rows = [{"answer": "0", "id": "q1", "_line": 1}, {"answer": "9", "extra": 2, "_line": 2}]
    _, comps = fn(batch(*rows))
    assert comps["f"] == [1.0, 0.0]
    seen = fn.graders["f"].fn.__globals__["seen"]
    assert seen["answer"] == ["0", "9"] and seen["id"] == ["q1", None] and seen["extra"] == [None, 2]
    assert "_line" not in seen and seen["prompts"] == ["p", "p"]
    assert fn.graders["f"].requires == ("answer",)  # a named column is required of every row
    with pytest.raises(ValueError, match="field 'answer' is missing, and grader 'f' needs it"):
        fn.validate([{"prompt": "p"}], "train.jsonl")


def test_nanogrpo_signature_and_none(tmp_path):
    path = user_file(tmp_path, NATIVE)
    fn = reward(path, "first_word")
    assert fn.graders["first_word"].batch_style
    rewards, comps = fn(batch({}, {"skip": True}))
    assert comps["first_word"] == [1.0, None] and rewards == [1.0, None]  # None: does not apply
    fn = build_reward(RewardConfig(spec=f"{path}:first_word:1,format:1", allow_user_code=True))
    rewards, comps = fn(batch({}, {"skip": True}))
    assert rewards[1] == pytest.approx(2 * comps["format"][1])  # the weights renormalised over format


def test_scores_are_not_clipped_and_nan_is_none(tmp_path):
    path = user_file(tmp_path, "def f(prompts, completions, **kw):\n    return [-1, float('nan')]\n")
    assert reward(path, "f")(batch({}, {}))[1]["f"] == [-1.0, None]


# ------------------------------------------------------------------------------------- failures


def test_user_code_failures_are_one_clean_error(tmp_path):
    path = user_file(tmp_path, """
        def boom(prompts, completions, **columns):
            if any(i == "q2" for i in columns["id"]):
                raise KeyError("score")
            return [1.0] * len(completions)
        def short(prompts, completions, **columns):
            return [1.0]
        def word(batch):
            return ["high" for _ in batch]
    """)  # fmt: skip
    rows = ({"id": "q1", "_line": 1}, {"id": "q2", "_line": 2})
    with pytest.raises(UserGraderError) as e:
        reward(path, "boom")(batch(*rows))
    assert str(e.value) == f"user grader {path}:boom: raised KeyError: 'score' (on row line 2, id 'q2')"
    assert isinstance(e.value.__cause__, KeyError)  # NANOGRPO_DEBUG=1 shows its traceback
    with pytest.raises(UserGraderError, match="short: returned 1 scores for 2 completions"):
        reward(path, "short")(batch(*rows))
    with pytest.raises(
        UserGraderError, match="word: returned str 'high' for row line 1, id 'q1'; return a number"
    ):
        reward(path, "word")(batch(*rows))


RETURNS = """
import numpy as np

def keyed(prompts, completions, **kw):
    return {i: 1.0 for i in range(len(completions))}  # a dict: list() would take its keys for scores

def text(prompts, completions, **kw):
    return "1" * len(completions)

def lazy(prompts, completions, **kw):
    return (1.0 for _ in completions)

def one(prompts, completions, **kw):
    return 0.5

def pair(prompts, completions, **kw):
    return tuple(0.5 for _ in completions)

def array(prompts, completions, **kw):
    return np.array([0.25, float("nan")])
"""


@pytest.mark.parametrize(
    "func, kind", [("keyed", "dict"), ("text", "str"), ("lazy", "generator"), ("one", "float")]
)
def test_a_grader_must_return_a_list_one_per_completion(tmp_path, func, kind):
    path = user_file(tmp_path, RETURNS)
    with pytest.raises(UserGraderError) as e:
        reward(path, func)(batch({}, {}))
    assert str(e.value) == (
        f"user grader {path}:{func}: returned {kind}, not a list of numbers or None (one per completion)"
    )


def test_a_tuple_or_a_1d_array_is_a_list_and_nan_in_it_is_none(tmp_path):
    path = user_file(tmp_path, RETURNS)
    assert reward(path, "pair")(batch({}, {}))[1]["pair"] == [0.5, 0.5]
    assert reward(path, "array")(batch({}, {}))[1]["array"] == [0.25, None]


# ------------------------------------------------------------------------------------- exits and hangs

ENDS = """
import sys, time

def exits(prompts, completions, **columns):
    sys.exit(0)

def hangs(prompts, completions, **columns):
    while True:
        try:
            time.sleep(3)  # finite: a hang abandoned in a thread ends with the test run
        except Exception:  # what a grader guarding its own code does: the time limit gets through
            pass

def swallows(prompts, completions, **columns):
    while True:
        try:
            time.sleep(3)
        except BaseException:  # even this: the call still passed its limit
            return [1.0] * len(completions)

def interrupted(prompts, completions, **columns):
    raise KeyboardInterrupt
"""
ROW = {"id": "q1", "_line": 1}


def _timer_is_free() -> bool:
    return signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (
        0,
        0,
    )


def test_sys_exit_in_a_call_is_one_error_line(tmp_path):
    path = user_file(tmp_path, ENDS)
    with pytest.raises(UserGraderError) as e:
        reward(path, "exits")(batch(ROW))
    assert str(e.value) == f"user grader {path}:exits: raised SystemExit: 0 (on row line 1, id 'q1')"
    assert isinstance(e.value, ValueError)  # train.py: the line, exit 2


def test_sys_exit_at_import_is_one_error_line(tmp_path):
    path = user_file(tmp_path, "import sys\nsys.exit(3)\n\ndef f(prompts, completions):\n    return []\n")
    with pytest.raises(ValueError) as e:
        reward(path, "f")
    assert str(e.value) == f"--reward.spec '{path}:f': importing {path} failed: SystemExit: 3"


@pytest.mark.parametrize("func", ["hangs", "swallows"])
def test_a_hung_call_stops_at_the_time_limit(tmp_path, func):
    path = user_file(tmp_path, ENDS)
    fn = reward(path, func, user_timeout_s=0.5)
    with pytest.raises(UserGraderError) as e:
        fn(batch(ROW))
    assert str(e.value) == (
        f"user grader {path}:{func}: took longer than 0.5 s (on row line 1, id 'q1'); make it faster, "
        "or raise --reward.user-timeout-s (0 = no limit)"
    )
    assert _timer_is_free(), "the timer signal is left as it was found"


def test_off_the_main_thread_a_hung_call_is_abandoned_in_its_thread(tmp_path):
    path = user_file(tmp_path, ENDS)
    fn = reward(path, "hangs", user_timeout_s=0.5)
    got: list[BaseException] = []

    def score():
        try:
            fn(batch(ROW, {"id": "q2", "_line": 2}))
        except BaseException as e:
            got.append(e)

    worker = threading.Thread(target=score)
    worker.start()
    worker.join(30)
    assert isinstance(got[0], UserGraderError), got
    assert str(got[0]).endswith("took longer than 0.5 s (on a batch of row line 1, id 'q1'; row line 2, id "
                                "'q2'); make it faster, or raise --reward.user-timeout-s (0 = no limit)")  # fmt: skip


def test_sys_exit_in_a_style_user_check_is_an_error_not_an_exit(tmp_path, monkeypatch):
    from rewards.style import Style

    user_file(
        tmp_path, "import sys\n\ndef quits(completion, reference, row):\n    sys.exit(0)\n", "quitter.py"
    )
    user_file(tmp_path, "import sys\nsys.exit(3)\n", "exits_at_import.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = RewardConfig(style_weights="length:1", allow_user_code=True)
    g = Style(dataclasses.replace(cfg, style_user_checks=("quitter.quits",)))
    assert g([Sample("p", "an answer", 0, {"reference": "an answer"})]) == [0.5]  # the check scores 0
    assert g.metrics() == {"user_check_errors": 1.0}
    with pytest.raises(
        ValueError, match="'exits_at_import.f': importing exits_at_import failed: SystemExit: 3"
    ):
        Style(dataclasses.replace(cfg, style_user_checks=("exits_at_import.f",)))


def test_the_time_limit_default_ctrl_c_and_a_timely_call(tmp_path):
    path = user_file(tmp_path, ENDS + TRL)
    assert RewardConfig().user_timeout_s == DEFAULT_TIMEOUT_S > 0
    assert reward(path, "brevity", user_timeout_s=5)(batch({"reference": "r"}))[1]["brevity"] == [1 / 3]
    assert _timer_is_free()
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C stays Ctrl-C
        reward(path, "interrupted")(batch(ROW))
    with pytest.raises(ValueError, match="user-timeout-s must be >= 0"):
        reward(path, "brevity", user_timeout_s=-1)


# ------------------------------------------------------------------------------------- train.py


def test_a_tiny_run_with_a_user_grader(tmp_path):
    path = user_file(tmp_path, TRL)
    out = tmp_path / "run"
    train.main(train.cli(["tiny", "--out-dir", str(out), "--steps", "2", "--no-plots", "--reward.spec",
                          f"{path}:brevity:1,rouge_l:0", "--reward.allow-user-code"]))  # fmt: skip
    ms = metrics(out)
    assert [m["step"] for m in ms] == [1, 2]
    assert all(0 < m["reward/brevity"] <= 1 and m["reward"] == pytest.approx(m["reward/brevity"]) for m in ms)


def test_train_refuses_user_code_without_the_flag(tmp_path, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the model loaded before the reward was checked")

    monkeypatch.setattr(startup, "load_policy", no_model)
    path = user_file(tmp_path, TRL)
    with pytest.raises(ValueError, match="add --reward.allow-user-code to allow it"):
        train.main(
            train.cli(["tiny", "--out-dir", str(tmp_path / "a"), "--reward.spec", f"{path}:brevity:1"])
        )


def test_a_grader_returning_a_dict_stops_train_py_with_one_line_naming_it(tmp_path):
    path = user_file(tmp_path, RETURNS)
    r = run_train_here("tiny", "--out-dir", str(tmp_path / "run"), "--steps", "2", "--reward.spec",
                       f"{path}:keyed:1", "--reward.allow-user-code", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: user grader {path}:keyed: returned dict, not a list of numbers or None (one per completion)"
    )
    assert not (tmp_path / "run" / "adapter").exists()  # nothing trained on the dict's keys


def test_nan_from_a_user_grader_is_no_reward_as_a_built_in_graders_is(tmp_path):
    """NaN is None: left out of the group's baseline and the means (the step stays finite); a grader that
    scores nothing at all stops the run after --reward.max-empty-steps, as a judge that stopped answering."""
    path = user_file(tmp_path, """
        def half(prompts, completions, **kw):
            return [float("nan") if i % 2 else 1.0 / (1 + len(c)) for i, c in enumerate(completions)]
        def none(prompts, completions, **kw):
            return [float("nan")] * len(completions)
    """)  # fmt: skip
    run = ["tiny", "--steps", "2", "--no-plots", "--reward.allow-user-code", "--log-samples-every", "1"]
    r = run_train_here(
        *run, "--out-dir", str(tmp_path / "a"), "--reward.spec", f"{path}:half:1", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ms = metrics(tmp_path / "a")
    assert all(0 < m["reward"] <= 1 and math.isfinite(m["loss"]) for m in ms), ms
    samples = [json.loads(x) for x in (tmp_path / "a" / "samples.jsonl").read_text().splitlines()]
    got = [c["reward"] for s in samples for g in s["groups"] for c in g["completions"]]
    assert None in got and all(x is None or math.isfinite(x) for x in got)
    r = run_train_here(*run, "--out-dir", str(tmp_path / "b"), "--reward.spec", f"{path}:none:1",
                       "--reward.max-empty-steps", "1", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2 and "no valid reward in 1 steps in a row" in r.stderr.splitlines()[-1], r.stderr


def train_with_grader(tmp_path, ref: str, *flags: str) -> str:
    """`train.py tiny` for one step with the user grader `ref`: it must exit 2 with one line, returned."""
    args = [sys.executable, str(ROOT / "train.py"), "tiny", "--out-dir", str(tmp_path / "run"), "--steps", "1",
            "--reward.spec", f"{ref}:1", "--reward.allow-user-code", *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("NANOGRPO_DEBUG", None)
    r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    return r.stderr.strip().splitlines()[-1]


def test_a_failing_user_grader_stops_train_py_with_one_line(tmp_path):
    path = user_file(tmp_path, "def f(prompts, completions, **kw):\n    return [1 / 0] * len(completions)\n")
    last = train_with_grader(tmp_path, f"{path}:f")
    assert last.startswith(f"error: user grader {path}:f: raised ZeroDivisionError: division by zero (on ")


@pytest.mark.parametrize("func", ["exits", "hangs"])
def test_a_user_grader_that_exits_or_hangs_stops_train_py_with_one_line(tmp_path, func):
    path = user_file(tmp_path, ENDS)
    last = train_with_grader(tmp_path, f"{path}:{func}", "--reward.user-timeout-s", "0.5")
    what = "raised SystemExit: 0 (on " if func == "exits" else "took longer than 0.5 s (on "
    assert last.startswith(f"error: user grader {path}:{func}: {what}"), last
