"""Graders of multi-turn episodes (nanogrpo/envs/): the environment's reward, the turns used, the invalid
actions. Each reads the episode from the Sample (`env_reward`, `env_info`, `turns`, set by the episode
rollout) or, for rows scored from a file (eval.py generate writes them), from the row's columns of the same
names; a sample without an episode gets None (the grader does not apply)."""

from __future__ import annotations

from rewards.base import Grader, Sample, episode
from rewards.options import RewardConfig
from rewards.registry import register


class EnvReward(Grader):
    """The episode's reward mapped from the environment's reward_range onto [0, 1]."""

    def score(self, batch: list[Sample]) -> list[float | None]:
        out: list[float | None] = []
        for s in batch:
            r, info, _ = episode(s)
            lo, hi = info.get("reward_range", (0.0, 1.0))
            out.append(None if r is None or not hi > lo else (float(r) - lo) / (hi - lo))
        return out


class TurnsUsed(Grader):
    """1 for an episode that took one turn, down to 0 for one that used every turn it had."""

    def score(self, batch: list[Sample]) -> list[float | None]:
        out: list[float | None] = []
        for s in batch:
            _, info, turns = episode(s)
            n, most = info.get("turns"), info.get("max_turns")
            out.append(None if turns is None or not n or not most else 1.0 - (n - 1) / max(1, most - 1))
        return out


class Valid(Grader):
    """The share of an episode's turns the environment could use (1: no invalid action)."""

    def score(self, batch: list[Sample]) -> list[float | None]:
        out: list[float | None] = []
        for s in batch:
            _, info, turns = episode(s)
            n = info.get("turns")
            out.append(None if turns is None or not n else 1.0 - info.get("invalid", 0) / n)
        return out


@register("env")
def _env(cfg: RewardConfig) -> Grader:
    return EnvReward()


@register("turns")
def _turns(cfg: RewardConfig) -> Grader:
    return TurnsUsed()


@register("valid")
def _valid(cfg: RewardConfig) -> Grader:
    return Valid()
