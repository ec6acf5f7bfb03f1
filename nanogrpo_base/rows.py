"""Reading JSONL rows safely: the one reader behind train.py's data, `eval.py grade` and the eval files; and
writing them (`json_line`: the one writer of a JSONL line, of rows and of the run's logs).

Each line is one JSON object. A bad file or line stops the caller with a `DataError` (a ValueError) that
names the file, the line and, where it applies, the field, and says what to do, before any model or grader
is loaded. The reader never loads a hostile file into memory whole and never raises anything else:

- a directory, a missing file, a UTF-16/UTF-32 file (by its byte-order mark) or bytes that are not UTF-8
  are refused with the line where decoding failed (a UTF-8 byte-order mark is accepted);
- a line over `max_line_bytes` is refused after reading only that many bytes of it;
- JSON nested deeper than `MAX_DEPTH`, integers of more than `MAX_INT_DIGITS` digits, NaN / Infinity (not
  JSON) and strings with lone surrogates (text that cannot be encoded, so no tokenizer can read it) are
  refused with the field that holds them;
- chat prompts must be lists of {"role", "content"} messages with a known role and string content.

`prompt_text` and `turn_text` give a prompt and an episode's transcript as plain 'role: content' text, the
one form graders, judges, logs and the run page show.

This module is part of the base both packages build on (nanogrpo_base: it imports neither), so the graders'
CLI reads rows with it; nanogrpo/formats.py and nanogrpo/data.py build the training rows' checks on top of it.
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

MAX_LINE_BYTES = 16 << 20  # 16 MiB: far above any real row, far below a line that would exhaust memory
MAX_DEPTH = 64  # nesting of objects and arrays in one row
MAX_INT_DIGITS = 1000  # an integer longer than this is not a count, a score or an id
CHAT_ROLES = ("system", "user", "assistant", "tool")

_BOMS = {
    codecs.BOM_UTF32_LE: "UTF-32",
    codecs.BOM_UTF32_BE: "UTF-32",
    codecs.BOM_UTF16_LE: "UTF-16",
    codecs.BOM_UTF16_BE: "UTF-16",
}


class DataError(ValueError):
    """Bad data: the message names the file, the line and the field, and what to write instead."""


def _parse_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise DataError(f"an integer of {len(s)} digits (at most {MAX_INT_DIGITS}; write it as a string)")
    return int(s)


def _parse_constant(name: str) -> float:
    raise DataError(f"{name} is not JSON (write null, or the number as a string)")


def _check_value(x: Any, field: str, depth: int = 0) -> None:
    """Depth and encodability of a parsed value; `field` is its path for the message."""
    if depth > MAX_DEPTH:
        raise DataError(f"field '{field}' is nested more than {MAX_DEPTH} levels deep")
    if isinstance(x, float) and not math.isfinite(x):
        raise DataError(f"field '{field}' is a number too large for a float ({x}); write it as a string")
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(
                f"field '{field}' holds a lone surrogate (an unpaired \\ud800-\\udfff escape): not text; "
                "fix the escape or drop the character"
            ) from None
    elif isinstance(x, dict):
        for k, v in x.items():
            _check_value(k, field, depth + 1)
            _check_value(v, f"{field}.{k}" if field else str(k), depth + 1)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _check_value(v, f"{field}[{i}]", depth + 1)


def check_values(row: dict, where: str) -> None:
    """The checks parse_line makes of a parsed row's values (depth, lone surrogates, non-finite floats), for
    rows read from other formats (CSV, Parquet, datasets); a DataError names `where` and the field."""
    try:
        _check_value(row, "")
    except DataError as e:
        raise DataError(f"{where}: {e}") from None


def parse_line(line: str, where: str) -> dict:
    """One JSONL line -> a JSON object, or a DataError naming `where` ('file:line')."""
    try:
        row = json.loads(line, parse_int=_parse_int, parse_constant=_parse_constant)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # e.g. a float literal too long for Python to convert
        raise DataError(f"{where}: malformed JSON ({e})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    try:
        _check_value(row, "")
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    return row


def _lines(path: Path, max_line_bytes: int) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line, decoded as UTF-8, each read with a bounded size."""
    with path.open("rb") as f:
        head = f.read(4)
        for bom, name in _BOMS.items():
            if head.startswith(bom):
                raise DataError(
                    f"{path}: the file is {name} encoded; save it as UTF-8 (one JSON object a line)"
                )
        f.seek(len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0)
        lineno = 0
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                return
            lineno += 1
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise DataError(
                    f"{path}:{lineno}: the line is longer than {max_line_bytes} bytes; one row a line, "
                    "each under that size (is this a JSONL file?)"
                )
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not UTF-8 (byte {e.start + 1} of the line); save the file as UTF-8"
                ) from None
            yield lineno, text


def read_rows(
    path: str | Path,
    check: Callable[[dict, str], Any] | None = None,
    *,
    what: str = "a JSONL file: one JSON object a line",
    max_line_bytes: int = MAX_LINE_BYTES,
) -> list[dict]:
    """Every row of a JSONL file (blank lines skipped), each given `_line` and, when it has none, `id`.

    `check(row, 'file:line')` validates a row (raise DataError); `what` describes the file in the message
    for a missing one."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory; give {what}")
    if not path.is_file():
        raise DataError(f"{path}: no such file (give {what})")
    pairs = ((n, parse_line(line, f"{path}:{n}")) for n, line in _lines(path, max_line_bytes) if line.strip())
    return numbered_rows(pairs, str(path), check, what="file")


def numbered_rows(
    pairs: Iterable[tuple[int, dict]],
    source: str,
    check: Callable[[dict, str], Any] | None = None,
    what: str = "data",
) -> list[dict]:
    """The rows of (row number, row) pairs from any reader, each checked as `check(row, 'source:n')` and
    given `_line` and, when it has none, `id` (the number); no rows at all is a DataError."""
    rows = []
    for n, row in pairs:
        if check is not None:
            check(row, f"{source}:{n}")
        row.setdefault("id", n)
        row["_line"] = n
        rows.append(row)
    if not rows:
        raise DataError(f"{source}: the {what} has no rows")
    return rows


def check_prompt(prompt: Any, where: str) -> None:
    """A prompt is a non-empty string, or a non-empty list of chat messages with known roles."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: field 'prompt' is empty; write the question as a non-empty string")
        return
    if isinstance(prompt, list) and prompt:
        for i, m in enumerate(prompt):
            if not (
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            ):
                raise DataError(
                    f'{where}: field \'prompt\' message {i} must be {{"role": str, "content": str}}, got '
                    f"{_short(m)}"
                )
            if m["role"] not in CHAT_ROLES:
                raise DataError(
                    f"{where}: field 'prompt' message {i} has role {_short(m['role'])}; use one of "
                    f"{', '.join(CHAT_ROLES)}"
                )
        if not any(m["content"].strip() for m in prompt):
            raise DataError(f"{where}: field 'prompt' has only empty messages; give the user's question")
        return
    raise DataError(
        f"{where}: field 'prompt' must be a non-empty string or a non-empty list of chat messages, got "
        f"{_short(prompt)}"
    )


def _short(x: Any, n: int = 80) -> str:
    """repr(x), cut to n characters (a message must not quote a megabyte)."""
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def prompt_text(prompt: Any) -> str:
    """A prompt as plain text, for graders and logs: a chat prompt becomes 'role: content' lines."""
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt)
    return prompt if isinstance(prompt, str) else ""


def turn_text(turns: list[dict]) -> str:
    """Messages as 'role: text' paragraphs: how judges, the run page and the W&B table show an episode."""
    return "\n\n".join(f"{t.get('role', '?')}: {t.get('content', '')}" for t in turns)


def json_safe(x: Any) -> Any:
    """JSON-safe, all the way down: tensors to numbers, NaN/inf to None, tuples to lists, and lone surrogates in
    text (a file name decoded with os.fsdecode, an exception's message) replaced."""
    if isinstance(x, dict):
        return {json_safe(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, str):
        return x if x.isascii() else x.encode("utf-8", "replace").decode("utf-8")
    if hasattr(x, "item") and not isinstance(x, (int, float)):
        try:
            x = x.item()
        except (ValueError, RuntimeError):  # an array of several values
            return json_safe(x.tolist())
    return None if isinstance(x, float) and not math.isfinite(x) else x


def json_line(obj: Any) -> str:
    """One line of JSON for a log or a JSONL file: json_safe, written as UTF-8 text; never NaN, never a
    character UTF-8 cannot hold (a ValueError if anything else slipped through)."""
    return json.dumps(json_safe(obj), ensure_ascii=False, allow_nan=False)
