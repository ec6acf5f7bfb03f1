"""Datasets: the rows of a task, column renaming, SFT targets, preference pairs, prompt rendering and the
prompt order.

Rows are read and checked by nanogrpo/formats.py (JSONL, CSV, Parquet, datasets folders, the HF cache); the
built-in `demo` task and the recipes' embedded data live in nanogrpo/recipes/. This file holds what the
stages read from a row: the SFT target, the DPO pair (a row's `chosen`/`rejected`, or a multiple-choice
question's correct and wrong options; nanogrpo/reward_data/convert.py reads an answer the same way), and the
prompt's tokens.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from nanogrpo.config import TrainConfig
from nanogrpo.formats import load_rows
from nanogrpo.model.zoo import load_tokenizer, resolve_model
from nanogrpo.policy import prompt_limit
from nanogrpo_base.rows import DataError


def column_map(data_cfg) -> dict[str, str]:
    """Source column -> row field, from --data.rename 'src=dst,...' and --data.prompt-field,
    --data.reference-field, --data.answer-field (these win over a rename of the same column); a malformed
    --data.rename raises ValueError with the fix."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in getattr(data_cfg, "rename", "").split(","))):
        src, eq, dst = (x.strip() for x in part.partition("="))
        if not (eq and src and dst):
            raise ValueError(
                f"--data.rename {data_cfg.rename!r}: write 'src=dst,...', e.g. 'question=prompt'"
            )
        out[src] = dst
    for dst in ("prompt", "reference", "answer"):
        src = getattr(data_cfg, f"{dst}_field", "")
        if src:
            out[src] = dst
    if len(set(out.values())) < len(out):
        raise ValueError(f"--data.rename / --data.*-field map two columns to one field: {out}")
    return {s: d for s, d in out.items() if s != d}


def preference_texts(row: dict, where: str) -> tuple[str, list[str]]:
    """The chosen text and the rejected candidates of a row (its `rejected`, or every wrong option);
    DataError naming `where` ('file:line') when the row has neither form or a bad one."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if chosen is not None or rejected is not None:
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(text, str) or not text.strip():
                raise DataError(
                    f"{where}: field '{name}' is missing or empty; a preference row needs both 'chosen' and "
                    "'rejected' as non-empty strings"
                )
        if chosen.strip() == rejected.strip():
            raise DataError(
                f"{where}: 'chosen' and 'rejected' are the same text, so the pair teaches nothing; "
                "fix the pair or drop the row"
            )
        return chosen, [rejected]
    if row.get("options") is None:
        raise DataError(
            f"{where}: --algo dpo needs 'chosen' and 'rejected' texts, or a multiple-choice question with "
            "'options' and 'answer'; the row has neither"
        )
    texts, k = correct_option(row["options"], row.get("answer"), where)
    wrong = [t for t in texts if t.strip() != texts[k].strip()]
    if not wrong:
        raise DataError(
            f"{where}: every option reads as the answer {texts[k]!r}: no wrong option to reject; "
            "give at least one distinct wrong option"
        )
    return texts[k], wrong


def correct_option(options: list | dict, answer: object, where: str) -> tuple[list[str], int]:
    """The option texts and the index of the correct one.

    `answer` names it by its text, by its label (a list's options are lettered A, B, C, ...; an object's
    labels are its keys; both compared ignoring case), or, for a list, by its 0-based index. Every reading
    that matches must name the same option, else the row is refused: ["1", "2"] with answer 1 could be
    index 1 ("2") or the text "1"."""
    if isinstance(options, dict):
        labels, texts = [str(key) for key in options], list(options.values())
    elif isinstance(options, list):
        labels, texts = list(string.ascii_uppercase[: len(options)]), list(options)
        labels += [""] * (len(texts) - len(labels))  # past Z: by text or index only
    else:
        raise DataError(
            f"{where}: field 'options' must be a list of texts or an object letter -> text, "
            f"got {type(options).__name__}"
        )
    names = [f"option {lab or i}" for i, lab in enumerate(labels)]
    if len(texts) < 2:
        raise DataError(
            f"{where}: field 'options' has {len(texts)} option(s); DPO needs the correct one and at "
            "least one wrong one to reject"
        )
    for name, text in zip(names, texts):
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: {name} must be a non-empty string, got {text!r}")
    if answer is None or isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(
            f"{where}: field 'answer' is missing or not a string or number; with 'options', give the "
            "correct option's text, its letter (A = the first) or key, or its 0-based index"
        )
    key = str(answer).strip()
    by_text = [i for i, t in enumerate(texts) if t.strip() == key]
    if len(by_text) > 1:
        raise DataError(
            f"{where}: the answer {key!r} is the text of {len(by_text)} options; make them distinct"
        )
    by_label = [i for i, lab in enumerate(labels) if lab and lab.strip().casefold() == key.casefold()]
    by_index = (
        [answer] if isinstance(options, list) and isinstance(answer, int) and answer < len(texts) else []
    )
    found = sorted(set(by_text + by_label + [i for i in by_index if i >= 0]))
    if not found:
        raise DataError(
            f"{where}: the answer {answer!r} is not among the {len(texts)} options; give the correct "
            "option's text, its letter (A = the first) or key, or its 0-based index"
        )
    if len(found) > 1:
        raise DataError(
            f"{where}: the answer {answer!r} could name {' or '.join(names[i] for i in found)} (as text, "
            "letter or index); write the correct option's text"
        )
    return texts, found[0]


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
        if not template and isinstance(row.get("completion"), list):  # a transcript: its assistant turns
            continue
        for name in names:
            if row.get(name) in (None, ""):
                line = row.get("_line", row.get("id"))
                how = (
                    f"--data.template {template!r} needs it"
                    if template
                    else "--algo sft trains on 'reference' (or a transcript, 'completion')"
                )
                raise DataError(
                    f"{source}:{line}: field '{name}' is missing or empty, and {how}; add it to every row"
                )


def render_prompt(tokenizer, row: dict, system_prompt: str = "", tools: list | None = None) -> list[int]:
    """Token ids of the prompt: chat messages go through the tokenizer's chat template (with `tools`, JSON
    schemas an episode's model may call, as tools=); text is used as is, with the tokenizer's own special
    tokens when it has no chat template (a base model's BOS, as `tokenizer(text)` adds it)."""
    p = row["prompt"]
    if isinstance(p, str) and getattr(tokenizer, "chat_template", None) is None:
        return tokenizer(system_prompt + p)["input_ids"]
    if getattr(tokenizer, "chat_template", None) is None:  # a base model
        raise ValueError("the prompts are chat messages but the tokenizer has no chat template: give text prompts "
                         "(a 'prompt' string; the demo task's: --data.train demo-text)")  # fmt: skip
    messages = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_budget(cfg: TrainConfig) -> tuple[object, int]:
    """The tokenizer and the longest prompt the run allows (prompt_limit), without loading the weights."""
    limit = prompt_limit(cfg)[0]  # an architecture nanogrpo cannot run: refused before the tokenizer loads
    return load_tokenizer(resolve_model(cfg.model.path)), limit


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


def load_task(
    name_or_path: str, split: str = "train", columns: dict[str, str] | None = None
) -> tuple[list[dict], str]:
    """Rows of a built-in task ('demo', or 'recipe:NAME': a seed paper's embedded data, nanogrpo/recipes/),
    of reasoning-gym's generators ('reasoning_gym:TASK[,TASK]', rewards/reasoninggym.py), of a data file or
    folder, or of NAME:SPLIT in the local HF cache (load_rows), and the source name used in error messages.
    `columns` (column_map of the DataConfig) renames fields before the rows are checked."""
    if name_or_path in ("demo", "demo-text"):  # demo-text: plain-text prompts, for a base model
        from nanogrpo.recipes.demo import demo_rows, demo_text_rows

        rows = demo_text_rows(split) if name_or_path == "demo-text" else demo_rows(split)
        return rows, f"{name_or_path}:{split}"
    if name_or_path.startswith("recipe:"):
        from nanogrpo.recipes import recipe_path

        path = recipe_path(name_or_path.removeprefix("recipe:"), split)  # the eval split: NAME.eval.jsonl
        return load_rows(path, columns), str(path)
    if name_or_path.startswith("reasoning_gym:"):
        from rewards.reasoninggym import gym_rows  # reasoning-gym's procedural tasks

        return gym_rows(name_or_path, split), f"{name_or_path}:{split}"
    return load_rows(name_or_path, columns), str(name_or_path)


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
