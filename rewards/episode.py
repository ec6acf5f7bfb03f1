"""Graders of multi-turn episodes (nanogrpo/envs/): the environment's reward, the turns used, the invalid
actions. Each reads the episode from the Sample (`env_reward`, `env_info`, `turns`, set by the episode
rollout) or, for rows scored from a file (eval.py generate writes them), from the row's columns of the same
names; a sample without an episode gets None (the grader does not apply)."""

from __future__ import annotations

from rewards.base import Grader, Sample, episode
from rewards.options import RewardConfig
from rewards.registry import register

OUTCOMES = ("env", "turns", "valid")
"""The graders that report what the environment itself says of an episode (its reward, the turns, the moves it
refused): the game's result, not a learned judge with blind spots a policy can learn, so scoring a policy with
one it trained on inflates nothing (eval.py does not warn about it)."""


class EpisodeGrader(Grader):
    """A grader of one number of an episode, `value(reward, info)`; None for a sample without an episode,
    and for columns of another shape (a hand-edited file) rather than an error."""

    def value(self, reward: float | None, info: dict) -> float | None:
        raise NotImplementedError

    def score(self, batch: list[Sample]) -> list[float | None]:
        out: list[float | None] = []
        for s in batch:
            reward, info, turns = episode(s)
            try:
                out.append(None if turns is None else self.value(reward, info))
            except (TypeError, ValueError, ZeroDivisionError, AttributeError):
                out.append(None)
        return out


class EnvReward(EpisodeGrader):
    """The episode's reward mapped from the environment's reward_range onto [0, 1]; None if it failed."""

    def value(self, reward: float | None, info: dict) -> float | None:
        lo, hi = (float(x) for x in info.get("reward_range", (0.0, 1.0)))
        return None if reward is None or not hi > lo else (float(reward) - lo) / (hi - lo)


class TurnsUsed(EpisodeGrader):
    """1 for an episode that took one turn, down to 0 for one that used every turn it had."""

    def value(self, reward: float | None, info: dict) -> float | None:
        n, most = info.get("turns"), info.get("max_turns")
        return None if not n or not most else 1.0 - (n - 1) / max(1, most - 1)


class Valid(EpisodeGrader):
    """The share of an episode's turns the environment could use (1: no invalid action)."""

    def value(self, reward: float | None, info: dict) -> float | None:
        n = info.get("turns")
        return None if not n else 1.0 - info.get("invalid", 0) / n


@register("env")
def _env(cfg: RewardConfig) -> Grader:
    return EnvReward()


@register("turns")
def _turns(cfg: RewardConfig) -> Grader:
    return TurnsUsed()


@register("valid")
def _valid(cfg: RewardConfig) -> Grader:
    return Valid()
