"""`eval.py grade`: score rows you wrote yourself, and see whether the grader ranks them as you do.

    python eval.py grade --grader rouge_l --data rows.jsonl
    python -m rewards.grade --grader 'judge:0.7,rouge_l:0.3' --data rows.jsonl --reward.answer-tag risposta

Each row is a data row (README "Data") plus the `completion` to grade. One JSON object a line goes
to stdout: {"id": ..., "score": float | null, "components": {grader: float | null}}. A summary, and
with a `human` column the agreement with you, goes to stderr:

- Kendall's tau-b between grader and human scores over all rows both scored (ties corrected);
- pairwise accuracy within groups: for every pair of rows in one group that you scored differently,
  does the grader order them the same way (a grader tie counts half)? GRPO only uses differences
  between the answers to one prompt, so this is the number that matters. A group is the rows with the
  same `group` field if the rows have one, else the same `prompt`; rows with neither form one group.
- the rows where grader and human disagree most: the largest gaps between their percentile ranks.

Rows are graded in batches of whole groups (a group judge sees all answers to a prompt at once).
A bad row stops everything with its file, line and field, before any grader runs.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from nanogrpo_base.ranges import at_least, check_ranges
from nanogrpo_base.rows import DataError, check_prompt, prompt_text
from nanogrpo_base.rows import read_rows as read_rows_checked
from rewards import RewardConfig, Sample, build_reward
from rewards.agreement import kendall_tau_b, pairwise_accuracy
from rewards.registry import mean_metrics


@dataclass
class GradeArgs:
    """Score a JSONL file of completions with a grader; with a `human` column, report agreement."""

    data: Path
    """JSONL rows: the data row's fields plus `completion` (the text to grade); optional `human`, `group`, `id`."""
    grader: str = ""
    """Grader name or weighted mix, e.g. 'rouge_l' or 'judge:0.7,rouge_l:0.3'; '' uses --reward.spec."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Grader options (the same --reward.* flags as train.py)."""
    batch_size: Annotated[int, at_least(1)] = 64
    """Completions per grader call (whole groups are kept together)."""
    top: Annotated[int, at_least(0)] = 5
    """How many of the rows where grader and human disagree most to list."""
    json: str = ""
    """Also write the agreement with `human` (n, kendall_tau, pairwise_accuracy, pairs, disagreements) to this JSON file."""


def _check_graded_row(row: dict, where: str) -> None:
    """A row to grade: a `completion` string; `human` a number; `prompt`, where given, as train.py wants it."""
    if not isinstance(row.get("completion"), str):
        got = "missing" if row.get("completion") is None else f"of type {type(row['completion']).__name__}"
        raise DataError(f"{where}: field 'completion' is {got}; each row needs the text to grade as a string")
    h = row.get("human")
    if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float))):
        raise DataError(f"{where}: field 'human' must be a number (your score), got {h!r}")
    if "prompt" in row and row["prompt"] is not None:
        check_prompt(row["prompt"], where)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows to grade; DataError (a ValueError) naming the file, the line and the field on bad input."""
    return read_rows_checked(
        path, _check_graded_row, what="a JSONL file: one JSON object a line with a `completion`"
    )


def group_keys(rows: list[dict]) -> list[str]:
    """The group of each row: its `group` field, else its prompt (see the module docstring)."""
    if any("group" in r for r in rows):
        return [json.dumps(r.get("group"), sort_keys=True) for r in rows]
    return [prompt_text(r.get("prompt")) for r in rows]


def score_rows(reward, rows: list[dict], groups: list[str], batch_size: int):
    """(rewards, components) for every row, in file order, scored in batches of whole groups."""
    order: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        order.setdefault(g, []).append(i)
    gid = {g: k for k, g in enumerate(order)}
    scores: list[float | None] = [None] * len(rows)
    comps: list[dict[str, float | None]] = [{} for _ in rows]
    pending: list[int] = []
    for k, (_, idx) in enumerate(order.items()):
        pending += idx
        if len(pending) < batch_size and k < len(order) - 1:
            continue
        batch = [
            Sample(prompt_text(rows[i].get("prompt")), rows[i]["completion"], gid[groups[i]], rows[i])
            for i in pending
        ]
        r, c = reward(batch)
        for j, i in enumerate(pending):
            scores[i] = r[j]
            comps[i] = {name: col[j] for name, col in c.items()}
        pending = []
    return scores, comps


def percentile_ranks(values: list[float]) -> list[float]:
    """Average ranks scaled to [0, 1] (ties share their mean rank)."""
    n = len(values)
    order = sorted(range(n), key=lambda i: values[i])
    ranks = [0.0] * n
    i = 0
    while i < n:
        j = i
        while j + 1 < n and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return [r / (n - 1) if n > 1 else 0.5 for r in ranks]


def agreement(rows, scores, groups, top: int) -> dict[str, Any]:
    """Kendall tau-b, pairwise accuracy within groups and the largest disagreements (None/nan if n/a)."""
    both = [i for i, r in enumerate(rows) if r.get("human") is not None and scores[i] is not None]
    out: dict[str, Any] = {"n": len(both), "kendall_tau": None, "pairwise_accuracy": None, "pairs": 0}
    out["disagreements"] = []
    if len(both) < 2:
        return out
    g = [scores[i] for i in both]
    h = [float(rows[i]["human"]) for i in both]
    tau = kendall_tau_b(g, h)
    acc, pairs = pairwise_accuracy(g, h, [groups[i] for i in both])
    out.update(kendall_tau=tau if tau == tau else None, pairwise_accuracy=acc if pairs else None, pairs=pairs)
    pg, ph = percentile_ranks(g), percentile_ranks(h)
    gaps = {k: abs(pg[k] - ph[k]) for k in range(len(both))}
    for k in [k for k in sorted(gaps, key=lambda k: -gaps[k]) if gaps[k] > 0][: max(top, 0)]:
        row = rows[both[k]]
        out["disagreements"].append(
            {"id": row["id"], "line": row["_line"], "score": g[k], "human": h[k], "rank_gap": gaps[k]}
        )
    return out


def agreement_lines(agree: dict[str, Any], rows: list[dict]) -> list[str]:
    """The agreement report as text for the terminal."""
    lines = [f"agreement with `human` on {agree['n']} rows (rows without a score or a human mark left out)"]
    if agree["n"] < 2:
        return [*lines, "  too few rows to compare: score at least two answers yourself"]
    tau, acc = agree["kendall_tau"], agree["pairwise_accuracy"]
    lines.append(
        f"  Kendall tau-b        {tau:+.3f}" if tau is not None else "  Kendall tau-b        n/a (constant)"
    )
    if acc is not None:
        lines.append(
            f"  pairwise accuracy    {acc:.3f} over {agree['pairs']} pairs within groups (0.5 = chance)"
        )
    else:
        lines.append("  pairwise accuracy    n/a (no group has two rows you scored differently)")
    if agree["disagreements"]:
        lines.append("  largest disagreements (score, human, gap between their percentile ranks):")
    by_line = {r["_line"]: r for r in rows}
    for d in agree["disagreements"]:
        text = " ".join(by_line[d["line"]]["completion"].split())
        text = text[:70] + ("..." if len(text) > 70 else "")
        lines.append(
            f"    id {d['id']!s:>6}  {d['score']:.3f}  {d['human']:g}  gap {d['rank_gap']:.2f}  {text!r}"
        )
    return lines


def run(args: GradeArgs) -> int:
    """Grade `args.data`; print rows to stdout and the report to stderr. Returns the exit status."""
    cfg = dataclasses.replace(args.reward, spec=args.grader) if args.grader else args.reward
    try:
        check_ranges(args)  # each number in the range on its field (nanogrpo_base/ranges.py)
        reward = build_reward(cfg)
        rows = read_rows(Path(args.data))
        reward.validate(rows, str(args.data))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    groups = group_keys(rows)
    scores, comps = score_rows(reward, rows, groups, max(1, args.batch_size))
    for row, s, c in zip(rows, scores, comps):
        print(json.dumps({"id": row["id"], "score": s, "components": c}, ensure_ascii=False))
    sys.stdout.flush()
    got = [s for s in scores if s is not None]
    mean = f"mean {sum(got) / len(got):.3f}" if got else "no row scored"
    report = [
        f"graded {len(rows)} rows with {cfg.spec!r}: {mean}, {len(rows) - len(got)} not applicable (null)"
    ]
    report += [f"  {k} {'-' if v is None else f'{v:g}'}" for k, v in mean_metrics(reward.metrics()).items()]
    if any(r.get("human") is not None for r in rows):
        agree = agreement(rows, scores, groups, args.top)
        report += agreement_lines(agree, rows)
        if args.json:
            Path(args.json).write_text(
                json.dumps(agree, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
            )
    print("\n".join(report), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    import tyro

    return run(tyro.cli(GradeArgs, args=argv, description=__doc__.split("\n\n")[0]))


if __name__ == "__main__":
    sys.exit(main())
