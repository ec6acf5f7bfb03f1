"""The build's rows: reading the input, the references of a row, writing the output and the rows left out.

Input rows are read with the trainer's reader (nanogrpo_base.rows.read_rows: a bad line stops with file and
line). Output rows are the input rows with the build's field added and nothing else changed, except
that a row without an `id` gets its input line number as one, so every output row traces back to the
line it came from. A row the build cannot make good is never written half-made: it goes to the
rejected file, one JSON line {"line", "id", "why"}, and to stderr as `file:line: why`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nanogrpo.formats import write_jsonl
from nanogrpo.infra.outputs import output_file
from nanogrpo_base.rows import read_rows


def load(path: str, limit: int = 0) -> list[dict[str, Any]]:
    """The rows of a JSONL file (each with `_line`, and `id` when it had none); the first `limit` if > 0."""
    rows = read_rows(path)
    return rows[:limit] if limit > 0 else rows


def references(row: dict[str, Any]) -> list[str]:
    """The row's reference texts: `reference` then the list `references` (as the keywords grader reads them)."""
    extra = row.get("references")
    refs = [row.get("reference"), *(extra if isinstance(extra, list) else [])]
    return [r for r in refs if isinstance(r, str) and r.strip()]


def out_paths(out: str, source: str) -> tuple[Path, Path]:
    """(rejected file, default cache file) next to `out`; refuses, before any drafting, an `out` that is the
    input itself, '', a folder, or under a file (infra/outputs.output_file)."""
    p = output_file(out, "--out")
    if p.resolve() == Path(source).resolve():
        raise ValueError(f"--out {out} is the input file; write the output to another file")
    return p.with_suffix(".rejected.jsonl"), p.with_suffix(".cache.jsonl")


def clean(row: dict[str, Any]) -> dict[str, Any]:
    """The row as it goes out: without the reader's `_line`."""
    return {k: v for k, v in row.items() if k != "_line"}


@dataclass
class Rejects:
    """Rows left out, with why; `report` prints them as file:line and writes the rejected file."""

    source: str
    items: list[dict[str, Any]]

    def add(self, row: dict[str, Any], why: str) -> None:
        self.items.append({"line": row.get("_line"), "id": row.get("id"), "why": why})

    def report(self, path: Path) -> None:
        for r in self.items:
            print(f"{self.source}:{r['line']}: {r['why']}", file=sys.stderr)
        if self.items:
            write_jsonl(path, self.items)
        elif path.exists():
            path.unlink()  # a rerun that left nothing out: no stale rejects from an earlier run


def chunks(rows: list[dict[str, Any]], size: int, desc: str) -> Iterator[list[dict[str, Any]]]:
    """Rows in chunks of `size`, with a progress bar over rows (shown on a terminal only)."""
    with tqdm(total=len(rows), desc=desc, unit="row", disable=None, file=sys.stderr) as bar:
        for i in range(0, len(rows), max(1, size)):
            part = rows[i : i + max(1, size)]
            yield part
            bar.update(len(part))
