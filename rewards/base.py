"""The grader interface shared by every reward in rewards/.

A grader reads a batch of completions (with their prompt, group and data row) and returns, per
completion, a score in [0, 1] or None ("does not apply to this row"). None is never turned into 0:
the composite drops the component for that row and renormalises the remaining weights (`combine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nanogrpo_base.rows import turn_text


@dataclass
class Sample:
    """One completion to grade."""

    prompt: str
    """The prompt as plain text (a chat prompt is rendered as 'role: content' lines)."""
    completion: str
    """The model's completion, decoded, without the prompt."""
    group: int = 0
    """Index of the prompt's group in the batch: completions of the same prompt share it."""
    row: dict[str, Any] = field(default_factory=dict)
    """The data row's fields (reference, answer, labels, key_points, rubric, ...)."""
    tokens: int | None = None
    """The completion's length in tokens as sampled (what --sampling.max-new-tokens caps), set by the
    trainer; None where the caller does not know it (graders that need it, like overlong, return None)."""
    turns: list[dict] | None = None
    """A multi-turn episode's transcript, {"role", "content"} messages from the first user message on
    (`completion` is its last assistant turn); None for a single completion."""
    env_reward: float | None = None
    """The episode's reward from its environment (the sum of its steps'); None without one, or when the
    environment failed the episode."""
    env_info: dict[str, Any] = field(default_factory=dict)
    """The episode's facts: reward_range, turns, invalid (steps the environment could not use), done,
    error, and the last step's info."""


def episode(s: Sample) -> tuple[float | None, dict, list | None]:
    """(the environment's reward, its info, the transcript) of a sample, from the Sample or its row."""
    if s.turns is not None:
        return s.env_reward, s.env_info, s.turns
    row = s.row if isinstance(s.row, dict) else {}
    info = row.get("env_info") if isinstance(row.get("env_info"), dict) else {}
    return row.get("env_reward"), info, row.get("turns")


def transcript(s: Sample) -> str:
    """The whole episode as 'role: text' lines after the first message (what the judges read), or the
    completion alone for a single-turn sample."""
    turns = episode(s)[2]
    return turn_text(turns[1:]) if turns else s.completion


class Grader:
    """Base class: subclasses set `name`, `requires` and implement `score`."""

    name: str = ""
    requires: tuple[str, ...] = ()
    """Row fields this grader needs; checked against the data at start-up."""

    def __call__(self, batch: list[Sample]) -> list[float | None]:
        scores = self.score(batch)
        assert len(scores) == len(batch), f"{self.name}: {len(scores)} scores for {len(batch)} samples"
        out: list[float | None] = []
        for s in scores:
            if s is None:
                out.append(None)
            else:
                s = float(s)
                out.append(None if s != s else min(1.0, max(0.0, s)))  # NaN is no score: None; clip to [0, 1]
        return out

    def score(self, batch: list[Sample]) -> list[float | None]:
        raise NotImplementedError

    def check_row(self, row: dict[str, Any]) -> tuple[str, str] | None:
        """(field, what is wrong and how to fix it) when this row cannot be graded, else None.

        Called on every row at start-up; the default checks that each field in `requires` is present.
        """
        for name in self.requires:
            if row.get(name) is None:
                return name, "is missing"
        return None

    def prepare(self, rows: list[dict[str, Any]]) -> None:
        """See the training rows once at start-up (the semantic baseline samples its references here)."""

    def check(self) -> None:
        """At start-up, before any model loads: raise ValueError with the fix when a service this grader
        calls does not answer (a judge's server). Called by `RewardFunction.validate`."""

    def metrics(self) -> dict[str, float]:
        """Extra per-step numbers to log (tokens spent by a judge, unparsable replies, ...).

        Under torchrun they are summed over ranks, so return counts and sums, and the same keys for every
        batch, whatever it holds. A mean is its sum and count, 'x_sum' and 'x_n': `mean_metrics` turns
        them into 'x' after the sum."""
        return {}


def combine(
    scores: Sequence[float | None], weights: Sequence[float], total: float | None = None
) -> float | None:
    """Weighted sum of the available scores, the weights rescaled to keep their total (default: the sum
    of all weights); None when no score with a positive weight is available."""
    avail = [(s, w) for s, w in zip(scores, weights) if s is not None and w > 0]
    wsum = sum(w for _, w in avail)
    if wsum <= 0:
        return None
    total = sum(weights) if total is None else total
    return total * sum(s * (w / wsum) for s, w in avail)  # normalise first: tiny weights stay exact


def check_text_field(row: dict[str, Any], name: str = "reference") -> tuple[str, str] | None:
    """`check_row` for a grader that reads one text field: present and a string."""
    value = row.get(name)
    if value is None:
        return name, "is missing"
    if not isinstance(value, str):
        return name, f"must be a string, got {type(value).__name__}"
    return None
