"""Small environments for the tests of nanogrpo/envs/ (loaded with --env.spec tests/env_examples.py:NAME)."""

from __future__ import annotations

import time

from nanogrpo.envs import Environment, Step


class Vowels(Environment):
    """Two turns, answered 'go on' after the first; reward: the share of vowels in the last turn, so the
    rewards of a group spread and the tiny model gets a gradient. Its first message names the seed."""

    max_turns, stop, role, reward_range = 2, (), "user", (0.0, 1.0)

    def reset(self, row: dict, seed: int) -> str:
        self.turn = 0
        return f"Situation {seed % 1000}: say something."

    def step(self, text: str) -> Step:
        self.turn += 1
        if self.turn < 2:
            return Step("go on", 0.0, False, {})
        share = sum(c in "aeiou" for c in text.lower()) / max(1, len(text))
        return Step(None, share, True, {})


class Endless(Environment):
    """Never done: only the budgets end it."""

    max_turns, stop, role, reward_range = 5, (), "tool", (0.0, 1.0)

    def reset(self, row: dict, seed: int) -> None:
        return None

    def step(self, text: str) -> Step:
        return Step("again", 0.1, False, {"invalid": len(text) % 2 == 0})


class Faulty(Environment):
    """Fails on a first turn of odd length (so some members of a group fail, others not): raises, hangs or
    returns NaN (`mode`, set on the class before the workers fork). A good episode ends itself on its second
    turn with 0.5 + 0.5 (not cut by the budget, so it scores its rewards, not --env.truncated-score)."""

    max_turns, stop, role, reward_range = 2, (), "user", (0.0, 1.0)
    mode = "raise"

    def reset(self, row: dict, seed: int) -> None:
        self.bad, self.turns = None, 0
        return None

    def step(self, text: str) -> Step:
        self.turns += 1
        if self.bad is None:
            self.bad = len(text) % 2 == 1
        if self.bad and self.mode == "raise":
            raise RuntimeError("the environment broke")
        if self.bad and self.mode == "hang":
            time.sleep(30)
        return Step("ok", float("nan") if self.bad else 0.5, self.turns == self.max_turns, {})


class Tools(Environment):
    """A tool environment as the tool adapters report one: each step's info counts the turn's tool calls
    (`tool_calls`) and names a call it could not parse (`tool_parse_error`). By the turn's length: a call, an
    unparsable one, or none; never done, so a budget ends every episode. `calls` False: no turn ever calls."""

    max_turns, stop, role, reward_range = 3, (), "tool", (0.0, 1.0)
    calls = True

    def reset(self, row: dict, seed: int) -> None:
        return None

    def step(self, text: str) -> Step:
        kind = len(text) % 3 if self.calls else 2
        if kind == 0:
            return Step("42", 0.2, False, {"tool_calls": 1})
        if kind == 1:
            return Step(
                '{"error": "not JSON"}', 0.0, False, {"tool_calls": 0, "tool_parse_error": "not JSON"}
            )
        return Step("no call", 0.0, False, {"tool_calls": 0})


class NoCalls(Tools):
    """The model never calls a tool."""

    calls = False
