"""Mixed tasks in one run: each row scored by its own mix of graders (RLVR math rows next to open-ended ones).

A row may name its task, `"task": "math"`, and `--reward.tasks "math=exact:1;open=keywords:0.5,style:0.5"`
maps each task to its mix, written as `--reward.spec` is. A row without a task uses `--reward.spec`; a
row's own `"reward": "exact:1"` wins over its task's mix. This module only reads the flag and tells which
mix grades a row; `RewardFunction` (rewards/registry.py) builds each mix's graders once, validates every
row against its own mix and scores it with that mix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

TASKS_FORM = "'task=grader:weight,...' separated by ';', e.g. 'math=exact:1;open=keywords:0.5,style:0.5'"
_TASK_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # it becomes part of a metric's name: reward/task/<name>


def task_flag(task: str) -> str:
    """How error messages name one task's mix: "--reward.tasks 'math'"."""
    return f"--reward.tasks '{task}'"


def parse_tasks(text: str) -> dict[str, str]:
    """'math=exact:1; open=rouge_l:1' -> {'math': 'exact:1', 'open': 'rouge_l:1'}: each task's spec as
    written ('' -> {}). Only the syntax of the flag is checked here; `spec.parse_spec` reads each spec."""
    out: dict[str, str] = {}
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        name, sep, spec = part.partition("=")
        name, spec = name.strip(), spec.strip()
        if not (sep and name):
            raise ValueError(f"--reward.tasks: cannot read {part!r}; write {TASKS_FORM}")
        if not _TASK_NAME.fullmatch(name):
            raise ValueError(
                f"--reward.tasks: task name {name!r} may hold only letters, digits, '_', '.' and '-' "
                "(it names the metric reward/task/<name>); rename the task here and in the rows"
            )
        if name in out:
            raise ValueError(f"--reward.tasks: task '{name}' appears twice; give each task one mix")
        if not spec:
            raise ValueError(f"--reward.tasks: task '{name}' names no grader; write e.g. '{name}=rouge_l:1'")
        if "=" in spec:  # 'math=exact:1,open=rouge_l:1': tasks separated by ',' instead of ';'
            raise ValueError(f"--reward.tasks: {part!r} holds two '='; separate tasks with ';': {TASKS_FORM}")
        out[name] = spec
    return out


def route(row: Mapping[str, Any], tasks: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(the row's task or None, the spec of the mix that grades it): the row's own 'reward', else its
    task's spec, else None (--reward.spec). ValueError with the fix, without file and line (the caller
    knows them), for a task not in `tasks` or a field of the wrong type."""
    task, own = row.get("task"), row.get("reward")
    if task is not None:
        if not isinstance(task, str):
            raise ValueError(f"field 'task' must be a task name (a string), got {type(task).__name__}")
        if task not in tasks:
            have = f"its tasks: {', '.join(tasks)}" if tasks else "the flag is empty"
            raise ValueError(
                f"task '{task}' is not in --reward.tasks ({have}); add '{task}=grader:weight' to "
                f"--reward.tasks (e.g. --reward.tasks '{task}=rouge_l:1'), or fix the row's 'task'"
            )
    if own is not None:
        if not isinstance(own, str) or not own.strip():
            raise ValueError(
                f"field 'reward' must be a spec string such as 'exact:1', got {own!r}; fix it, or drop it "
                "to grade the row with its task's mix"
            )
        return task, own.strip()
    return task, (tasks[task] if task is not None else None)
