"""Structure checks from Shaping Explanations: `format` (the XML tags are there, well formed, in order) and
`think` (a non-empty reasoning block). Both are 0/1 and need no row field.

format: the configured tags (--reward.format-tags, e.g. think spiegazione risposta) must each appear
exactly once as <tag>...</tag>, one after the other in the configured order, none inside another.
Text around and between the blocks is allowed. Where the chat template opens <think> in the prompt
(Qwen3, DeepSeek-R1), a completion that starts inside the think block and closes it counts as having
opened it. Shaping Explanations does not spell its rule out; "correctly uses the required XML tags" is read here as
this order-and-nesting check.

think: the reasoning block (<think>...</think>, or the text before a lone </think>) holds something
other than white space.
"""

from __future__ import annotations

import re

from rewards.base import Grader, Sample
from rewards.options import RewardConfig
from rewards.registry import register
from rewards.text import think_content


class Format(Grader):
    requires = ()

    def __init__(self, cfg: RewardConfig):
        tags = tuple(t.strip() for t in cfg.format_tags if t.strip())
        if not tags:
            raise ValueError(
                "--reward.format-tags is empty; name the tags, e.g. --reward.format-tags think answer"
            )
        if len(set(tags)) != len(tags):
            raise ValueError(f"--reward.format-tags {tags} repeats a tag; give each tag once, in order")
        self.tags = tags
        self.implicit_open = tags[0] == cfg.think_tag
        alt = "|".join(re.escape(t) for t in tags)
        # a tag: <name>, <name attr=...>, <name > or </name>, names compared case-insensitively. One
        # quantifier after the name: '[^<>]*' already takes trailing spaces, and a '\s*' after it would
        # retry every split of a run of spaces ('<think' + 1 MB of spaces took minutes).
        self.tag_re = re.compile(rf"<(/?)({alt})(?:\s[^<>]*)?>", re.IGNORECASE)

    def ok(self, text: str) -> bool:
        want = [(c, t.lower()) for t in self.tags for c in ("", "/")]
        seen = [(m.group(1), m.group(2).lower()) for m in self.tag_re.finditer(text)]
        if self.implicit_open and seen[:1] == [("/", want[0][1])]:
            seen = [want[0], *seen]
        return seen == want

    def score(self, batch: list[Sample]) -> list[float | None]:
        return [float(self.ok(s.completion)) for s in batch]


class Think(Grader):
    requires = ()

    def __init__(self, cfg: RewardConfig):
        if not cfg.think_tag.strip():
            raise ValueError("--reward.think-tag is empty; the think grader needs a tag name, e.g. 'think'")
        self.tag = cfg.think_tag.strip()

    def score(self, batch: list[Sample]) -> list[float | None]:
        out: list[float | None] = []
        for s in batch:
            body = think_content(s.completion, self.tag)
            out.append(float(body is not None and bool(body.strip())))
        return out


@register("format")
def _format(cfg: RewardConfig) -> Grader:
    return Format(cfg)


@register("think")
def _think(cfg: RewardConfig) -> Grader:
    return Think(cfg)
