"""The completions of a logged step as a table: what W&B (a table) and TensorBoard (markdown, its text
tab) show of samples.jsonl's groups (nanogrpo.infra.metrics.Logger.log_samples).
"""

from __future__ import annotations

from typing import Any

from nanogrpo_base.rows import json_safe, turn_text


def completion_text(c: dict) -> str:
    """A logged completion's text; an episode's (it has `turns`) is its transcript, turn by turn."""
    return turn_text(c["turns"]) if c.get("turns") else str(c.get("text", ""))


def sample_rows(groups: list[dict]) -> tuple[list[str], list[list]]:
    """The logged groups as a table: the grader names (in order of first appearance) and one row per
    completion: prompt, completion, each grader's score, advantage, reward."""
    graders: list[str] = []
    for g in groups:
        for c in g.get("completions") or []:
            graders += [k for k in c.get("scores") or {} if k not in graders]
    rows = [
        [g.get("prompt"), completion_text(c), *[(c.get("scores") or {}).get(k) for k in graders]]
        + [c.get("advantage"), c.get("reward")]
        for g in groups
        for c in g.get("completions") or []
    ]
    return graders, [[json_safe(v) for v in r] for r in rows]


def _md_cell(v: Any) -> str:
    """A markdown table cell: numbers to 3 decimals, None as '-', pipes escaped, newlines as <br>."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v).replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")


def samples_markdown(groups: list[dict]) -> str:
    """The step's completions as a markdown table (TensorBoard's text tab renders it)."""
    graders, rows = sample_rows(groups)
    head = ["prompt", "completion", *graders, "advantage", "reward"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_md_cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
