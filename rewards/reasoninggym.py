"""reasoning-gym (pip install reasoning-gym): its procedural tasks as training rows, and its own verifiers as
the `reasoning_gym` grader, for single-turn runs.

    python train.py --data.train reasoning_gym:basic_arithmetic,chain_sum \
        --data.eval reasoning_gym:basic_arithmetic,chain_sum --reward.spec reasoning_gym:1
    python train.py --data.train 'reasoning_gym:letter_counting?min_words=3&max_words=5' ...

`--data.train reasoning_gym:TASK[,TASK...]` makes TRAIN_ROWS rows (EVAL_ROWS for the held-out split), the
same share from each task, from reasoning_gym.create_dataset(TASK, seed=..., size=..., **config). A task may
carry its configuration as `TASK?KEY=VALUE&KEY=VALUE` (the fields of the task's config class; a value is read
as JSON where it is JSON, `3`, `true`, `[1, 2]`, else as text), checked before any model loads. The data is
fixed: the train split is seeded TRAIN_SEED, the held-out split EVAL_SEED, far enough apart that no entry
repeats (a task draws entry i from seed + i). A row is {"id", "prompt", "question", "answer", "metadata"}: the
prompt is two messages, the system message SYSTEM_PROMPT, which says where the answer goes (the tags this
grader reads), and the question; `metadata` is the entry's own, as JSON (tuples become lists), which is what
the verifier reads back, and names the task in `source_dataset` (a row's `task` field is --reward.tasks', so it
is not used).

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
SYSTEM_PROMPT = (
    "Solve the problem, then write only the final answer between <answer> and </answer> tags, as in "
    "<answer>your answer</answer>: the text between the tags is what is graded."
)
"""The system message of every row: the answer's format, the tags the grader reads (without it a model that
does not write them scores 0 on every question, and every group is flat)."""


def _need() -> None:
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ValueError(
            "reasoning_gym needs the reasoning-gym package: pip install reasoning-gym (or pip install -e '.[envs]')"
        )


def _split_tasks(text: str) -> list[str]:
    """'a?x=[1,2],b' -> ['a?x=[1,2]', 'b']: the commas outside brackets part the tasks."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in [*parts, text[start:]] if p.strip()]


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def tasks_of(name: str) -> list[tuple[str, dict[str, Any]]]:
    """The tasks of 'reasoning_gym:a,b?key=value&key=value', each (name, its configuration), checked against
    reasoning-gym's registry and each task's config class (its fields; its own validate())."""
    _need()
    import dataclasses

    from reasoning_gym.factory import DATASETS

    tasks = []
    for part in _split_tasks(name.removeprefix(PREFIX)):
        task, _, query = part.partition("?")
        task = task.strip()
        if task not in DATASETS:
            near = difflib.get_close_matches(task, list(DATASETS), n=3)
            raise ValueError(
                f"--data {name!r}: reasoning-gym has no task {task!r}"
                + (f"; did you mean {', '.join(near)}?" if near else "")
            )
        config_cls = DATASETS[task][1]
        fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
        config = {}
        for item in filter(None, query.split("&")):
            key, eq, value = item.partition("=")
            if not eq or key.strip() not in fields:
                what = f"{task} has no setting {key.strip()!r}" if eq else f"write {item!r} as KEY=VALUE"
                raise ValueError(
                    f"--data {name!r}: {what}; its settings: {', '.join(fields) or 'none'} (the seed and size "
                    "are nanogrpo's)"
                )
            config[key.strip()] = _value(value.strip())
        try:  # the configuration checked now, by the task itself, before any model loads
            made = config_cls(**config)
            if hasattr(made, "validate"):
                made.validate()
        except (AssertionError, TypeError, ValueError) as e:
            raise ValueError(f"--data {name!r}: {task} refuses the configuration {config}: {e}") from None
        tasks.append((task, config))
    if not tasks:
        raise ValueError(f"--data {name!r}: name the tasks, e.g. {PREFIX}basic_arithmetic,chain_sum")
    if len({t for t, _ in tasks}) < len(tasks):
        raise ValueError(f"--data {name!r}: name each task once (give it one configuration)")
    return tasks


def gym_rows(name: str, split: str = "train") -> list[dict[str, Any]]:
    """The rows of --data.train/--data.eval 'reasoning_gym:TASK[?KEY=VALUE&...][,TASK...]' (module docstring)."""
    if split not in ("train", "eval"):
        raise ValueError(f"reasoning_gym split must be 'train' or 'eval', got {split!r}")
    tasks = tasks_of(name)  # first: a clear error when reasoning-gym is not installed
    import reasoning_gym

    total, seed = (TRAIN_ROWS, TRAIN_SEED) if split == "train" else (EVAL_ROWS, EVAL_SEED)
    rows = []
    for k, (task, config) in enumerate(tasks):
        size = total // len(tasks) + (k < total % len(tasks))
        for i, entry in enumerate(reasoning_gym.create_dataset(task, seed=seed, size=size, **config)):
            rows.append({
                "id": f"{task}-{split}-{i}",
                "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": entry["question"]}],
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
