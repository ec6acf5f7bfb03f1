"""`python -m nanogrpo.reward_data keypoints`: key points and their keywords, drafted by an LLM from the
references.

RLVRR's content reward (rewards/keywords.py) reads `key_points`: per key point, short keywords taken
from the reference. Two-level extraction (the default, as in RLVRR) asks twice per row: first for
the key points an answer must cover, then for 1-3 word keywords per key point, copied from the
reference, about --share of its words in all (RLVRR: 15%). `--one-level` asks once for keywords
directly (RLVRR's ablation without key points): the row then has one key point, the whole chain.

Every keyword is checked against the references the way the grader will match it (case-folded word
sequences, rewards.text.words): it must occur word for word in a reference, have 1 to --max-words
words, and a key point's keywords must occur in the order they are listed, in one reference (RLVRR's
chain is ordered; with --no-order the order is not checked). A draft that fails gets one repair request
saying what failed; one that still fails is reported with file:line and why, and left out.

Output: each row with `key_points`, [{"point": "...", "keywords": ["...", ...]}, ...] (two-level;
the grader reads the keywords) or [["...", ...]] (one-level).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

from nanogrpo.reward_data import rows as io
from nanogrpo.reward_data.llm import DraftArgs, Drafter, draft_file, messages, read_json_object
from nanogrpo_base.ranges import at_least, within
from nanogrpo_base.rows import prompt_text
from rewards.keywords import first_positions, spaced_words
from rewards.text import words

NOWHERE = 1 << 62  # first_positions' position of a keyword that does not occur

SYSTEM = (
    "You extract, from expert reference answers, what a good answer must contain. You reply in JSON only."
)

MATERIAL = """<request>
{prompt}
</request>

{references}"""

POINTS = """Below are a user's request and {ref_desc} written by an expert.

List the key points an answer must cover to be as good as the reference: the essential pieces of content, each one short sentence, in the order the reference makes them; at most {max_points}.

{material}

Reply with only a JSON object: {{"key_points": ["<key point>", ...]}}"""

KEYWORDS = """Below are a user's request, {ref_desc} written by an expert, and the key points an answer must cover.

For each key point, copy from the reference its keywords: words or short phrases of 1 to {max_words} words that appear word for word in the reference, listed in the order they appear there, all of one key point from one reference. Pick the words that carry the content (names, terms, figures, actions), not filler. All keywords together should make up about {share:.0%} of the reference's words: about {target} words in all.

{material}

<key_points>
{points}
</key_points>

Reply with only a JSON object with one entry per key point, in order: {{"key_points": [{{"point": 1, "keywords": ["<keyword>", ...]}}, ...]}}"""

DIRECT = """Below are a user's request and {ref_desc} written by an expert.

Copy from the reference the keywords a good answer must contain: words or short phrases of 1 to {max_words} words that appear word for word in the reference, listed in the order they appear there. Pick the words that carry the content (names, terms, figures, actions), not filler. All keywords together should make up about {share:.0%} of the reference's words: about {target} words in all.

{material}

Reply with only a JSON object: {{"keywords": ["<keyword>", ...]}}"""


# Schemas with bounds: a small model held to one (--llm.json-mode schema / object-schema) then cannot
# write strings or lists until it runs out of tokens (servers with strict schemas get them without bounds)
def points_schema(max_points: int) -> dict[str, Any]:
    point = {"type": "string", "maxLength": 200}
    pts = {"type": "array", "items": point, "minItems": 1, "maxItems": max_points}
    return {"type": "object", "properties": {"key_points": pts}, "required": ["key_points"]}


def keyword_list(max_items: int) -> dict[str, Any]:
    return {
        "type": "array",
        "items": {"type": "string", "maxLength": 60},
        "minItems": 1,
        "maxItems": max_items,
    }


def keywords_schema(max_points: int) -> dict[str, Any]:
    item = {
        "type": "object",
        "properties": {"point": {"type": "integer"}, "keywords": keyword_list(12)},
        "required": ["point", "keywords"],
    }
    kps = {"type": "array", "items": item, "minItems": 1, "maxItems": max_points}
    return {"type": "object", "properties": {"key_points": kps}, "required": ["key_points"]}


def direct_schema(max_keywords: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"keywords": keyword_list(max_keywords)},
        "required": ["keywords"],
    }


@dataclass(frozen=True)
class KeypointsArgs(DraftArgs):
    """Draft `key_points` (key points and their keywords) for each row from its reference(s)."""

    one_level: bool = False
    """Ask for keywords directly, without key points (one request per row; the row gets one key point)."""
    share: Annotated[float, within(0, 1, lo_open=True)] = 0.15
    """Keywords' share of the reference's words asked for (RLVRR: about 15%)."""
    max_words: Annotated[int, at_least(1)] = 3
    """Most words in one keyword."""
    max_points: Annotated[int, at_least(1)] = 8
    """Most key points asked for per row."""
    order: bool = True
    """Check that a key point's keywords occur in a reference in the order listed."""
    max_ref_chars: Annotated[int, at_least(1)] = 6000
    """Each reference is cut to this many characters in the prompt (the keywords are checked on the whole)."""


def render_material(row: dict[str, Any], refs: list[str], max_chars: int) -> tuple[str, str]:
    """(the request and references block, how the prompt names the references)."""
    cut = [r if len(r) <= max_chars else r[:max_chars] + " [...]" for r in refs]
    if len(cut) == 1:
        block, desc = f"<reference>\n{cut[0]}\n</reference>", "a reference answer"
    else:
        block = "\n\n".join(f'<reference id="{k}">\n{r}\n</reference>' for k, r in enumerate(cut, 1))
        desc = f"{len(cut)} reference answers"
    return MATERIAL.format(prompt=prompt_text(row.get("prompt", "")) or "(not given)", references=block), desc


def target_words(refs: list[str], share: float) -> int:
    return max(1, round(share * len(words(refs[0]))))


def keyword_problems(kps: list[list[str]], refs: list[str], max_words: int, order: bool) -> list[str]:
    """What is wrong with these key points' keywords against the references ([] when nothing)."""
    spaced = [spaced_words(r) for r in refs]
    where = "the reference" if len(refs) == 1 else "any reference"
    problems = []
    for k, kws in enumerate(kps, 1):
        if not kws:
            problems.append(f"key point {k} has no keywords")
            continue
        tuples = [tuple(words(kw)) for kw in kws]
        bad = [f"keyword {kw!r} has {len(t)} words (write 1 to {max_words})"
               for kw, t in zip(kws, tuples) if not 1 <= len(t) <= max_words]  # fmt: skip
        bad += [
            f"keyword {kw!r} is not in {where} word for word"
            for kw, t in zip(kws, tuples)
            if 1 <= len(t) <= max_words and all(first_positions(s, [t])[0] == NOWHERE for s in spaced)
        ]
        problems += bad
        if bad or not order:
            continue
        positions = [first_positions(s, tuples) for s in spaced]
        if not any(NOWHERE not in pos and pos == sorted(pos) for pos in positions):
            there = [kw for p, kw in sorted(zip(positions[0], kws)) if p != NOWHERE]
            problems.append(
                f"the keywords of key point {k} are not listed in the order they appear in one reference "
                f"(listed: {json.dumps(kws)}; in the {'first ' if len(refs) > 1 else ''}reference: {json.dumps(there)})"
            )
    return problems


def _strings(v: Any) -> list[str] | None:
    return v if isinstance(v, list) and all(isinstance(x, str) for x in v) else None


def distinct(kws: list[str]) -> list[str]:
    """The keywords, spaces collapsed, without blanks and without repeats as the grader sees them
    ('Vitamin K' and 'vitamin k' are one keyword: the first spelling is kept)."""
    seen: dict[tuple[str, ...], str] = {}
    for kw in kws:
        kw = " ".join(kw.split())
        if kw:
            seen.setdefault(tuple(words(kw)) or (kw,), kw)
    return list(seen.values())


def read_points(max_points: int):
    def read(text: str) -> tuple[list[str] | None, str]:
        obj, problem = read_json_object(text)
        if obj is None:
            return None, problem
        pts = _strings(obj.get("key_points"))
        if pts is None:
            return None, 'there is no "key_points" list of strings'
        pts = [" ".join(p.split()) for p in pts if p.strip()]
        if not pts:
            return None, "the key_points list is empty"
        if len(pts) > max_points:
            return None, f"there are {len(pts)} key points; give at most {max_points}"
        return pts, ""

    return read


def read_keywords(points: list[str], refs: list[str], args: KeypointsArgs):
    n = len(points)

    def read(text: str) -> tuple[list[dict] | None, str]:
        obj, problem = read_json_object(text)
        if obj is None:
            return None, problem
        items = obj.get("key_points")
        if not isinstance(items, list):
            return None, 'there is no "key_points" list'
        kws: list[list[str] | None] = [None] * n
        for pos, item in enumerate(items):
            k, got = pos + 1, item
            if isinstance(item, dict):
                k, got = item.get("point", pos + 1), item.get("keywords")
            if isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= n and _strings(got) is not None:
                kws[k - 1] = distinct(got)
        missing = [str(k) for k, v in enumerate(kws, 1) if v is None]
        if missing:
            return None, f"no keywords list for key point(s) {', '.join(missing)} (there are {n})"
        done = [k or [] for k in kws]  # none is None past the check above
        problems = keyword_problems(done, refs, args.max_words, args.order)
        if problems:
            return None, "; ".join(problems)
        return [{"point": p, "keywords": k} for p, k in zip(points, done)], ""

    return read


def read_direct(refs: list[str], args: KeypointsArgs):
    def read(text: str) -> tuple[list[list[str]] | None, str]:
        obj, problem = read_json_object(text)
        if obj is None:
            return None, problem
        got = _strings(obj.get("keywords"))
        if got is None:
            return None, 'there is no "keywords" list of strings'
        kws = distinct(got)
        if not kws:
            return None, "the keywords list is empty"
        problems = keyword_problems([kws], refs, args.max_words, args.order)
        return (None, "; ".join(problems)) if problems else ([kws], "")

    return read


def keyword_share(key_points: list, ref: str) -> float:
    """Words in the keywords over words in the reference (how much of it the chain holds)."""
    kws = [kp["keywords"] if isinstance(kp, dict) else kp for kp in key_points]
    return sum(len(words(w)) for kp in kws for w in kp) / max(1, len(words(ref)))


def draft_rows(part: list[dict], args: KeypointsArgs, d: Drafter, rejects: io.Rejects) -> list[dict]:
    """The rows of one chunk that got good key points, with `key_points` set; the others rejected."""
    todo, out = [], {}
    for row in part:
        refs = io.references(row)
        if refs:
            todo.append((row, refs))
        else:
            rejects.add(row, "no reference: give 'reference' (a string) or 'references' (a list of strings)")
    fmt = dict(max_points=args.max_points, max_words=args.max_words, share=args.share)
    mats = [render_material(row, refs, args.max_ref_chars) for row, refs in todo]
    if args.one_level:
        convs = [
            messages(
                SYSTEM, DIRECT.format(material=m, ref_desc=desc, target=target_words(refs, args.share), **fmt)
            )
            for (m, desc), (_, refs) in zip(mats, todo)
        ]
        # room around the target in the schema: what is checked is the reference, not the count
        schemas = [direct_schema(2 * target_words(refs, args.share) + 4) for _, refs in todo]
        got = d.draft(convs, [read_direct(refs, args) for _, refs in todo], 1024, schemas)
    else:
        convs = [messages(SYSTEM, POINTS.format(material=m, ref_desc=desc, **fmt)) for m, desc in mats]
        points = d.draft(
            convs, [read_points(args.max_points)] * len(todo), 1024, points_schema(args.max_points)
        )
        second, readers, idx = [], [], []
        for k, ((pts, _), (m, desc), (_, refs)) in enumerate(zip(points, mats, todo)):
            if pts is None:
                continue
            listed = "\n".join(f"{j}. {p}" for j, p in enumerate(pts, 1))
            user = KEYWORDS.format(
                material=m, ref_desc=desc, points=listed, target=target_words(refs, args.share), **fmt
            )
            second.append(messages(SYSTEM, user))
            readers.append(read_keywords(pts, refs, args))
            idx.append(k)
        got = [(None, f"key points: {p}") for _, p in points]
        for k, (v, p) in zip(idx, d.draft(second, readers, 2048, keywords_schema(args.max_points))):
            got[k] = (v, f"keywords: {p}" if p else "")
    for (row, _), (value, problem) in zip(todo, got):
        if value is None:
            rejects.add(row, problem)
        else:
            out[id(row)] = {**io.clean(row), "key_points": value}
    return [out[id(r)] for r in part if id(r) in out]


def run(args: KeypointsArgs, client: Any = None) -> dict[str, Any]:
    """Draft key points for every row; write the output and the rejected rows; print the summary."""
    if not 0 < args.share <= 1:
        raise ValueError(f"--share is a fraction of the reference's words, in (0, 1]; got {args.share}")
    if args.max_words < 1 or args.max_points < 1:
        raise ValueError("--max-words and --max-points must be >= 1")
    done = draft_file(args, client, "keypoints", lambda part, d, rejects: draft_rows(part, args, d, rejects))
    shares = [keyword_share(r["key_points"], io.references(r)[0]) for r in done.written]
    mean_share = sum(shares) / len(shares) if shares else 0.0
    extra = f"; keywords are {mean_share:.1%} of the first reference's words on average"
    return {**done.report("keypoints", args.out, extra), "share": mean_share}
