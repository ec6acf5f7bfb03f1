"""`python -m nanogrpo.reward_data filter`: drop rows whose own reference scores below a threshold.

RLVRR filters its training data by grading each reference with the reward built from it: "data
filtered out when both the content and style rewards of the reference itself fall below 0.7". Here the
graders are those of --reward.spec (built with rewards.build_reward, with every --reward.* option of
train.py), each scores the row's reference as if it were a completion, and each score is compared
with --threshold on its own (the spec's weights do not matter). --drop-if all-below (the default, the
paper's wording) drops a row only when every grader is below; any-below drops it when one is.

A row some grader cannot read at all (its check fails, e.g. no `key_points`, or its score is None)
is always dropped: train.py would refuse it at start-up. The summary counts the rows dropped by each
reason; the rejected file lists every dropped row with its scores.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import tyro

from nanogrpo.reward_data import rows as io
from nanogrpo_base.ranges import ANY, at_least
from nanogrpo_base.rows import prompt_text
from rewards import RewardConfig, Sample, build_reward


@dataclass(frozen=True)
class FilterArgs:
    """Score each row's own reference with the configured graders; keep the rows that reach the threshold."""

    input: tyro.conf.Positional[str]
    """Input JSONL (the output of keypoints / style / rubric)."""
    out: str
    """Output JSONL: the rows kept, unchanged."""
    reward: RewardConfig = field(default_factory=lambda: RewardConfig(spec="keywords:1,style:1"))
    """The graders (--reward.spec, default 'keywords:1,style:1') and their options, as train.py takes them."""
    threshold: Annotated[float, ANY] = 0.7
    """A grader's score of the reference below this counts as failing (RLVRR: 0.7)."""
    drop_if: Literal["all-below", "any-below"] = "all-below"
    """Drop a row when every grader fails (RLVRR's 'both ... fall below 0.7') or when any one does."""
    batch_size: Annotated[int, at_least(1)] = 64
    """References scored per grader call."""
    limit: Annotated[int, at_least(0, "0 = all")] = 0
    """Only the first N rows (0 = all)."""


def run(args: FilterArgs) -> dict[str, Any]:
    """Filter the rows; write the kept ones and the dropped ones; print the counts by reason."""
    rejected_path, _ = io.out_paths(args.out, args.input)
    cfg = replace(args.reward, max_empty_steps=0)
    reward = build_reward(cfg)
    graders = reward.graders
    rows = io.load(args.input, args.limit)
    reward.check()  # a judge server among the graders: stop now if it is down
    readable: list[dict] = []
    why: dict[int, str] = {}  # id(row) -> why no grader may score it
    for row in rows:
        for name, g in graders.items():
            bad = g.check_row(row)
            if bad is not None:
                why[id(row)] = f"{name}: field '{bad[0]}' {bad[1]}"
                break
        else:
            readable.append(row)
    for g in graders.values():
        g.prepare(readable)
    scores: dict[int, dict[str, float | None]] = {id(r): {} for r in readable}
    for part in io.chunks(readable, args.batch_size, "filter"):
        refs = [io.references(r) for r in part]
        batch = [
            Sample(prompt_text(r.get("prompt", "")), (ref or [""])[0], i, r)
            for i, (r, ref) in enumerate(zip(part, refs))
        ]
        for name, g in graders.items():
            for r, s in zip(part, g(batch)):
                scores[id(r)][name] = s
    kept, rejects, reasons = [], io.Rejects(args.input, []), Counter()
    for row in rows:
        if id(row) in why:
            reason = why[id(row)]
        else:
            sc = scores[id(row)]
            unscored = [n for n, s in sc.items() if s is None]
            below = [n for n, s in sc.items() if s is not None and s < args.threshold]
            failed = unscored + below
            drop = unscored or (failed and (args.drop_if == "any-below" or len(failed) == len(sc)))
            if not drop:
                kept.append(io.clean(row))
                continue
            reason = ", ".join(
                [f"{n} gives no score" for n in unscored] + [f"{n} < {args.threshold:g}" for n in below]
            )
        reasons[reason] += 1
        rejects.add(row, reason)
        if id(row) in scores:
            rejects.items[-1]["scores"] = scores[id(row)]
    io.write_jsonl(args.out, kept)
    if rejects.items:  # not one line a row on the console: that would drown the counts
        io.write_jsonl(rejected_path, rejects.items)
    elif rejected_path.exists():
        rejected_path.unlink()
    print(f"filter: {len(kept)} of {len(rows)} rows kept in {args.out}, {len(rows) - len(kept)} dropped"
          + (f" (listed in {rejected_path})" if rejects.items else "")
          + f"; graders {', '.join(graders)}, threshold {args.threshold:g}, drop if {args.drop_if}")  # fmt: skip
    for reason, n in reasons.most_common():
        print(f"  {n:6d}  {reason}")
    return {"kept": len(kept), "dropped": len(rows) - len(kept), "reasons": dict(reasons)}
