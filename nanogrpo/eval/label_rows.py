"""The label rows of the readouts comparison (nanogrpo/eval/readouts.py), and their splits by question: the
rows' own 'split' fields, a seeded train/dev/test split, or K folds.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanogrpo_base.rows import prompt_text

SPLITS = ("train", "dev", "test")


def read_label_rows(path: str | Path, rubrics: Sequence[str | Path] = ()) -> list[dict[str, Any]]:
    """Label rows with a 'weight' each: the row's own, else its criterion's in --rubrics, else 1."""
    from rewards.probe import read_rows

    rows = read_rows(path)
    for n, r in enumerate(rows, 1):
        if not all(isinstance(r.get(k), str) for k in ("prompt", "response", "criterion")):
            raise ValueError(
                f"{path}: row {n} has no 'prompt', 'response' and 'criterion'; the readouts ask about a criterion "
                "of a response, so 'text' rows cannot be compared (python -m nanogrpo.reward_data label writes the rows)"
            )
    table: dict[tuple[str, str], float] = {}
    for f in rubrics:
        for n, line in enumerate(Path(f).read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                from rewards.rubric import parse_rubric

                row = json.loads(line)
                try:
                    crit = parse_rubric(row.get("rubric"))
                except ValueError as e:
                    raise ValueError(f"{f}:{n}: field 'rubric' {e}") from None
                table.update({(prompt_text(row.get("prompt")), c): w for c, w in crit})
    missing = []
    for r in rows:
        if "weight" not in r:
            w = table.get((r["prompt"], r["criterion"]))
            if w is None and table:
                missing.append(r)
            r["weight"] = 1.0 if w is None else w
        if isinstance(r["weight"], bool) or not isinstance(r["weight"], (int, float)):
            raise ValueError(f"{path}: field 'weight' must be a number, got {r['weight']!r}")
        r["weight"] = abs(float(r["weight"]))
    if missing:
        raise ValueError(
            f"{len(missing)} label rows have no weight in --rubrics (first: criterion {missing[0]['criterion']!r} "
            f"of {missing[0]['prompt'][:60]!r}); give the rubric rows their questions came from, or a 'weight' "
            "field on the label rows"
        )
    return rows


def _order(questions: Sequence[str], seed: int, salt: str = "") -> list[str]:
    """Questions in a seeded order (sha256 of seed, salt and the question): the same for the same inputs."""
    h = lambda q: hashlib.sha256(f"{seed}:{salt}:{q}".encode()).hexdigest()
    return sorted(questions, key=h)


def assign_folds(
    rows: Sequence[dict[str, Any]],
    folds: int = 0,
    test_frac: float = 0.3,
    dev_frac: float = 0.2,
    seed: int = 0,
) -> list[dict[str, list[int]]]:
    """Row indices per fold: [{"train", "dev", "test"}]. Without folds, one: the rows' 'split' fields when
    every row has one, else a seeded split of the questions. With K folds, K: each question in one fold's
    test split, the other questions its train and dev ('split' fields are not read)."""
    questions = list(dict.fromkeys(r["prompt"] for r in rows))
    marked = [r.get("split") for r in rows]
    if folds == 0 and all(s is not None for s in marked):
        bad = sorted({str(s) for s in marked} - set(SPLITS))
        if bad:
            raise ValueError(f"field 'split' must be train, dev or test, got {', '.join(bad)}")
        parts = [{s: [i for i, m in enumerate(marked) if m == s] for s in SPLITS}]
    else:
        if folds == 0 and any(s is not None for s in marked):
            raise ValueError(
                "some rows have a 'split' and some not: give every row one, or none (then the split is seeded)"
            )
        if folds == 1 or folds < 0:
            raise ValueError(f"--folds must be 0 (one split) or at least 2, got {folds}")
        need = max(3, folds)  # every fold needs a test question and two more for train and dev
        while folds and need - math.ceil(need / folds) < 2:
            need += 1
        if len(questions) < need:
            raise ValueError(
                f"{len(questions)} questions cannot be split into train, dev and test"
                + (f" {folds} times" if folds else "")
                + f"; give at least {need} (or fewer --folds)"
            )
        order = _order(questions, seed)
        if folds:
            tests = [order[f::folds] for f in range(folds)]
        else:
            tests = [order[: min(len(order) - 2, max(1, round(test_frac * len(order))))]]
        parts = []
        for f, test in enumerate(tests):
            rest = _order([q for q in questions if q not in set(test)], seed, f"dev{f}")
            n_dev = min(len(rest) - 1, max(1, round(dev_frac * len(rest))))
            split_of = (
                {q: "test" for q in test}
                | {q: "dev" for q in rest[:n_dev]}
                | {q: "train" for q in rest[n_dev:]}
            )
            parts.append({s: [i for i, r in enumerate(rows) if split_of[r["prompt"]] == s] for s in SPLITS})
    for f, part in enumerate(parts):
        for s in SPLITS:
            if not part[s]:
                raise ValueError(
                    f"fold {f}: no {s} rows; give rows of more questions or mark every row's 'split'"
                )
    return parts
