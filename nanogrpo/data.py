"""JSONL datasets: loading with validation, prompt rendering, the built-in demo task, and the prompt order.

A row is one JSON object a line (README "Data"): `prompt` (text or chat messages) is required; the
reference-based graders read `reference`, `answer`, `labels`, `key_points`, `rubric`, ... Bad input is
reported with the file, the line and the field before any model is loaded.

The built-in `demo` task is generated in code, deterministically: short factual questions asked with
"Answer in one word." A small instruct model knows most answers but replies in a full sentence, so
ROUGE-L against the one-word reference spreads within a group from the first step, and GRPO teaches the
model to answer tersely and correctly. Its held-out split asks about other facts.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewards.rows import DataError, check_prompt, read_rows

# field -> (allowed Python types, description used in error messages)
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "id": ((str, int), "a string or an integer"),
    "reference": ((str,), "a string"),
    "references": ((list,), "a list of strings"),
    "answer": ((str, int, float), "a string or a number"),
    "labels": ((list,), "a list of strings"),
    "key_points": ((list,), "a list of lists of keywords"),
    "rubric": ((list,), 'a list of {"criterion": str, "weight": number}'),
    "human": ((int, float), "a number"),
    "chosen": ((str,), "a string"),  # --algo dpo: the preferred answer
    "rejected": ((str,), "a string"),  # --algo dpo: the dispreferred answer
    "options": ((list, dict), 'a list of strings or an object {"A": str, ...}'),  # --algo dpo: an MCQ
}


def validate_row(row: Any, where: str) -> dict:
    """Check one row's shape; `where` is 'file:line' for the error message."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if "prompt" not in row:
        raise DataError(f"{where}: missing field 'prompt' (every row needs the prompt the model answers)")
    check_prompt(row["prompt"], where)
    for name, (types, desc) in _FIELD_TYPES.items():
        if name in row and row[name] is not None and not isinstance(row[name], types):
            raise DataError(f"{where}: field '{name}' must be {desc}, got {type(row[name]).__name__}")
    return row


def load_rows(path: str | Path) -> list[dict]:
    """Read and validate a JSONL file (rewards.rows.read_rows); rows without an `id` get their line number."""
    return read_rows(path, validate_row, what="a JSONL file, one JSON object a line, or 'demo'")


def require_fields(rows: list[dict], fields: set[str] | tuple[str, ...], source: str, who: str) -> None:
    """Refuse at start-up a grader that needs a field the data lacks (`who` names the grader)."""
    for row in rows:
        for name in fields:
            if row.get(name) is None:
                line = row.get("_line", row.get("id"))
                raise DataError(
                    f"{source}:{line}: field '{name}' is missing, and {who} needs it; "
                    f"add it to every row or choose another grader with --reward.spec"
                )


def template_fields(template: str) -> list[str]:
    """The row fields a --data.template names ('<a>{answer}</a>' -> ['answer']); a malformed template
    raises ValueError with the fix."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(f"--data.template {template!r}: {e}; write a literal brace as {{{{ or }}}}") from e
    if any(not n or not n.isidentifier() for n in names):
        raise ValueError(
            f"--data.template {template!r}: each {{...}} must name a row field, e.g. {{answer}}; "
            "write a literal brace as {{ or }}"
        )
    return names


def sft_target(row: dict, template: str = "") -> str:
    """What --algo sft trains on for a row: the template rendered from its fields, or its 'reference'."""
    return template.format(**row) if template else row["reference"]


def check_sft_rows(rows: list[dict], template: str, source: str) -> None:
    """Refuse at start-up a row SFT cannot train on: a template field or the reference missing or empty."""
    names = template_fields(template) if template else ["reference"]
    for row in rows:
        for name in names:
            if row.get(name) in (None, ""):
                line = row.get("_line", row.get("id"))
                how = (
                    f"--data.template {template!r} needs it"
                    if template
                    else "--algo sft trains on 'reference'"
                )
                raise DataError(
                    f"{source}:{line}: field '{name}' is missing or empty, and {how}; add it to every row"
                )


def render_prompt(tokenizer, row: dict, system_prompt: str = "") -> list[int]:
    """Token ids of the prompt: chat messages go through the tokenizer's chat template; text is used as is."""
    p = row["prompt"]
    if isinstance(p, str) and getattr(tokenizer, "chat_template", None) is None:
        return tokenizer(system_prompt + p, add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_prompts(
    rows: list[dict], tokenizer, system_prompt: str, limit: int, long_prompts: str, source: str
) -> int:
    """Render every row's prompt once into `row['_prompt_ids']`, at start-up; a prompt longer than `limit`
    tokens is refused (DataError naming the line) or, with long_prompts='truncate', cut to its last `limit`
    tokens. Returns how many were truncated."""
    cut = 0
    for row in rows:
        ids = render_prompt(tokenizer, row, system_prompt)
        if len(ids) > limit:
            if long_prompts != "truncate":
                line = row.get("_line", row.get("id"))
                raise DataError(
                    f"{source}:{line}: the prompt is {len(ids)} tokens, over the limit of {limit} "
                    "(--data.max-prompt-tokens, or the model's positions less --sampling.max-new-tokens); "
                    "shorten it, or pass --data.long-prompts truncate to keep its last tokens"
                )
            ids, cut = ids[-limit:], cut + 1
        if not ids:
            raise DataError(f"{source}:{row.get('_line', row.get('id'))}: the prompt renders to no tokens")
        row["_prompt_ids"] = ids
    return cut


# ----------------------------------------------------------------------------------------------------------
# the built-in demo task

_FACTS: dict[str, list[tuple[str, str]]] = {
    "What is the capital of {}?": [
        ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
        ("Japan", "Tokyo"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Greece", "Athens"),
        ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Austria", "Vienna"),
        ("Poland", "Warsaw"), ("China", "Beijing"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
        ("Cuba", "Havana"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Belgium", "Brussels"),
        ("Hungary", "Budapest"), ("Thailand", "Bangkok"), ("England", "London"), ("Denmark", "Copenhagen"),
        ("Canada", "Ottawa"), ("Argentina", "Buenos Aires"), ("Turkey", "Ankara"), ("India", "Delhi"),
    ],
    "What is the opposite of {}?": [
        ("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("day", "night"),
        ("open", "closed"), ("happy", "sad"), ("light", "dark"), ("old", "young"), ("rich", "poor"),
        ("early", "late"), ("hard", "soft"), ("full", "empty"), ("wet", "dry"), ("love", "hate"),
        ("win", "lose"), ("left", "right"), ("black", "white"), ("top", "bottom"), ("thick", "thin"),
        ("strong", "weak"), ("loud", "quiet"), ("push", "pull"), ("true", "false"),
    ],
    "What color is {}?": [
        ("the sky on a clear day", "blue"), ("fresh grass", "green"), ("snow", "white"),
        ("a ripe banana", "yellow"), ("coal", "black"), ("a ripe tomato", "red"), ("an orange", "orange"),
        ("milk", "white"), ("a lemon", "yellow"), ("blood", "red"), ("a crow", "black"),
        ("a strawberry", "red"), ("a frog", "green"), ("the sea", "blue"), ("chocolate", "brown"),
        ("a polar bear", "white"),
    ],
    "What is the plural of {}?": [
        ("mouse", "mice"), ("child", "children"), ("foot", "feet"), ("tooth", "teeth"), ("man", "men"),
        ("woman", "women"), ("goose", "geese"), ("person", "people"), ("cat", "cats"), ("box", "boxes"),
        ("leaf", "leaves"), ("knife", "knives"), ("city", "cities"), ("baby", "babies"), ("ox", "oxen"),
        ("wolf", "wolves"),
    ],
    "Which animal says {}?": [
        ("moo", "cow"), ("woof", "dog"), ("meow", "cat"), ("oink", "pig"), ("baa", "sheep"),
        ("quack", "duck"), ("neigh", "horse"), ("hoot", "owl"), ("ribbit", "frog"), ("hiss", "snake"),
        ("roar", "lion"), ("buzz", "bee"),
    ],
    "What is {}?": [
        ("two plus two", "four"), ("three plus four", "seven"), ("five plus five", "ten"),
        ("six minus two", "four"), ("nine minus three", "six"), ("two times three", "six"),
        ("one plus one", "two"), ("eight minus one", "seven"), ("four plus five", "nine"),
        ("ten minus two", "eight"), ("three times three", "nine"), ("seven minus seven", "zero"),
    ],
}  # fmt: skip

DEMO_INSTRUCTION = "Reply with just the answer, one word."


def demo_rows(split: str = "train", seed: int = 1234) -> list[dict]:
    """The built-in task: every fact once, split 75/25 per question type (deterministic)."""
    if split not in ("train", "eval"):
        raise ValueError(f"demo split must be 'train' or 'eval', got {split!r}")
    rows = []
    rng = random.Random(seed)
    for template, facts in _FACTS.items():
        facts = list(facts)
        rng.shuffle(facts)
        n_eval = len(facts) // 4
        chosen = facts[:n_eval] if split == "eval" else facts[n_eval:]
        for subject, answer in chosen:
            question = template.format(subject)
            rows.append(
                {
                    "id": f"demo-{split}-{len(rows)}",
                    "prompt": [{"role": "user", "content": f"{question} {DEMO_INSTRUCTION}"}],
                    "reference": answer,
                    "answer": answer,
                }
            )
    return rows


def load_task(name_or_path: str, split: str = "train") -> tuple[list[dict], str]:
    """Rows of a built-in task ('demo', or 'recipe:NAME': a seed paper's embedded data, nanogrpo/recipes/)
    or a JSONL file, and the source name used in error messages."""
    if name_or_path == "demo":
        return demo_rows(split), f"demo:{split}"
    if name_or_path.startswith("recipe:"):
        from nanogrpo.recipes import recipe_path

        path = recipe_path(name_or_path.removeprefix("recipe:"), split)  # the eval split: NAME.eval.jsonl
        return load_rows(path), str(path)
    return load_rows(name_or_path), str(name_or_path)


@dataclass
class PromptOrder:
    """Which prompts each step sees: a seeded permutation per epoch, and a position that checkpoints save."""

    n: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    pos: int = 0

    def _perm(self) -> list[int]:
        idx = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(idx)
        return idx

    def take(self, k: int) -> list[int]:
        """The next k row indices, crossing epochs as needed."""
        out: list[int] = []
        while len(out) < k:
            perm = self._perm()
            take = min(k - len(out), self.n - self.pos)
            out += perm[self.pos : self.pos + take]
            self.pos += take
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
