"""Checks against one right answer: exact, contains, label, json (guide 001; answer tag from Shaping Explanations).

All four read the answer part of the completion: the content of the last `<answer>` block (any tag
by --reward.answer-tag, e.g. 'risposta' for Shaping Explanations' <risposta>), or the last match of
--reward.answer-regex. When the completion has no such part they read the whole completion without its
think block, unless --reward.answer-strict, which scores 0 instead (combine with `format` to reward the
tag itself). Scores are all-or-nothing: the cleanest signal GRPO can get when one answer is right.

- exact: normalised answer == normalised `answer` (any of them when `answer` is a list).
- contains: the normalised `answer` occurs in the normalised answer part, on word boundaries
  ('B' is not contained in 'But').
- label: the normalised answer is one of the labels (--reward.labels, else the row's `labels`).
- json: the answer part (code fences allowed) parses as JSON, and is an object holding every key of
  --reward.json-keys when they are given. Needs no row field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rewards.base import Grader, Sample
from rewards.options import RewardConfig
from rewards.registry import register
from rewards.text import NORMALIZE_STEPS, extract, normalize, strip_think


class _AnswerGrader(Grader):
    """Shared answer extraction and normalisation."""

    def __init__(self, cfg: RewardConfig):
        bad = set(cfg.normalize) - set(NORMALIZE_STEPS)
        if bad:
            raise ValueError(
                f"--reward.normalize: unknown steps {sorted(bad)}; choose from {NORMALIZE_STEPS}"
            )
        if cfg.answer_regex:
            try:
                re.compile(cfg.answer_regex)
            except re.error as e:
                raise ValueError(
                    f"--reward.answer-regex {cfg.answer_regex!r} does not compile: {e}"
                ) from None
        self.cfg = cfg

    def answer_part(self, completion: str) -> str | None:
        cfg = self.cfg
        got = extract(completion, cfg.answer_tag, cfg.answer_regex)
        if got is None and not cfg.answer_strict:
            got = strip_think(completion, cfg.think_tag)
        return got

    def norm(self, text: Any) -> str:
        return normalize(str(text), tuple(self.cfg.normalize))


def _answers(row: dict) -> list[Any]:
    a = row.get("answer")
    if a is None:
        return []
    return list(a) if isinstance(a, list) else [a]


def _check_answer(row: dict) -> tuple[str, str] | None:
    a = row.get("answer")
    if a is None:
        return "answer", "is missing"
    if isinstance(a, bool) or not isinstance(a, (str, int, float, list)):
        return "answer", f"must be a string or a number, got {type(a).__name__}"
    return None


class Exact(_AnswerGrader):
    requires = ("answer",)

    def check_row(self, row):
        return _check_answer(row)

    def score(self, batch: list[Sample]) -> list[float | None]:
        out: list[float | None] = []
        for s in batch:
            gold = {self.norm(a) for a in _answers(s.row)}
            if not gold:
                out.append(None)
                continue
            got = self.answer_part(s.completion)
            out.append(float(got is not None and self.norm(got) in gold))
        return out


class Contains(_AnswerGrader):
    requires = ("answer",)

    def check_row(self, row):
        return _check_answer(row)

    def score(self, batch: list[Sample]) -> list[float | None]:
        out: list[float | None] = []
        for s in batch:
            gold = [g for g in (self.norm(a) for a in _answers(s.row)) if g]
            if not gold:
                out.append(None)
                continue
            got = self.answer_part(s.completion)
            hay = f" {self.norm(got)} " if got is not None else ""
            # word boundaries need spaces: without the 'space' step, plain substring search
            sep = " " if "space" in self.cfg.normalize else ""
            out.append(float(any(f"{sep}{g}{sep}" in hay for g in gold)))
        return out


class Label(_AnswerGrader):
    def __init__(self, cfg: RewardConfig):
        super().__init__(cfg)
        self.fixed = {self.norm(x) for x in cfg.labels}
        self.requires = () if cfg.labels else ("labels",)

    def check_row(self, row):
        if self.fixed:
            return None
        labels = row.get("labels")
        if labels is None:
            return "labels", "is missing (or pass the label set with --reward.labels)"
        if (
            not isinstance(labels, list)
            or not labels
            or not all(isinstance(x, (str, int, float)) for x in labels)
        ):
            return "labels", 'must be a non-empty list of strings, e.g. ["yes", "no", "maybe"]'
        return None

    def score(self, batch: list[Sample]) -> list[float | None]:
        out: list[float | None] = []
        for s in batch:
            labels = self.fixed
            if not labels:
                raw = s.row.get("labels")
                labels = {self.norm(x) for x in raw} if isinstance(raw, list) else set()
            if not labels:
                out.append(None)
                continue
            got = self.answer_part(s.completion)
            out.append(float(got is not None and self.norm(got) in labels))
        return out


_INFO = re.compile(r"[\w-]*[ \t]*\n?")  # what may follow an opening fence: '```json\n', '```python3 \n'


def unfenced(text: str) -> str | None:
    """The content of a text that is one fenced code block ('```json\\n{...}\\n```', with whitespace around
    it allowed), else None.

    Found by hand, in time linear in the text: the one regular expression that did this,
    '^\\s*```[\\w-]*[ \\t]*\\n?(.*?)\\n?```\\s*$', retried every split of a run of spaces after the fence
    against every end of the content (4.6 s of CPU for a fence and 16,000 spaces, 30 s for 64 KB). The
    result is the same: the block opens with the first ``` and closes with the last, and the newlines
    next to the fences are not content.
    """
    body = text.strip()  # str.strip() drops exactly the characters of the regex's \s
    if len(body) < 6 or not body.startswith("```") or not body.endswith("```"):
        return None
    start = _INFO.match(body, 3).end()  # stops at the closing fence at the latest: no class holds '`'
    end = len(body) - 3
    if end > start and body[end - 1] == "\n":
        end -= 1
    return body[start:end]


class Json(_AnswerGrader):
    requires = ()

    def score(self, batch: list[Sample]) -> list[float | None]:
        out: list[float | None] = []
        for s in batch:
            got = self.answer_part(s.completion)
            if got is None:
                out.append(0.0)
                continue
            inner = unfenced(got)
            try:
                obj = json.loads(got if inner is None else inner)
            except (ValueError, RecursionError):  # RecursionError: '[[[[...' thousands deep
                out.append(0.0)
                continue
            keys = self.cfg.json_keys
            out.append(float(not keys or (isinstance(obj, dict) and all(k in obj for k in keys))))
        return out


@register("exact")
def _exact(cfg: RewardConfig) -> Grader:
    return Exact(cfg)


@register("contains")
def _contains(cfg: RewardConfig) -> Grader:
    return Contains(cfg)


@register("label")
def _label(cfg: RewardConfig) -> Grader:
    return Label(cfg)


@register("json")
def _json(cfg: RewardConfig) -> Grader:
    return Json(cfg)
