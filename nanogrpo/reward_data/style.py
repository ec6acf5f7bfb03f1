"""`python -m nanogrpo.reward_data style`: style checks drafted from the reference, as data, with LLM weights.

RLVRR's style reward is a few checks per reference (length, markdown) with LLM-assigned importance
weights. Here the checks are a declarative spec, `style_spec`, that the style grader scores as is
(rewards/style.py): a word range, whether headings, lists, emphasis, code blocks and tables are used,
and phrases the answer must include. The LLM chooses the checks that matter for the request, the
length range and the phrases, and weighs each; the build measures the reference (word count, the
elements it uses) and tells the LLM, and then checks the draft against the reference: every check
must score 1 on the reference itself (it is the style asked for). A draft that fails gets one repair
request saying which checks failed; one that fails again is reported and left out.

`--python-checks` also asks for free-form Python checks (`def name(response) -> float`), kept in
`style_code`. They are validated by running them on the reference in the sandbox (nanogrpo/reward_data/
sandbox.py: a child process with CPU, memory, file and process limits and no network), never in this
process, and each must score 1 there. The trainer runs them only through the opt-in style user check
`nanogrpo.reward_data.sandbox.row_code`, in the same sandbox (docs/REWARD_DATA.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

from nanogrpo.reward_data import rows as io
from nanogrpo.reward_data import sandbox
from nanogrpo.reward_data.llm import DraftArgs, Drafter, draft_file, messages, read_json_object
from nanogrpo_base.ranges import above, at_least
from nanogrpo_base.rows import prompt_text
from rewards.style import ELEMENTS, parse_style_spec, spec_scores, text_style
from rewards.text import words

SYSTEM = "You describe the style of expert answers as checks a program can run. You reply in JSON only."

SPEC = """Below are a user's request and a reference answer written by an expert. Write the style checks a response must pass to be in the reference's style, and weigh each by how much it matters for this request.

Measured on the reference: {facts}

The checks you may use, each at most once:
- {{"check": "length", "min_words": <int>, "max_words": <int>}}: the range of word counts a good response falls in (it must include the reference's {n} words);
- {{"check": "<element>", "present": <true|false>}} for element headings, lists, emphasis, code or tables: whether a response should use it, as the reference does;
- {{"check": "includes", "phrases": ["<phrase>", ...]}}: short phrases copied word for word from the reference that a response in its style must contain (a sign-off, a required section name); leave it out when there are none.
Give each check a "weight" from 0 (does not matter here) to 3 (matters most).

<request>
{prompt}
</request>

<reference>
{reference}
</reference>

Reply with only a JSON object: {{"checks": [{{"check": "length", "min_words": 60, "max_words": 150, "weight": 2}}, ...]}}"""

CODE = """Below are a user's request and a reference answer written by an expert. Write up to {max_checks} Python functions that check whether a response has the style properties of the reference (structure, length, formatting, wording conventions), each scoring the response from 0 to 1, and weigh each by how much it matters (0 to 3).

Rules: each function is `def <name>(response: str) -> float` (or bool); it may import only {allowed}; no files, no network, no randomness; it must give the reference itself 1.

<request>
{prompt}
</request>

<reference>
{reference}
</reference>

Reply with only a JSON object: {{"checks": [{{"name": "<function name>", "code": "<the function's source>", "weight": <0-3>}}, ...]}}"""

SPEC_SCHEMA = {
    "type": "object",
    "properties": {"checks": {"type": "array", "items": {"type": "object"}, "minItems": 1}},
    "required": ["checks"],
}
CODE_SCHEMA = {
    "type": "object",
    "properties": {
        "checks": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "code": {"type": "string"},
                    "weight": {"type": "number"},
                },
                "required": ["name", "code", "weight"],
            },
            "minItems": 1,
        }
    },
    "required": ["checks"],
}


@dataclass(frozen=True)
class StyleArgs(DraftArgs):
    """Draft `style_spec` (declarative style checks with weights) for each row from its reference."""

    python_checks: bool = False
    """Also ask for free-form Python checks (`style_code`), validated in the sandbox: LLM-written code, run in a
    child process only (CPU, memory, file and process limits, no network; see
    nanogrpo/reward_data/sandbox.py)."""
    max_code_checks: Annotated[int, at_least(1)] = 4
    """Most Python checks asked for per row."""
    check_seconds: Annotated[float, above(0)] = 2.0
    """Sandbox: CPU seconds per check call."""
    check_memory_mb: Annotated[int, at_least(1)] = 256
    """Sandbox: address space of the child, in MB."""
    check_network: str = "auto"
    """Sandbox: 'namespace' (no network interfaces at all, needs `unshare -rn`), 'python' (socket modules
    blocked at the Python level) or 'auto' (namespace where it works)."""
    max_ref_chars: Annotated[int, at_least(1)] = 6000
    """The reference is cut to this many characters in the prompt (the checks are tested on the whole)."""


def facts(ref: str) -> tuple[str, int]:
    """What the build measures on the reference, as a sentence for the prompt, and its word count."""
    n, has = len(words(ref)), text_style(ref, ELEMENTS)[1]
    uses = [e for e in ELEMENTS if e in has]
    lacks = [e for e in ELEMENTS if e not in has]
    said = f"{n} words; uses {', '.join(uses) or 'no markdown'}"
    return said + (f"; does not use {', '.join(lacks)}" if lacks else "") + ".", n


def spec_problems(spec: list[tuple[dict, float]], ref: str) -> list[str]:
    """The checks of a parsed spec that the reference itself fails ([] when it passes them all)."""
    n, has = len(words(ref)), text_style(ref, ELEMENTS)[1]
    spaced = f" {' '.join(words(ref))} "
    out = []
    for (c, _), score in zip(spec, spec_scores(spec, ref)):
        if score >= 1.0:
            continue
        name = c["check"]
        if name == "length":
            out.append(f"length {c['min_words']}-{c['max_words']} words excludes the reference's {n} words")
        elif name == "includes":
            missing = [p for p in c["phrases"] if f" {' '.join(words(p))} " not in spaced]
            out.append(f"includes: {json.dumps(missing)} not in the reference word for word")
        else:
            out.append(f"{name}: present={json.dumps(c['present'])}, but the reference "
                       f"{'uses' if name in has else 'does not use'} {name}")  # fmt: skip
    return out


def read_spec(ref: str):
    def read(text: str) -> tuple[list[dict] | None, str]:
        obj, problem = read_json_object(text)
        if obj is None:
            return None, problem
        checks = obj.get("checks")
        try:
            spec = parse_style_spec(checks)
        except ValueError as e:
            return None, f'"checks" {e}'
        problems = spec_problems(spec, ref)
        if problems:
            return None, "the reference fails its own checks: " + "; ".join(problems)
        return [dict(c, weight=w) for c, w in spec], ""

    return read


def read_code(ref: str, args: StyleArgs):
    limits = sandbox.Limits(args.check_seconds, args.check_memory_mb, args.check_network)

    def read(text: str) -> tuple[list[dict] | None, str]:
        obj, problem = read_json_object(text)
        if obj is None:
            return None, problem
        try:
            checks = sandbox.read_code_checks(obj.get("checks"))
        except ValueError as e:
            return None, f'"checks" {e}'
        if len(checks) > args.max_code_checks:
            return None, f"there are {len(checks)} checks; give at most {args.max_code_checks}"
        if len({n for n, *_ in checks}) < len(checks):
            return None, "two checks share a name; name each function once"
        res = sandbox.run_checks([{"name": n, "code": c} for n, c, _ in checks], [ref], limits)
        problems = []
        for (name, *_), (r,) in zip(checks, res):
            if "error" in r:
                problems.append(f"{name}: {r['error']}")
            elif r["score"] < 1.0:
                problems.append(f"{name} gives the reference {r['score']:g}, not 1")
        if problems:
            return None, "run on the reference: " + "; ".join(problems)
        return [{"name": n, "code": c, "weight": w} for n, c, w in checks], ""

    return read


def draft_rows(part: list[dict], args: StyleArgs, d: Drafter, rejects: io.Rejects) -> list[dict]:
    """The rows of one chunk that got a good style spec (and code), with the fields set."""
    todo = []
    for row in part:
        refs = io.references(row)
        if refs:
            todo.append((row, refs[0]))
        else:
            rejects.add(row, "no reference: give 'reference' (a string) or 'references' (a list of strings)")
    cut = [ref if len(ref) <= args.max_ref_chars else ref[: args.max_ref_chars] + " [...]" for _, ref in todo]
    prompts = [prompt_text(row.get("prompt", "")) or "(not given)" for row, _ in todo]
    convs = []
    for p, c, (_, ref) in zip(prompts, cut, todo):
        said, n = facts(ref)
        convs.append(messages(SYSTEM, SPEC.format(facts=said, n=n, prompt=p, reference=c)))
    got = d.draft(convs, [read_spec(ref) for _, ref in todo], 1024, SPEC_SCHEMA)
    code: list[tuple[Any, str]] = [([], "")] * len(todo)
    if args.python_checks:
        allowed = ", ".join(sandbox.ALLOWED_IMPORTS)
        convs = [messages(SYSTEM, CODE.format(max_checks=args.max_code_checks, allowed=allowed, prompt=p,
                                              reference=c)) for p, c in zip(prompts, cut)]  # fmt: skip
        code = d.draft(convs, [read_code(ref, args) for _, ref in todo], 2048, CODE_SCHEMA)
    out = {}
    for (row, _), (spec, p1), (checks, p2) in zip(todo, got, code):
        if spec is None or checks is None:
            rejects.add(row, f"style spec: {p1}" if spec is None else f"python checks: {p2}")
            continue
        out[id(row)] = {**io.clean(row), "style_spec": spec, **({"style_code": checks} if checks else {})}
    return [out[id(r)] for r in part if id(r) in out]


def run(args: StyleArgs, client: Any = None) -> dict[str, Any]:
    """Draft a style spec for every row; write the output and the rejected rows; print the summary."""
    if args.max_code_checks < 1:
        raise ValueError("--max-code-checks must be >= 1")
    if args.python_checks:
        sandbox._command(args.check_network)  # a network mode that cannot work stops the build now
    done = draft_file(args, client, "style", lambda part, d, rejects: draft_rows(part, args, d, rejects))
    n_checks = sum(len(r["style_spec"]) for r in done.written)
    return done.report("style", args.out, f"; {n_checks / max(1, len(done.written)):.1f} checks a row")
