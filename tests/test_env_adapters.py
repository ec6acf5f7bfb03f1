"""The adapters onto the environment protocol (nanogrpo/envs/tools.py, textarena.py, openenv.py) and the
reasoning-gym data source and grader (rewards/reasoninggym.py): the tool-call parser, a TRL-style class, the
TextArena observation diff and seeding, OpenEnv's text field, the errors a bad name or a missing package
gives before any model loads, and each one training two steps of the tiny model (the runs start together,
one train.py process each, when the module's first test asks for one)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import ROOT, free_port, run_train_here, stop_process_group

from nanogrpo.data import load_task
from nanogrpo.envs import Step, make_factory, protocol_attrs
from nanogrpo.envs.openenv import observation_text, text_field
from nanogrpo.envs.textarena import observation_delta
from nanogrpo.envs.tool_calls import ToolCallError, parse_tool_call
from nanogrpo.envs.tools import tool_prompt
from nanogrpo_base.rows import prompt_text

TOOLS = '''
class Adder:
    """A TRL-style environment: one tool, the reward an attribute."""

    max_turns = 3

    def reset(self, **row):
        self.answer, self.reward = int(row["answer"]), 0.0
        return "Use the tools."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first number
            b: the second number
        """
        if a + b == self.answer:
            self.reward = 1.0
        return a + b

    def fail(self, why: str) -> str:
        """Always raise.

        Args:
            why: the reason
        """
        raise RuntimeError(f"failed: {why}")


class Scored(Adder):
    """The reward from get_reward(), which is not a tool."""

    def get_reward(self) -> float:
        return 0.5 + 0.5 * self.reward


class NoDoc:
    def reset(self, **row):
        return None

    def add(self, a: int, b: int) -> int:
        return a + b
'''

ECHO = '''
import sys

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed_message: str = ""
    message_length: int = 0


class Echo(Environment):
    """OpenEnv's echo environment, shortened: reward 1 and done for a message that says hello."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(step_count=0)
        return EchoObservation(echoed_message=f"Echo ready (seed {seed}). Say hello.")

    def step(self, action: EchoAction, timeout_s=None, **kwargs):
        self._state.step_count += 1
        hello = "hello" in action.message.lower()
        return EchoObservation(echoed_message=action.message, message_length=len(action.message),
                               reward=float(hello), done=hello)

    @property
    def state(self):
        return self._state


class Dying(Echo):
    """An echo server that dies (its whole process) at reset number DIES_AT, as a server killed mid-run."""

    resets = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        Dying.resets += 1
        if Dying.resets >= int(sys.argv[2]):
            import os

            os._exit(1)
        return super().reset(seed, episode_id, **kwargs)


if __name__ == "__main__":  # python echo_game.py PORT [DIES_AT]: the server, on the loopback address only
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    game = Dying if len(sys.argv) > 2 else Echo
    app = create_app(game, EchoAction, EchoObservation, env_name="echo", max_concurrent_envs=16)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''

RUN = ["tiny", "--steps", "2", "--no-plots", "--prompts-per-step", "2", "--grpo.group-size", "2",
       "--sampling.max-new-tokens", "8"]  # fmt: skip
EPISODES = [*RUN, "--data.train", "recipe:calc", "--reward.spec", "env:1", "--env.max-turns", "2"]


def has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A folder with the example classes: tools.py (TRL-style) and echo_game.py (OpenEnv)."""
    d = tmp_path_factory.mktemp("examples")
    (d / "tools.py").write_text(TOOLS)
    (d / "echo_game.py").write_text(ECHO)
    return d


class Runs:
    """train.py processes started at once (they share the cores), each awaited when a test reads it."""

    def __init__(self, folder: Path, pythonpath: Path):
        self.folder, self.procs = folder, {}
        self.env = {**os.environ, "PYTHONPATH": f"{pythonpath}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1"}  # fmt: skip

    def start(self, name: str, *args: str) -> None:
        out = self.folder / name
        log = (self.folder / f"{name}.log").open("w")
        cmd = [sys.executable, str(ROOT / "train.py"), *args, "--out-dir", str(out)]
        self.procs[name] = (
            subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT),
            out,
        )

    def result(self, name: str) -> tuple[list[dict], list[dict]]:
        """The run's metrics.jsonl and samples.jsonl rows, once it ended with status 0."""
        proc, out = self.procs[name]
        rc = proc.wait(timeout=300)
        assert rc == 0, (self.folder / f"{name}.log").read_text()[-3000:]
        read = lambda f: [json.loads(x) for x in (out / f).read_text().splitlines()]
        return read("metrics.jsonl"), read("samples.jsonl")

    def stop(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def echo_server(files):
    """An OpenEnv server of the echo game on 127.0.0.1 (a free port), killed at the end; None without openenv."""
    if not has("openenv"):
        yield None
        return
    proc, url = start_server(files)
    try:
        yield (proc, url)
    finally:
        stop_process_group(proc)


def start_server(files, *args) -> tuple[subprocess.Popen, str]:
    """An OpenEnv echo server (python echo_game.py PORT ARGS) on a free port of 127.0.0.1, in a session of its own."""
    port = free_port()
    log = (files / f"server-{port}.log").open("w")
    proc = subprocess.Popen([sys.executable, str(files / "echo_game.py"), str(port), *args], cwd=files, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def wait_until_up(proc, url: str, limit_s: float = 90) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with opener.open(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, files, echo_server):
    """Each adapter's two-step run whose package is installed, all started together."""
    r = Runs(tmp_path_factory.mktemp("runs"), files)
    try:
        r.start("trl", *EPISODES, "--env.spec", f"{files / 'tools.py'}:Scored", "--reward.allow-user-code")
        if has("textarena"):
            r.start("textarena", *EPISODES, "--env.name", "textarena:GuessTheNumber-v0")
        if has("reasoning_gym"):
            gym = "reasoning_gym:basic_arithmetic,chain_sum"
            r.start("reasoning_gym", *RUN, "--data.train", gym, "--reward.spec", "reasoning_gym:1")
        if echo_server is not None:
            r.start("openenv_local", *EPISODES, "--env.name", "openenv:echo_game:Echo")
            wait_until_up(*echo_server)
            r.start("openenv_server", *EPISODES, "--env.name", f"openenv:{echo_server[1]}")
        yield r
    finally:
        r.stop()


def check_episodes(metrics: list[dict], samples: list[dict]) -> str:
    """Two steps of episodes; the first group's first message."""
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["env/turns"] >= 1 and m["env/failed"] == 0.0, m
        assert "reward/env" in m
    return samples[0]["groups"][0]["prompt"]


# -- the TRL-style tool classes ----------------------------------------------------------------------------


def test_parse_tool_call():
    assert parse_tool_call('Let me add. <tool>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool>') == (
        "add",
        {"a": 1, "b": 2},
    )
    assert parse_tool_call('<tool>{"name": "add", "parameters": {"a": 1}}</tool>') == ("add", {"a": 1})
    assert parse_tool_call('<tool>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool>') == ("add", {"a": 3})
    assert parse_tool_call('<tool>```json\n{"name": "now"}\n```</tool>') == ("now", {})
    assert parse_tool_call("The answer is 3.") is None
    form = '; write the call as <tool>{"name": "TOOL", "arguments": {...}}</tool>'
    cases = {
        '<tool>{"name": "add"': "the tool call has no closing </tool>" + form,
        "<tool>add(1, 2)</tool>": "the tool call is not JSON (Expecting value at character 0)" + form,
        '<tool>["add"]</tool>': "the tool call needs a name" + form,
        '<tool>{"arguments": {}}</tool>': "the tool call needs a name" + form,
        '<tool>{"name": "add", "arguments": [1, 2]}</tool>': "the arguments must be a JSON object, got list" + form,
        '<tool>{"name": "add", "arguments": "{a: 1}"}</tool>': "the arguments are not JSON (Expecting property name enclosed in double quotes)" + form,
    }  # fmt: skip
    for text, message in cases.items():
        with pytest.raises(ToolCallError) as e:
            parse_tool_call(text)
        assert str(e.value) == message


FIRST = """What is 2 + 3?

Use the tools.

You can call these tools:
- add(a: integer, b: integer): Add two integers.
    a: the first number
    b: the second number
- fail(why: string): Always raise.
    why: the reason
To call a tool, write <tool>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool> and stop; its result comes \
back in the next message. When you are done, answer without a tool call."""


def test_a_trl_style_class_plays_an_episode(files):
    factory = make_factory(spec=f"{files / 'tools.py'}:Adder", allow_user_code=True)
    env = factory()
    attrs, names = protocol_attrs(env), [t["function"]["name"] for t in env.tools]
    assert attrs.pop("tools") == tuple(env.tools) and names == ["add", "fail"]
    # no stop string of its own: the run adds the call format's closing tag (</tool> in the plain format)
    assert attrs == {"max_turns": 3, "stop": (), "role": "tool", "reward_range": (0.0, 1.0)}
    row = {"prompt": "What is 2 + 3?", "answer": "5", "_prompt_ids": [1, 2]}
    assert env.reset(dict(row), 7) == FIRST
    assert factory().reset(dict(row), 8) == FIRST  # the same for every episode of the row
    call = '<tool>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool>'
    steps = [env.step(t) for t in (
        '<tool>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool>', call,
        '<tool>{"name": "mul", "arguments": {}}</tool>', '<tool>{"name": "add", "arguments": {"a": 2}}</tool>',
        '<tool>{"name": "fail", "arguments": {"why": "no"}}</tool>', "It is 5.",
    )]  # fmt: skip
    want = [
        ("4", 0.0, False, {"tool": "add", "tool_calls": 1}),
        ("5", 1.0, False, {"tool": "add", "tool_calls": 1}),
        ('{"error": "no tool \'mul\'; the tools are add, fail"}', 0.0, False, {"invalid": True, "tool": "mul", "tool_calls": 1}),
        ('{"error": "add: missing a required argument: \'b\'"}', 0.0, False, {"invalid": True, "tool": "add", "tool_calls": 1}),
        ('{"error": "failed: no"}', 0.0, False, {"invalid": True, "tool": "fail", "tool_calls": 1}),
        (None, 0.0, True, {"tool_calls": 0}),
    ]  # fmt: skip
    assert [(s.observation, s.reward, s.done, s.info) for s in steps] == want


def test_get_reward_is_the_episodes_reward_however_it_ends(files):
    """Each step returns the change of get_reward(): their sum is its value when the episode stops."""
    env = make_factory(spec=f"{files / 'tools.py'}:Scored", allow_user_code=True)()
    assert "get_reward" not in env.reset({"prompt": "2 + 3?", "answer": 5}, 0)
    first = env.step('<tool>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool>')
    assert first.reward == 1.0 and not first.done  # a budget that ends the episode here keeps it
    assert env.step("5").reward == 0.0


def test_a_tool_class_that_tools_cannot_describe_is_refused(files, tmp_path):
    """Building an instance (in a worker, at start-up: tests/test_env_isolation.py) says what is wrong."""
    factory = make_factory(spec=f"{files / 'tools.py'}:NoDoc", allow_user_code=True)  # nothing of it ran
    with pytest.raises(ValueError, match=r"tool class NoDoc: tool add: .*no docstring.*docstring with Args:"):
        factory()
    (tmp_path / "args.py").write_text(
        "class Needs:\n    def __init__(self, x):\n        pass\n    def reset(self): pass\n"
    )
    with pytest.raises(ValueError, match=r"Needs\(\) failed .*__init__ takes no argument"):
        make_factory(spec=f"{tmp_path / 'args.py'}:Needs", allow_user_code=True)()


def test_tool_prompt_example_follows_the_first_tools_types():
    schema = {"type": "function", "function": {"name": "find", "description": "Find.", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}, "k": {"type": "integer"}}, "required": ["q"]}}}  # fmt: skip
    assert tool_prompt([schema]).splitlines()[1:3] == [
        "- find(q: string, k: integer (optional)): Find.",
        'To call a tool, write <tool>{"name": "find", "arguments": {"q": "text", "k": 1}}</tool> and stop; its '
        "result comes back in the next message. When you are done, answer without a tool call.",
    ]


def test_a_trl_style_class_trains(runs):
    first = check_episodes(*runs.result("trl"))
    assert first.startswith("What is ") and "- add(a: integer, b: integer): Add two integers." in first


# -- TextArena ---------------------------------------------------------------------------------------------


def test_observation_delta():
    assert observation_delta("", "\n[GAME] Guess.") == "[GAME] Guess."
    assert observation_delta("\n[GAME] Guess.", "\n[GAME] Guess.\n[Player] [5]\n[GAME] Higher.") == (
        "[Player] [5]\n[GAME] Higher."
    )
    assert observation_delta("\n[GAME] Guess.", "\n[GAME] A new board.") == "[GAME] A new board."
    assert observation_delta("\nA", "\nA") == ""


def test_a_textarena_game_is_seeded_and_leaves_global_random_alone():
    pytest.importorskip("textarena")
    factory = make_factory(name="textarena:GuessTheNumber-v0")
    a, b = factory(), factory()
    assert protocol_attrs(a)["max_turns"] == 10 and protocol_attrs(a)["reward_range"] == (-1.0, 1.0)
    random.seed(1)
    expected = random.random()
    random.seed(1)
    first = a.reset({}, 42)
    assert (
        first.startswith("[GAME] You are Player 0. You are playing Guess The Number.")
        and b.reset({}, 42) == first
    )
    assert random.random() == expected  # the games draw from their own random state
    bad = a.step("twelve")
    assert bad.info == {"invalid": True, "won": False} and bad.observation.startswith(
        "[Player] [twelve]\n[GAME] You attempted"
    )
    lo, hi, step = 1, 20, None
    for _ in range(6):  # binary search: within 5 guesses of 1..20
        guess = (lo + hi) // 2
        step = a.step(f"[{guess}]")
        assert step == b.step(f"[{guess}]")  # the same game for both
        if step.done:
            break
        hints = [f"[Player] [{guess}]\n[GAME] The target number is {h}." for h in ("higher", "lower")]
        assert step.observation in hints
        lo, hi = (guess + 1, hi) if "higher" in step.observation else (lo, guess - 1)
    assert step.done and step.reward == 1.0 and step.info["reason"].startswith("Congratulations")
    assert step.info["won"] is True  # the game's win: what env/win_rate counts


def test_textarena_names_the_game_it_cannot_play(monkeypatch, tmp_path):
    pytest.importorskip("textarena")
    with pytest.raises(ValueError, match=r"no game 'GuessTheNumbr-v0'; did you mean GuessTheNumber-v0"):
        make_factory(name="textarena:GuessTheNumbr-v0")
    with pytest.raises(ValueError, match=r"TicTacToe-v0: not a single-player game"):
        make_factory(name="textarena:TicTacToe-v0")
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # no word list, and none to download
    monkeypatch.setattr(nltk, "download", lambda *a, **k: False)
    with pytest.raises(
        ValueError, match=r"Hangman-v0: it needs the NLTK data 'words'.*nltk.downloader words"
    ):
        make_factory(name="textarena:Hangman-v0")


def test_a_textarena_game_trains(runs):
    pytest.importorskip("textarena")
    first = check_episodes(*runs.result("textarena"))
    assert first.startswith("[GAME] You are Player 0. You are playing Guess The Number.")


# -- OpenEnv -----------------------------------------------------------------------------------------------


def test_openenv_text_field_and_observation_text():
    echo = {
        "properties": {"message": {"type": "string"}, "metadata": {"type": "object"}},
        "required": ["message"],
    }
    assert text_field(echo, "x") == "message"
    code = {"properties": {"code": {"type": "string"}, "lang": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
            "required": ["code"]}  # fmt: skip
    assert text_field(code, "x") == "code"
    with pytest.raises(ValueError, match=r"x: cannot tell which action field .*\['a', 'b'\]"):
        text_field({"properties": {"a": {"type": "string"}, "b": {"type": "string"}}}, "x")
    with pytest.raises(ValueError, match=r"string fields: none"):
        text_field({"properties": {"tokens": {"type": "array"}}}, "x")
    assert observation_text({"echoed_message": "hi", "message_length": 2, "reward": 1, "done": False}) == "hi"
    assert (
        observation_text({"board": "..x", "legal": "abc", "metadata": {}})
        == '{"board": "..x", "legal": "abc"}'
    )


def test_an_openenv_environment_in_this_process(files, monkeypatch):
    pytest.importorskip("openenv")
    monkeypatch.syspath_prepend(str(files))
    env = make_factory(name="openenv:echo_game:Echo")()
    assert env.reset({}, 3) == "Echo ready (seed 3). Say hello."
    assert [env.step(t) for t in ("hi", "hello!")] == [Step("hi", 0.0, False), Step("hello!", 1.0, True)]
    for name, message in {
        "openenv:echo_game:Nope": "module echo_game has no class 'Nope'",
        "openenv:no_such_module:X": "importing no_such_module failed: No module named 'no_such_module'",
        "openenv:echo_game": "write openenv:package.module:ClassName",
        "openenv:echo_game:EchoAction": "EchoAction is not an OpenEnv Environment",
    }.items():
        with pytest.raises(ValueError, match=message):
            make_factory(name=name)


def test_an_openenv_url_where_no_server_answers_fails_before_the_model_loads():
    pytest.importorskip("openenv")
    url = f"http://127.0.0.1:{free_port()}"
    r = run_train_here(*EPISODES, "--env.name", f"openenv:{url}", "--out-dir", "/nonexistent/never-written")
    assert r.returncode == 2 and f"no OpenEnv server answers at {url}" in r.stderr, r.stderr


def test_openenv_environments_train(runs):
    pytest.importorskip("openenv")
    first = check_episodes(*runs.result("openenv_local"))
    assert first.startswith("Echo ready (seed ")
    first = check_episodes(*runs.result("openenv_server"))  # through the server, one session an episode
    assert first.startswith("Echo ready (seed ")


def test_an_openenv_server_that_dies_mid_run_ends_its_episodes_only(files) -> None:
    """A server that dies after five sessions (the start-up check's and the first step's four): the run goes on,
    its later episodes failed; eval.py generate over one that dies mid-way writes every row and exits (the
    clients' close, which blocks on a dead server, is left to their killed workers)."""
    pytest.importorskip("openenv")
    (train_proc, train_url), (eval_proc, eval_url) = start_server(files, "6"), start_server(files, "4")
    try:
        wait_until_up(train_proc, train_url)
        wait_until_up(eval_proc, eval_url)
        out = files / "dying_run"
        r = run_train_here(
            *EPISODES, "--steps", "3", "--env.name", f"openenv:{train_url}", "--out-dir", str(out)
        )
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
        ms = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert (
            [m["env/failed"] for m in ms] == [0, 4, 4] and ms[0]["loss"] is not None and ms[1]["loss"] is None
        )
        gen = files / "dying.jsonl"
        cmd = [sys.executable, str(ROOT / "eval.py"), "generate", "--data", "recipe:calc", "--limit", "5", "--model",
               "tiny", "--max-new-tokens", "6", "--env.name", f"openenv:{eval_url}", "--out", str(gen)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        g = subprocess.run(cmd, cwd=files, env=env, capture_output=True, text=True, timeout=180)
        assert g.returncode == 0 and "Traceback" not in g.stderr, g.stderr[-3000:]
        errors = [json.loads(line)["env_info"]["error"] for line in gen.read_text().splitlines()]
        assert len(errors) == 5 and all("Connect" in e for e in errors), errors  # it died under all five
    finally:
        stop_process_group(train_proc)
        stop_process_group(eval_proc)


# -- reasoning-gym -----------------------------------------------------------------------------------------


def test_reasoning_gym_rows_and_grader():
    pytest.importorskip("reasoning_gym")
    from rewards import RewardConfig, Sample, build_reward

    rows, source = load_task("reasoning_gym:basic_arithmetic,chain_sum", "train")
    held_out, _ = load_task("reasoning_gym:basic_arithmetic,chain_sum", "eval")
    assert (len(rows), len(held_out), source) == (1000, 100, "reasoning_gym:basic_arithmetic,chain_sum:train")
    assert [r["metadata"]["source_dataset"] for r in (rows[0], rows[999])] == [
        "basic_arithmetic",
        "chain_sum",
    ]
    assert rows == load_task("reasoning_gym:basic_arithmetic,chain_sum", "train")[0]  # fixed data
    assert json.loads(json.dumps(rows)) == rows
    system, user = rows[0]["prompt"]  # the answer's format in a system message, then the question
    assert system["role"] == "system" and "<answer>" in system["content"] and "</answer>" in system["content"]
    assert user == {"role": "user", "content": rows[0]["question"]}
    assert {r["id"] for r in rows}.isdisjoint(r["id"] for r in held_out)
    reward = build_reward(RewardConfig(spec="reasoning_gym:1"))
    reward.validate(rows + held_out, source)
    r = rows[0]
    scores, _ = reward([Sample(prompt_text(r["prompt"]), c, 0, r) for c in
                        (f"So <answer>{r['answer']}</answer>", "<answer>-1.5</answer>", r["answer"])])  # fmt: skip
    assert scores == [1.0, 0.0, 0.0]  # the answer outside the tags is not read
    with pytest.raises(ValueError, match=r"f.jsonl:1: field 'metadata' names the task 'nope'"):
        reward.validate([{"prompt": "x", "answer": "1", "metadata": {"source_dataset": "nope"}}], "f.jsonl")
    with pytest.raises(ValueError, match=r"no task 'chainsum'; did you mean chain_sum"):
        load_task("reasoning_gym:chainsum")


def test_reasoning_gym_takes_each_tasks_configuration():
    pytest.importorskip("reasoning_gym")
    rows, source = load_task("reasoning_gym:letter_counting?min_words=2&max_words=3,chain_sum", "eval")
    assert (
        source == "reasoning_gym:letter_counting?min_words=2&max_words=3,chain_sum:eval" and len(rows) == 100
    )
    spans = [len(r["metadata"]["span"]) for r in rows if r["metadata"]["source_dataset"] == "letter_counting"]
    assert len(spans) == 50 and set(spans) <= {2, 3}  # the default is 5 to 15 words
    assert load_task("reasoning_gym:letter_counting?min_words=2&max_words=3", "eval")[0][:3] == rows[:3]
    for spec, message in {
        "letter_counting?min_word=2": r"letter_counting has no setting 'min_word'; its settings: min_words, max_words",
        "letter_counting?size=5": r"no setting 'size'.*the seed and size are nanogrpo's",
        "letter_counting?min_words": r"write 'min_words' as KEY=VALUE",
        "letter_counting?min_words=0": r"letter_counting refuses the configuration \{'min_words': 0\}: min_words must be",
        "chain_sum,chain_sum?min_terms=3": r"name each task once",
    }.items():
        with pytest.raises(ValueError, match=message):
            load_task(f"reasoning_gym:{spec}")


def test_reasoning_gym_trains(runs):
    pytest.importorskip("reasoning_gym")
    metrics, samples = runs.result("reasoning_gym")
    assert [m["step"] for m in metrics] == [1, 2] and all("reward/reasoning_gym" in m for m in metrics)
    assert samples[0]["groups"][0]["prompt"].startswith(
        "system: Solve the problem, then write only the final"
    )


# -- a missing package --------------------------------------------------------------------------------------


def grader_checks(spec: str):
    """The graders of `spec` built and checked on a row, as train.py does before the model loads."""
    from rewards import RewardConfig, build_reward

    row = {"prompt": "1 + 1?", "answer": "2", "metadata": {"source_dataset": "chain_sum"}}
    build_reward(RewardConfig(spec=spec)).validate([row], "rows.jsonl")


@pytest.mark.parametrize(
    "module,package,make",
    [
        ("textarena", "textarena", lambda: make_factory(name="textarena:GuessTheNumber-v0")),
        ("openenv", "openenv-core", lambda: make_factory(name="openenv:http://127.0.0.1:9")),
        ("openenv", "openenv-core", lambda: make_factory(name="openenv:echo_game:Echo")),
        ("reasoning_gym", "reasoning-gym", lambda: load_task("reasoning_gym:chain_sum")),
        ("reasoning_gym", "reasoning-gym", lambda: grader_checks("reasoning_gym:1")),
    ],
)
def test_a_missing_package_is_named_with_its_pip_install(monkeypatch, module, package, make):
    """Whether or not it is installed here: the check finds no `module`."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a)
    )
    with pytest.raises(
        ValueError, match=rf"needs the {package} package: pip install {package} \(or pip install"
    ):
        make()
