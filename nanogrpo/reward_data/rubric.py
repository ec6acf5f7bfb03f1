"""`python -m nanogrpo.reward_data rubric` and `label`: rubric criteria from the reference, and judge labels for a probe.

rubric: Small-LM Judges rewrites each question's rubric into six criteria, two hard (constraints the request
states: a format, a length, something to include or avoid) and four soft (what makes an answer good).
The LLM writes them from the prompt and the reference, with a weight each (1-5). A draft is checked:
exactly --hard hard and --soft soft criteria, each a distinct non-empty statement, weights positive,
and the list must read as the rubric grader reads it (rewards.rubric.parse_rubric). One repair, then
the row is reported and left out. Output: `rubric`, [{"criterion", "weight", "kind"}] (the grader
reads criterion and weight; kind is kept for you).

label: for each response of a row (`response`, `completion` as eval.py generate writes, or a list
`responses`), a judge marks every criterion of the row's rubric met or not, in one request per
response. Output: one line per (response, criterion), {"prompt", "response", "criterion", "label",
"id"} with id 'input line:response:criterion' (unique also for eval.py generate's several samples of
a prompt, one a line): the input of `python -m rewards.probe train` (Small-LM Judges labels with a large judge once,
then trains a small probe on the labels). Criteria the judge leaves unmarked after the repair are
reported and left out; the response's other labels are kept (each label stands on its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from nanogrpo.reward_data import rows as io
from nanogrpo.reward_data.llm import DraftArgs, Drafter, draft_file, messages, read_json_object
from nanogrpo_base.ranges import above, at_least
from nanogrpo_base.rows import prompt_text
from rewards.rubric import parse_rubric

SYSTEM = "You write and apply grading rubrics for answers to user requests. You reply in JSON only."

RUBRIC = """Below are a user's request and a reference answer written by an expert. Write a rubric for grading answers to the request: {hard} hard criteria and {soft} soft criteria.

- hard: a constraint the request itself states or clearly implies (a format, a length, something to include or to avoid), checkable as met or not met;
- soft: a quality that separates a good answer from a weak one, as the reference shows it (correct content, completeness, clarity).
Each criterion is one self-contained statement about the answer ("The answer names ..."), judged without seeing the reference. Give each a weight from 1 (minor) to 5 (essential).

<request>
{prompt}
</request>

<reference>
{reference}
</reference>

Reply with only a JSON object: {{"criteria": [{{"criterion": "<statement>", "kind": "hard" or "soft", "weight": <1-5>}}, ...]}}"""

LABEL = """Below are a user's request, a response to it and the criteria of a rubric. For each criterion, decide whether the response meets it. Judge the response as written; a criterion it only partly meets is not met.

<request>
{prompt}
</request>

<response>
{response}
</response>

<criteria>
{criteria}
</criteria>

Reply with only a JSON object with one entry per criterion, in order: {{"verdicts": [{{"criterion": 1, "met": true or false}}, ...]}}"""

RUBRIC_SCHEMA = {
    "type": "object",
    "properties": {
        "criteria": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "criterion": {"type": "string"},
                    "kind": {"type": "string", "enum": ["hard", "soft"]},
                    "weight": {"type": "number"},
                },
                "required": ["criterion", "kind", "weight"],
            },
        }
    },
    "required": ["criteria"],
}
LABEL_SCHEMA = {
    "type": "object",
    "properties": {
        "verdicts": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"criterion": {"type": "integer"}, "met": {"type": "boolean"}},
                "required": ["criterion", "met"],
            },
        }
    },
    "required": ["verdicts"],
}


@dataclass(frozen=True)
class RubricArgs(DraftArgs):
    """Draft `rubric` (criteria with weights, hard and soft) for each row from its prompt and reference."""

    hard: Annotated[int, at_least(0)] = 2
    """Hard criteria per row (Small-LM Judges: 2)."""
    soft: Annotated[int, at_least(0)] = 4
    """Soft criteria per row (Small-LM Judges: 4)."""
    max_weight: Annotated[float, above(0)] = 5.0
    """Largest weight a criterion may have."""
    max_ref_chars: Annotated[int, at_least(1)] = 6000
    """The reference is cut to this many characters in the prompt."""


@dataclass(frozen=True)
class LabelArgs(DraftArgs):
    """Label whether each response meets each criterion of its row's rubric: the input of `rewards.probe train`."""

    max_response_chars: Annotated[int, at_least(1)] = 6000
    """Each response is cut to this many characters in the prompt (the label row keeps it whole)."""


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + " [...]"


def read_rubric(args: RubricArgs):
    def read(text: str) -> tuple[list[dict] | None, str]:
        obj, problem = read_json_object(text)
        if obj is None:
            return None, problem
        items = obj.get("criteria")
        if not isinstance(items, list):
            return None, 'there is no "criteria" list'
        problems, out, seen = [], [], set()
        for k, it in enumerate(items, 1):
            c = it.get("criterion") if isinstance(it, dict) else None
            kind = it.get("kind") if isinstance(it, dict) else None
            w = it.get("weight") if isinstance(it, dict) else None
            if not isinstance(c, str) or not c.strip():
                problems.append(f"criterion {k} has no statement")
                continue
            c = " ".join(c.split())
            if c.casefold() in seen:
                problems.append(f"criterion {k} repeats an earlier one")
            seen.add(c.casefold())
            if kind not in ("hard", "soft"):
                problems.append(f'criterion {k} needs "kind": "hard" or "soft", got {kind!r}')
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w <= args.max_weight:
                problems.append(f"criterion {k} needs a weight in (0, {args.max_weight:g}], got {w!r}")
            out.append({"criterion": c, "weight": w, "kind": kind})
        n_hard = sum(c["kind"] == "hard" for c in out)
        n_soft = sum(c["kind"] == "soft" for c in out)
        if (n_hard, n_soft) != (args.hard, args.soft):
            problems.append(
                f"there are {n_hard} hard and {n_soft} soft criteria; write {args.hard} and {args.soft}"
            )
        if problems:
            return None, "; ".join(problems)
        parse_rubric(out)  # what the grader reads; the checks above are stricter
        return out, ""

    return read


def run_rubric(args: RubricArgs, client: Any = None) -> dict[str, Any]:
    """Draft a rubric for every row; write the output and the rejected rows; print the summary."""
    if args.hard < 0 or args.soft < 0 or args.hard + args.soft == 0:
        raise ValueError("--hard and --soft are criteria counts >= 0, not both 0")
    return draft_file(
        args, client, "rubric", lambda part, d, rejects: _rubric_part(part, args, d, rejects)
    ).report("rubric", args.out)


def _rubric_part(part: list[dict], args: RubricArgs, d: Drafter, rejects: io.Rejects) -> list[dict]:
    """One chunk of `rubric`: the rows that got a valid rubric (the others go to rejects, with why)."""
    todo = []
    for row in part:
        refs = io.references(row)
        if refs and prompt_text(row.get("prompt", "")).strip():
            todo.append((row, refs[0]))
        else:
            rejects.add(row, "a rubric needs the row's 'prompt' and a 'reference' (or 'references')")
    convs = [
        messages(SYSTEM, RUBRIC.format(hard=args.hard, soft=args.soft, prompt=prompt_text(row["prompt"]),
                                       reference=_cut(ref, args.max_ref_chars)))
        for row, ref in todo
    ]  # fmt: skip
    good = {}
    for (row, _), (rubric, problem) in zip(
        todo, d.draft(convs, [read_rubric(args)] * len(todo), 1536, RUBRIC_SCHEMA)
    ):
        if rubric is None:
            rejects.add(row, f"rubric: {problem}")
        else:
            good[id(row)] = {**io.clean(row), "rubric": rubric}
    return [good[id(r)] for r in part if id(r) in good]


def _label_part(part: list[dict], args: LabelArgs, d: Drafter, rejects: io.Rejects) -> list[dict]:
    """One chunk of `label`: a label row per (response, criterion) the judge decided (what it left open, or a
    row it cannot read, goes to rejects, with why)."""
    labels: list[dict] = []
    jobs = []  # (row, response number, response, rubric)
    for row in part:
        resp = responses(row)
        try:
            rubric = parse_rubric(row.get("rubric"))
        except ValueError as e:
            rejects.add(row, f"field 'rubric' {e}")
            continue
        if resp is None or not prompt_text(row.get("prompt", "")).strip():
            rejects.add(
                row,
                "give 'prompt' and the responses to label: 'responses' (a list), 'response' or 'completion'",
            )
            continue
        jobs += [(row, j, r, rubric) for j, r in enumerate(resp)]
    convs = []
    for row, _, resp, rubric in jobs:
        listed = "\n".join(f"{k}. {c}" for k, (c, _) in enumerate(rubric, 1))
        convs.append(messages(SYSTEM, LABEL.format(prompt=prompt_text(row["prompt"]),
                                                   response=_cut(resp, args.max_response_chars), criteria=listed)))  # fmt: skip
    readers = [read_verdicts(len(rubric)) for *_, rubric in jobs]
    for (row, j, resp, rubric), (verdicts, problem) in zip(jobs, d.draft(convs, readers, 1024, LABEL_SCHEMA)):
        if problem:
            rejects.add(row, f"response {j}: {problem}")
        prompt = prompt_text(row["prompt"])
        for k, ((criterion, _), met) in enumerate(zip(rubric, verdicts or [])):
            if met is not None:
                labels.append({"prompt": prompt, "response": resp, "criterion": criterion,
                               "label": int(met), "id": f"{row.get('_line')}:{j}:{k}"})  # fmt: skip
    return labels


def responses(row: dict[str, Any]) -> list[str] | None:
    """The responses to label: `responses` (a list), else `response` or `completion` (one); None when absent."""
    if isinstance(row.get("responses"), list):
        got = row["responses"]
        return got if all(isinstance(r, str) for r in got) else None
    for name in ("response", "completion"):
        if isinstance(row.get(name), str):
            return [row[name]]
    return None


def read_verdicts(n: int):
    def read(text: str) -> tuple[list[bool | None] | None, str]:
        obj, problem = read_json_object(text)
        if obj is None:
            return None, problem
        items = obj.get("verdicts")
        if not isinstance(items, list):
            return None, 'there is no "verdicts" list'
        got: list[bool | None] = [None] * n
        marked = [0] * n
        for pos, it in enumerate(items):
            if not isinstance(it, dict):
                continue
            k, met = it.get("criterion", pos + 1), it.get("met")
            if isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= n:
                marked[k - 1] += 1
                if isinstance(met, bool):
                    got[k - 1] = met
        got = [None if m > 1 else v for v, m in zip(got, marked)]  # marked twice: neither verdict is used
        missing = [str(k) for k, v in enumerate(got, 1) if v is None]
        if missing:
            return got, f'no single true/false "met" for criterion {", ".join(missing)} (there are {n})'
        return got, ""

    return read


def run_label(args: LabelArgs, client: Any = None) -> dict[str, Any]:
    """Label every (response, criterion) pair; write the label rows and what was left out; print the summary."""
    done = draft_file(args, client, "label", lambda part, d, rejects: _label_part(part, args, d, rejects))
    labels, rejects, rejected_path, d = done.written, done.rejects, done.rejected_path, done.drafter
    met = sum(r["label"] for r in labels)
    print(
        f"label: {len(labels)} labels ({met} met, {len(labels) - met} not) written to {args.out}"
        + (
            f"; {len(rejects.items)} rows or responses not fully labelled (listed above and in {rejected_path})"
            if rejects.items
            else ""
        )  # fmt: skip
    )
    print(d.summary())
    return {"labels": len(labels), "met": met, "rejected": len(rejects.items), "counts": dict(d.counts)}
