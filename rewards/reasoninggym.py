"""reasoning-gym (pip install reasoning-gym): its procedural tasks as training rows, and its own verifiers as
the `reasoning_gym` grader, for single-turn runs.

    python train.py --data.train reasoning_gym:basic_arithmetic,chain_sum \
        --data.eval reasoning_gym:basic_arithmetic,chain_sum --reward.spec reasoning_gym:1

`--data.train reasoning_gym:TASK[,TASK...]` makes TRAIN_ROWS rows (EVAL_ROWS for the held-out split), the
same share from each task, from reasoning_gym.create_dataset(TASK, seed=..., size=...). The data is fixed:
the train split is seeded TRAIN_SEED, the held-out split EVAL_SEED, far enough apart that no entry repeats
(a task draws entry i from seed + i). A row is {"id", "prompt", "question", "answer", "metadata"}: the
prompt is the question and the line ANSWER_LINE; `metadata` is the entry's own, as JSON (tuples become lists),
which is what the verifier reads back, and names the task in `source_dataset` (a row's `task` field is
--reward.tasks', so it is not used).

The grader takes the last <answer>...</answer> of the completion (reasoning-gym's extract_answer; none: 0)
and scores it with the task's `score_answer(answer, entry)`, in [0, 1]. A row without `answer` and a
`metadata` naming a known task is refused at start-up (where a missing reasoning-gym is named too), and
scored None if it comes anyway. This module is in rewards/ (which imports nothing of nanogrpo), so nanogrpo.data
reads rows from it and `python -m rewards.grade` can score a file of them.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
from functools import cache
from typing import Any

from rewards.base import Grader, Sample
from rewards.options import RewardConfig
from rewards.registry import register

PREFIX = "reasoning_gym:"
TRAIN_ROWS, EVAL_ROWS = 1000, 100
TRAIN_SEED, EVAL_SEED = 0, 1_000_000
ANSWER_LINE = "Give only the final answer between <answer> and </answer> tags."


def _need() -> None:
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ValueError(
            "reasoning_gym needs the reasoning-gym package: pip install reasoning-gym (or pip install -e '.[envs]')"
        )


def tasks_of(name: str) -> list[str]:
    """The task names of 'reasoning_gym:a,b', each checked against reasoning-gym's registry."""
    _need()
    from reasoning_gym.factory import DATASETS

    tasks = [t.strip() for t in name.removeprefix(PREFIX).split(",") if t.strip()]
    if not tasks:
        raise ValueError(f"--data {name!r}: name the tasks, e.g. {PREFIX}basic_arithmetic,chain_sum")
    for t in tasks:
        if t not in DATASETS:
            near = difflib.get_close_matches(t, list(DATASETS), n=3)
            raise ValueError(
                f"--data {name!r}: reasoning-gym has no task {t!r}"
                + (f"; did you mean {', '.join(near)}?" if near else "")
            )
    return tasks


def gym_rows(name: str, split: str = "train") -> list[dict[str, Any]]:
    """The rows of --data.train/--data.eval 'reasoning_gym:TASK[,TASK]' (module docstring)."""
    if split not in ("train", "eval"):
        raise ValueError(f"reasoning_gym split must be 'train' or 'eval', got {split!r}")
    tasks = tasks_of(name)  # first: a clear error when reasoning-gym is not installed
    import reasoning_gym

    total, seed = (TRAIN_ROWS, TRAIN_SEED) if split == "train" else (EVAL_ROWS, EVAL_SEED)
    rows = []
    for k, task in enumerate(tasks):
        size = total // len(tasks) + (k < total % len(tasks))
        for i, entry in enumerate(reasoning_gym.create_dataset(task, seed=seed, size=size)):
            rows.append({
                "id": f"{task}-{split}-{i}",
                "prompt": f"{entry['question']}\n\n{ANSWER_LINE}",
                "question": entry["question"],
                "answer": str(entry["answer"]),
                "metadata": json.loads(json.dumps(entry.get("metadata", {}), default=str)),
            })  # fmt: skip
    return rows


@cache
def _scorer(task: str):
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(task)


class ReasoningGym(Grader):
    """reasoning-gym's verifier of the row's task, on the completion's last <answer>...</answer>."""

    name = "reasoning_gym"
    requires = ("metadata", "answer")

    def check_row(self, row: dict[str, Any]) -> tuple[str, str] | None:
        _need()  # at start-up, before any model loads: the package, named with its pip install
        missing = super().check_row(row)
        if missing:
            return missing[0], f"{missing[1]} (rows from --data.train {PREFIX}TASK carry it)"
        task = row["metadata"].get("source_dataset") if isinstance(row["metadata"], dict) else None
        if not isinstance(task, str):
            return "metadata", "must be the entry's metadata object, naming its task in 'source_dataset'"
        from reasoning_gym.factory import DATASETS

        if task not in DATASETS:
            return "metadata", f"names the task {task!r} (source_dataset), which reasoning-gym does not have"
        return None

    def score(self, batch: list[Sample]) -> list[float | None]:
        from reasoning_gym.utils import extract_answer

        out: list[float | None] = []
        for s in batch:
            row = s.row
            if not isinstance(row.get("metadata"), dict) or "answer" not in row:  # not a reasoning-gym row
                out.append(None)
                continue
            entry = {
                "question": row.get("question", ""),
                "answer": row["answer"],
                "metadata": row["metadata"],
            }
            answer = extract_answer(s.completion)
            try:
                out.append(
                    0.0
                    if answer is None
                    else float(_scorer(row["metadata"]["source_dataset"])(answer=answer, entry=entry))
                )
            except Exception:  # a verifier that cannot read the answer: a wrong answer
                out.append(0.0)
        return out


@register("reasoning_gym")
def _reasoning_gym(cfg: RewardConfig) -> Grader:
    return ReasoningGym()
