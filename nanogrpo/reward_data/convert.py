"""Data converters: multiple-choice questions to open-generation rows, and a seeded, stratified split.

    python -m nanogrpo.reward_data.convert mcq medqa/test.jsonl --out data/medqa_test.jsonl
    python -m nanogrpo.reward_data.convert split data/medqa_train.jsonl --by meta_info --out-dir data/medqa

mcq: each row holds a question, its options (a list, lettered A, B, C, ...; an object label -> text; or
bigbio's list of {"key", "value"}) and the answer (its letter or key, its text, or a list's 0-based index;
MedQA rows carry both the letter, `answer_idx`, and the text, `answer`, which must agree). The output row
asks the question openly: `prompt` is the question (--list-options adds the lettered options), and
`reference` and `answer` are the gold option's text, what Concept Overlap scores ("ceftriaxone", not "B"). The
`options` are kept, so the same file trains --algo dpo (the gold option chosen, a wrong one rejected;
nanogrpo/stages/dpo.py), and every other field of the row is carried over. Each row is checked as DPO will
read it, so a file that converts also trains.

split: rows grouped by a field (--by), each group shuffled with --seed and cut by --ratios (80/10/10 into
train/val/test by default), so every split holds each group in about the same proportion. The same file
and seed give the same split; the splits are disjoint and together hold every row once.

Bad rows stop the converter with the file, the line and what to fix (mcq --skip-bad drops them instead).
"""

from __future__ import annotations

import json
import math
import random
import string
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from nanogrpo.data import correct_option, preference_texts
from nanogrpo.formats import validate_row, write_jsonl
from nanogrpo.infra.outputs import output_file, output_folder
from nanogrpo_base.ranges import at_least, check_or_exit, within
from nanogrpo_base.rows import DataError, read_rows

Positional = tyro.conf.Positional

# ----------------------------------------------------------------------------------------------------------
# multiple choice -> open generation


def option_dict(options: object, where: str) -> dict | list:
    """The options as DPO reads them: a list of texts or an object label -> text; bigbio's list of
    {"key": "A", "value": text} becomes the object."""
    if isinstance(options, list) and options and all(isinstance(o, dict) for o in options):
        if not all(set(o) >= {"key", "value"} for o in options):
            raise DataError(
                f"{where}: the options are objects without 'key' and 'value'; give a list of texts, an "
                'object {"A": text, ...} or a list of {"key": "A", "value": text}'
            )
        return {str(o["key"]): o["value"] for o in options}
    if not isinstance(options, (list, dict)):
        raise DataError(
            f"{where}: the options must be a list of texts or an object letter -> text, got "
            f"{type(options).__name__}; name the options' field with --options FIELD"
        )
    return options


def labelled(options: dict | list) -> list[tuple[str, str]]:
    """(label, text) of each option: an object's keys, a list's letters A, B, C, ..."""
    if isinstance(options, dict):
        return [(str(k), str(v)) for k, v in options.items()]
    return [(string.ascii_uppercase[i] if i < 26 else str(i), str(t)) for i, t in enumerate(options)]


def gold_index(row: dict, options: dict | list, fields: Sequence[str], where: str) -> int:
    """The index of the correct option, read from every answer field the row has (as DPO reads an answer:
    text, label or list index; an ambiguous one is refused); the fields must name the same option."""
    found = {f: correct_option(options, row[f], f"{where}: field '{f}'")[1] for f in fields if f in row}
    if not found:
        raise DataError(
            f"{where}: no answer field ({' or '.join(repr(f) for f in fields)}); name the field that holds "
            "the correct option with --answer FIELD"
        )
    if len(set(found.values())) > 1:
        labels = [lab for lab, _ in labelled(options)]
        said = ", ".join(f"'{f}' says option {labels[i]}" for f, i in found.items())
        raise DataError(
            f"{where}: the answer fields disagree ({said}); fix the row or pick one with --answer"
        )
    return next(iter(found.values()))


def mcq_prompt(question: str, options: dict | list, list_options: bool, instruction: str) -> str:
    """The open question: the question, then (list_options) one 'A. text' line per option, then the
    instruction, each block separated by a blank line."""
    parts = [question.strip()]
    if list_options:
        parts.append("\n".join(f"{lab}. {text}" for lab, text in labelled(options)))
    if instruction:
        parts.append(instruction)
    return "\n\n".join(parts)


@dataclass(frozen=True)
class McqFields:
    """Where a multiple-choice row keeps its parts (MedQA's names by default), and how to ask it."""

    question: str = "question"
    options: str = "options"
    answer: tuple[str, ...] = ("answer_idx", "answer")
    list_options: bool = False
    instruction: str = ""


def convert_row(row: dict, f: McqFields, where: str) -> dict:
    """One multiple-choice row -> an open-generation row (prompt, reference, answer, options, the rest)."""
    question = row.get(f.question)
    if not isinstance(question, str) or not question.strip():
        raise DataError(
            f"{where}: field '{f.question}' is missing or not a non-empty string; name the question's "
            "field with --question FIELD"
        )
    if f.options not in row:
        raise DataError(
            f"{where}: field '{f.options}' is missing; name the options' field with --options FIELD"
        )
    options = option_dict(row[f.options], where)
    texts = [text for _, text in labelled(options)]
    gold = texts[gold_index(row, options, f.answer, where)]
    consumed = {f.question, f.options, *f.answer}
    out = {
        "id": row["id"],
        "prompt": mcq_prompt(question, options, f.list_options, f.instruction),
        "reference": gold,
        "answer": gold,
        "options": options,
    }
    out.update({k: v for k, v in row.items() if k not in consumed and k not in out and not k.startswith("_")})
    # the row as train.py will read it: a DPO pair (the gold text names one option, a wrong one exists)
    preference_texts(out, f"{where}: converted")
    return validate_row(out, where)


def convert_mcq(
    path: str | Path, fields: McqFields = McqFields(), id_prefix: str = "", skip_bad: bool = False
) -> tuple[list[dict], list[str]]:
    """Every row of a multiple-choice JSONL converted, and the messages of the rows skipped (skip_bad;
    else the first bad row raises DataError). A row without an `id` gets '<id_prefix>-<line>', the prefix
    defaulting to the file's name, so ids stay distinct across the files of one dataset."""
    prefix = id_prefix or Path(path).stem

    def mark(row: dict, where: str) -> None:
        row["_no_id"] = "id" not in row  # the reader gives such rows their bare line number

    rows, skipped = [], []
    for row in read_rows(path, mark):
        if row.pop("_no_id"):
            row["id"] = f"{prefix}-{row['_line']}"
        try:
            rows.append(convert_row(row, fields, f"{path}:{row['_line']}"))
        except DataError as e:
            if not skip_bad:
                raise
            skipped.append(str(e))
    if not rows:
        raise DataError(f"{path}: no row converted ({len(skipped)} skipped); see the first: {skipped[0]}")
    return rows, skipped


# ----------------------------------------------------------------------------------------------------------
# stratified split


def check_ratios(ratios: Sequence[float], names: Sequence[str]) -> None:
    if len(ratios) != len(names):
        raise ValueError(f"{len(ratios)} --ratios for {len(names)} --names: give one ratio per split")
    if len(set(names)) != len(names) or not all(n and "/" not in n for n in names):
        raise ValueError(f"--names {' '.join(names)}: give distinct file names (no '/')")
    if any(r < 0 for r in ratios) or not math.isclose(sum(ratios), 1.0, abs_tol=1e-6):
        raise ValueError(f"--ratios {' '.join(map(str, ratios))}: give non-negative ratios that sum to 1")


def allocate(sizes: Sequence[int], ratios: Sequence[float]) -> list[list[int]]:
    """Rows per split for each group: floor(n * ratio) each, and a group's leftover rows, one per split at
    most and only where n * ratio has a fraction, to the splits furthest below their share of all rows so
    far. Each group is then within a row of n * ratio, and the totals stay within a row or so of N * ratio
    even when every group is small (rounding each group on its own would send every leftover row the same
    way)."""
    k, total = len(ratios), sum(ratios)
    ratios = [r / total for r in ratios]  # --ratios may sum to 1 only up to rounding
    assigned, seen, out = [0] * k, 0, []
    for n in sizes:
        seen += n
        counts = [math.floor(n * r + 1e-9) for r in ratios]
        # the splits whose share of this group has a fraction left: each may take one leftover row
        open_ = [j for j in range(k) if n * ratios[j] - counts[j] > 1e-9]
        for _ in range(n - sum(counts)):
            i = max(open_ or range(k), key=lambda j: (ratios[j] * seen - assigned[j] - counts[j], -j))
            counts[i] += 1
            open_ = [j for j in open_ if j != i]
        assigned = [a + c for a, c in zip(assigned, counts)]
        out.append(counts)
    return out


def group_key(row: dict, by: str, where: str) -> str:
    """The row's stratum: the --by field's value as JSON ('' when --by is '': one group)."""
    if not by:
        return ""
    if row.get(by) is None:
        raise DataError(
            f"{where}: field '{by}' is missing; every row needs the field the split is stratified by "
            "(--by), or pass --by '' for a plain random split"
        )
    return json.dumps(row[by], sort_keys=True, ensure_ascii=False)


def split_rows(
    rows: Sequence[dict], by: str, ratios: Sequence[float], seed: int, source: str = "data"
) -> list[list[dict]]:
    """The rows cut into len(ratios) splits, stratified by the field `by`; each split in file order."""
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(group_key(row, by, f"{source}:{row.get('_line', i + 1)}"), []).append(i)
    keys = sorted(groups)  # a fixed order, whatever the file's, so a seed names one split
    rng = random.Random(seed)
    split_of = [0] * len(rows)
    for key, counts in zip(keys, allocate([len(groups[k]) for k in keys], ratios)):
        idx = list(groups[key])
        rng.shuffle(idx)
        start = 0
        for s, c in enumerate(counts):
            for i in idx[start : start + c]:
                split_of[i] = s
            start += c
    return [[r for r, s in zip(rows, split_of) if s == k] for k in range(len(ratios))]


# ----------------------------------------------------------------------------------------------------------
# command line


@dataclass(frozen=True)
class Mcq:
    """Multiple-choice JSONL -> open-generation rows (prompt, reference, answer = the gold text, options)."""

    file: Positional[str]
    """Multiple-choice JSONL, e.g. MedQA's (question, options {"A": ...}, answer_idx, answer)."""
    out: str
    """Where the converted rows go."""
    question: str = "question"
    """The question's field."""
    options: str = "options"
    """The options' field: a list of texts, an object letter -> text, or a list of {"key", "value"}."""
    answer: tuple[str, ...] = ("answer_idx", "answer")
    """The answer's field(s): letter or key, text, or a list's 0-based index; every one a row has must
    name the same option."""
    list_options: bool = False
    """Write the lettered options into the prompt, after the question."""
    instruction: str = ""
    """Text after the question (and options), e.g. 'Answer with the name of the drug only.'."""
    id_prefix: str = ""
    """Rows without an `id` get '<prefix>-<line>' ('' = the file's name without .jsonl)."""
    skip_bad: bool = False
    """Drop rows that do not convert (and list them) instead of stopping at the first."""


@dataclass(frozen=True)
class Split:
    """A JSONL cut into train/val/test (by default) files, stratified by a field, seeded."""

    file: Positional[str]
    """The JSONL to split."""
    by: str
    """The field to stratify by (e.g. meta_info, answer); '' = a plain random split."""
    out_dir: str
    """Folder of the split files, NAME.jsonl for each --names."""
    ratios: Annotated[tuple[float, ...], within(0, 1)] = (0.8, 0.1, 0.1)
    """Share of each split; they sum to 1."""
    names: tuple[str, ...] = ("train", "val", "test")
    """The split files' names, one per ratio."""
    seed: Annotated[int, at_least(0)] = 0
    """Shuffle seed: the same file and seed give the same split."""
    overwrite: bool = False
    """Replace split files that exist."""


def run_mcq(args: Mcq) -> None:
    fields = McqFields(args.question, args.options, args.answer, args.list_options, args.instruction)
    out = output_file(args.out, "--out")  # '', a folder, under a file: refused before the conversion
    rows, skipped = convert_mcq(args.file, fields, args.id_prefix, args.skip_bad)
    write_jsonl(out, rows)
    print(f"wrote {len(rows)} open-generation rows to {args.out}")
    if skipped:
        print(f"skipped {len(skipped)} bad rows:", *skipped[:10], sep="\n  ")
        if len(skipped) > 10:
            print(f"  ... and {len(skipped) - 10} more")


def run_split(args: Split) -> None:
    check_ratios(args.ratios, args.names)
    folder = output_folder(args.out_dir, "--out-dir")  # '' would write the splits into the current folder
    paths = [folder / f"{name}.jsonl" for name in args.names]
    if not args.overwrite and (there := [str(p) for p in paths if p.exists()]):
        raise ValueError(f"{', '.join(there)} exist: pass --overwrite to replace them, or another --out-dir")
    rows = read_rows(args.file)  # a row without an id gets its line in FILE: one id, whichever split
    splits = split_rows(rows, args.by, args.ratios, args.seed, args.file)
    for path, part in zip(paths, splits):
        write_jsonl(path, part)
    n_groups = len({group_key(r, args.by, "") for r in rows})
    by = f"stratified by '{args.by}' ({n_groups} groups)" if args.by else "not stratified"
    counts = ", ".join(f"{p}: {len(s)}" for p, s in zip(paths, splits))
    print(f"{len(rows)} rows of {args.file}, {by}, seed {args.seed} -> {counts}")


COMMANDS = {"mcq": Mcq, "split": Split}
RUNNERS = {Mcq: run_mcq, Split: run_split}

if __name__ == "__main__":
    args = tyro.extras.subcommand_cli_from_dict(
        COMMANDS, prog="python -m nanogrpo.reward_data.convert", description=__doc__.split("\n\n")[0]
    )
    check_or_exit(args)  # each number in the range on its field: else one line, exit 2
    try:
        RUNNERS[type(args)](args)
    except ValueError as e:  # bad data or flags: one line that says what to fix, exit 2 as train.py's
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
