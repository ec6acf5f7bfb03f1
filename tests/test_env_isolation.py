"""What an environment cannot do to the process that trains (docs/ENVS.md, "Where an environment runs"): the
processes it starts end with its worker and with the run, even at the trainer's kill -9; what a worker sends
back is data read by the trainer, one reply a request; a TRL-style class is built and read in its worker;
numbers are numbers; a call inside an unclosed <think> block is not made; an episode's timers end with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import HOSTILE, ROOT, leftovers, rows_file, run_args, run_eval, tiny
from hostile_envs import SPAWN_MARKER, PropertyTool, UnionTool

from nanogrpo.config import EnvConfig
from nanogrpo.envs import Environment, Step, make_factory, serve
from nanogrpo.envs.keeper import printable
from nanogrpo.envs.serve import INFO_CHARS, INFO_NODES, as_json
from nanogrpo.envs.spec import build_spec
from nanogrpo.envs.tool_calls import FORMATS, HERMES, PLAIN, ToolCallError, parse_tool_call
from nanogrpo.envs.tools import tool_class_factory
from nanogrpo.envs.workers import Workers
from nanogrpo.summary import StepNotes


def gone_within(marker: str, seconds: float) -> list[str]:
    """The processes holding `marker` still running after up to `seconds` (none: [])."""
    deadline = time.monotonic() + seconds
    while (left := leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def train_cmd(tmp_path: Path, steps: int) -> list[str]:
    data = rows_file(tmp_path / "rows.jsonl", ["", ""])
    args = run_args("Spawner", data, tmp_path / "run", "--steps", str(steps), "--prompts-per-step", "1")
    return [sys.executable, str(ROOT / "train.py"), *map(str, args)]


def test_what_an_environment_starts_ends_with_the_run_and_holds_no_pipe_of_the_trainers(tmp_path) -> None:
    """Each episode starts a process in a session of its own, a double-forked daemon and a plain child: when
    the run ends, `train.py | cat` returns (none of them holds the trainer's stdout or stderr), and none is
    left. Nor is an empty torchinductor_<user> folder in $TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    t0 = time.monotonic()
    r = subprocess.run(train_cmd(tmp_path, 1), env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert time.monotonic() - t0 < 120  # the pipes closed with the run, not when the sleepers would end
    assert gone_within(SPAWN_MARKER, 2.0) == []
    assert list(tmp.iterdir()) == []


def test_what_an_environment_starts_ends_at_the_trainers_kill_9(tmp_path) -> None:
    """The trainer killed with SIGKILL mid-run: every process its environments started (in a session of its
    own, double-forked, or a plain child in the worker's group) is gone within seconds: their keeper sees the
    trainer die and kills them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(train_cmd(tmp_path, 500), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(leftovers(SPAWN_MARKER)) < 3 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert p.poll() is None and len(leftovers(SPAWN_MARKER)) >= 3, "no episode started its processes"
    finally:
        p.kill()
        p.wait()
    assert gone_within(SPAWN_MARKER, 5.0) == []


def test_eval_generate_leaves_nothing_an_environment_started(tmp_path) -> None:
    data = rows_file(tmp_path / "rows.jsonl", ["", ""])
    r = run_eval("generate", "--data", data, "--model", "tiny", "--env.spec", f"{HOSTILE}:Spawner", "--allow-user-code",
                 "--max-new-tokens", "4", "--out", tmp_path / "gen.jsonl", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert gone_within(SPAWN_MARKER, 2.0) == []


# -- the channel: one reply a request, data only --------------------------------------------------------------


class Echo(Environment):
    def reset(self, row: dict, seed: int) -> str:
        return f"seed {seed}"

    def step(self, text: str) -> Step:
        return Step(text.upper(), 0.5, False, {})


def test_a_second_reply_is_dropped_and_named_never_taken_for_the_next_call(monkeypatch, capsys) -> None:
    """A worker whose every reply comes twice (as a fork of it serving on would send them): each call still
    gets its own answer, and the strays are counted and said once."""
    real = serve.send_frame

    def twice(sock, payload: bytes) -> None:
        real(sock, payload)
        real(sock, payload)

    monkeypatch.setattr(serve, "send_frame", twice)  # the workers fork with it
    w = Workers(Echo, limit_s=5.0)
    try:
        w.grow(1)
        monkeypatch.setattr(serve, "send_frame", real)  # the trainer's requests go once
        assert w.call({0: ("make", None)}) == {0: (None, "")}
        assert w.call({0: ("reset", ({}, 7, 100))}) == {0: ("seed 7", "")}
        for text in ("a", "b", "c"):
            (obs, err), *_ = w.call({0: ("step", (text, 100))}).values()
            assert err == "" and obs.observation == text.upper()
    finally:
        w.close()
    assert w.strays >= 4
    assert capsys.readouterr().err.count("sent a reply to no request in flight") == 1


def test_replies_are_data_the_trainer_reads_without_running_code(monkeypatch) -> None:
    """What comes back is JSON: a reply that is not (bytes no worker of nanogrpo sends) fails that call and
    the worker is replaced; an object a step returns in info is its text."""
    real = serve.send_frame
    monkeypatch.setattr(serve, "send_frame", lambda sock, payload: real(sock, b"\x80\x04not json"))
    w = Workers(Echo, limit_s=5.0)
    try:
        w.grow(1)  # a worker whose replies are not JSON
        monkeypatch.setattr(serve, "send_frame", real)  # the trainer's requests, and the next worker
        (value, err) = w.call({0: ("make", None)})[0]
        assert value is None and err.startswith(
            "make: the environment's process sent a reply that is not JSON"
        )
        assert w.call({0: ("make", None)}) == {0: (None, "")}  # its replacement
    finally:
        w.close()


class Alarming(Environment):
    """Its first episode ends with a timer it never cancelled (whose signal's default action ends the process),
    and an alarm."""

    first = True

    def step(self, text: str) -> Step:
        if Alarming.first:
            Alarming.first = False
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            signal.alarm(1)
        return Step(None, 1.0, True, {})


def test_a_timer_an_episode_left_does_not_end_the_next_episode() -> None:
    w = Workers(Alarming, limit_s=5.0)
    try:
        for episode in range(2):
            assert w.call({0: ("make", None)})[0] == (None, "")
            if episode:
                time.sleep(1.2)  # past both timers of the first episode
            assert w.call({0: ("reset", ({}, 0, 100))})[0] == (None, "")
            step, err = w.call({0: ("step", ("x", 100))})[0]
            assert err == "" and step.reward == 1.0
            w.call({0: ("end", None)})
    finally:
        w.close()


def test_info_is_kept_as_far_as_a_budget_allows_in_milliseconds() -> None:
    """A dict that holds itself 50 times (what makes the time limit of 0 hang, when nothing bounds it) is
    written as far as INFO_NODES values; a key whose text fails is its type's name."""

    class NoText:
        def __str__(self) -> str:
            raise RuntimeError("no text")

    info: dict = {NoText(): 1}
    for i in range(50):
        info[f"k{i}"] = info
    t0 = time.perf_counter()
    out = as_json(info, [INFO_CHARS, INFO_NODES])
    assert time.perf_counter() - t0 < 1.0 and out["<NoText>"] == 1
    assert len(json.dumps(out)) < 1_000_000


def test_a_failure_is_noted_as_printable_text(monkeypatch, capsys) -> None:
    from nanogrpo.envs import episode

    monkeypatch.setattr(episode, "_NOTED", set())
    t = episode.Trajectory([1], "p", failed="step: RuntimeError: \x1b[2J\nerror: forged")
    episode.note_failures([t], "Rows")
    assert capsys.readouterr().out == (
        "note: environment 'Rows' failed an episode: step: RuntimeError: \\x1b[2J\\nerror: forged (counted in "
        "env/failed)\n"
    )


def test_console_text_is_printable() -> None:
    assert printable("\x1b[31mred\x1b[0m\nerror: x\r\x07\u202etxt\tok") == (
        "\\x1b[31mred\\x1b[0m\\nerror: x\\r\\x07\\u202etxt\tok"
    )


# -- TRL-style tool classes, built and read in a worker ---------------------------------------------------


def test_a_tool_class_is_built_and_read_in_its_worker_never_in_the_trainer() -> None:
    """make_factory only imports the class; a property that raises is neither a tool nor read; a start-up
    check builds it in a worker (tests/test_env_faults.py: one that sleeps, exits or raises SystemExit in its
    constructor is refused in one line)."""
    factory = make_factory(spec=f"{HOSTILE}:PropertyTool", allow_user_code=True)
    spec = build_spec(factory, "PropertyTool", EnvConfig(spec="x"), 16)
    try:
        assert [t["function"]["name"] for t in spec.tools] == ["add"]
    finally:
        spec.workers.close()
    assert "broken" not in tool_class_factory(PropertyTool)().methods


def test_valid_tool_classes_are_tools_whatever_their_signatures_and_names() -> None:
    """A Union-typed parameter on the first tool (its example call and its line in the plain tool list), and a
    tool named `step` on a class whose reset takes **row (TRL's)."""
    env = tool_class_factory(UnionTool)()
    first = env.reset({"prompt": "Find 3."}, 0)
    assert "- look(key: integer|string): Look a key up." in first
    assert '<tool>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool>' in first
    assert env.step('<tool>{"name": "look", "arguments": {"key": "x"}}</tool>').observation == "found x"
    stairs = make_factory(spec=f"{HOSTILE}:StepTool", allow_user_code=True)()
    assert [t["function"]["name"] for t in stairs.tools] == ["step"] and type(
        stairs.obj
    ).__name__ == "StepTool"
    stairs.reset({"prompt": "Climb 3."}, 0)
    got = stairs.step('<tool>{"name": "step", "arguments": {"n": 3}}</tool>')
    assert got.observation == "climbed 3" and got.reward == 1.0


# -- thinking, and what a parser refuses --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [PLAIN, HERMES], ids=lambda f: f.name)
def test_a_call_inside_an_unclosed_think_block_is_thought_not_made(fmt) -> None:
    """The turn stops at the call's closing tag, before </think>: the call is not run; the model reads why.
    One in a closed block is not read; one after </think> is made."""
    call = fmt.write("add", {"a": 1, "b": 2})
    with pytest.raises(ToolCallError, match="inside a <think> block that is not closed, so it was thought"):
        parse_tool_call(f"<think>I could write {call}", fmt)
    assert parse_tool_call(f"<think>maybe {call}</think>The answer is 3.", fmt) is None
    assert parse_tool_call(f"<think>so</think>{call}", fmt) == ("add", {"a": 1, "b": 2})
    env = tool_class_factory(UnionTool)()
    env.tool_format = fmt.name
    env.reset({"prompt": "2 + 1?"}, 0)
    got = env.step(f"<think>Let me add. {call}")
    assert (
        got.info["invalid"] and "tool" not in got.info and "</think>" in json.loads(got.observation)["error"]
    )
    assert not got.done and FORMATS[env.tool_format] is fmt


def test_a_call_nested_too_deeply_is_an_invalid_call_not_a_crash() -> None:
    deep = "[" * 10_000 + "]" * 10_000
    with pytest.raises(ToolCallError, match="nested too deeply"):
        parse_tool_call(f'<tool>{{"name": "add", "arguments": {deep}}}</tool>', PLAIN)


# -- what the run says ----------------------------------------------------------------------------------


def test_the_cut_note_says_what_a_cut_episode_scores_and_no_flag_that_cannot_help() -> None:
    cfg = replace(tiny(Path("/tmp")), env=EnvConfig(max_turns=4, max_tokens=99, truncated_score=-1))
    (line,) = StepNotes(cfg, SimpleNamespace(own_turns=4))(
        {"step": 1, "env/truncated": 1.0, "env/truncated_turns": 1.0}
    )
    assert "each scores the sum of its steps' rewards (--env.truncated-score -1)" in line
    assert "--env.max-turns" not in line and "own max_turns (4)" in line
    (line,) = StepNotes(cfg, SimpleNamespace(own_turns=6))(
        {"step": 1, "env/truncated": 1.0, "env/truncated_turns": 1.0}
    )
    assert "raise --env.max-turns (now 4" in line


def test_env_flags_without_an_environment_are_refused(tmp_path) -> None:
    from helpers import run_train_here

    r = run_train_here("tiny", "--env.tool-format", "plain", "--out-dir", tmp_path / "run")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --env.tool-format: no effect without an environment; add --env.name or --env.spec, or drop it"
    ]
    r = run_eval("generate", "--data", "recipe:guess", "--model", "tiny", "--env.max-turns", "2",
                 "--out", tmp_path / "g.jsonl", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2 and "--env.max-turns: no effect without an environment" in r.stderr


def test_research_checks_its_flags_before_any_stage_runs(monkeypatch, capsys) -> None:
    from nanogrpo.lab import research

    monkeypatch.setattr(research.subprocess, "call", lambda *a, **k: pytest.fail("a stage ran"))
    assert research.main(["run", "--model.thread", "2"]) == 2
    assert research.main(["run", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "Unrecognized options: --model.thread" in err and "error: train.py research-sft: --steps 0" in err
