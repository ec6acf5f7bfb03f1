"""The seed papers' embedded data sets: a few dozen short rows each, in the paper's row format.

`--data.train recipe:NAME` reads NAME.jsonl and `--data.eval recipe:NAME` the held-out NAME.eval.jsonl
(nanogrpo.data.load_task); the presets of nanogrpo/config.py default to them. They show the format and
make a preset run end to end; they are far too small to train a useful model (docs/RECIPES.md).

    python -m nanogrpo.recipes                  # every file, with its path and row count
    python -m nanogrpo.recipes rubric.labels    # the path of one file, for tools that take a path
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECIPES = ("semantic", "judge-numbers", "clinical", "rlvrr", "rubric")  # the seed papers'
ENV_TASKS = (
    "calc",
    "guess",
    "search",
    "research",
)  # the built-in environments' tasks (nanogrpo/envs/builtin.py)


def recipe_path(name: str, split: str = "train") -> Path:
    """The file of recipe `name`: NAME.jsonl for the 'train' split, NAME.eval.jsonl for 'eval'."""
    if name not in RECIPES + ENV_TASKS:
        have = ", ".join(RECIPES + ENV_TASKS)
        raise ValueError(f"no recipe {name!r}: the embedded data sets are {have} (recipe:NAME)")
    if split not in ("train", "eval"):
        raise ValueError(f"recipe split must be 'train' or 'eval', got {split!r}")
    return HERE / (f"{name}.jsonl" if split == "train" else f"{name}.eval.jsonl")


def file_path(stem: str) -> Path:
    """An embedded file by name, with or without '.jsonl': 'rubric.labels' -> .../rubric.labels.jsonl."""
    path = HERE / (stem if stem.endswith(".jsonl") else f"{stem}.jsonl")
    if not path.is_file():
        have = ", ".join(sorted(p.name.removesuffix(".jsonl") for p in HERE.glob("*.jsonl")))
        raise ValueError(f"no embedded file {stem!r}; there are: {have}")
    return path


def main(argv: list[str]) -> int:
    if not argv:
        for path in sorted(HERE.glob("*.jsonl")):
            n = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
            print(f"{path.name.removesuffix('.jsonl'):24s} {n:4d} rows  {path}")
        return 0
    try:
        print(file_path(argv[0]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
