"""--algo ppo: being built."""

from __future__ import annotations


def step(run, step: int, rows: list[dict], first: int) -> dict:
    raise ValueError("--algo ppo is not available yet")
