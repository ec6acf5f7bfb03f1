"""Reading training rows from JSONL, CSV, Parquet, datasets folders and the HF cache, with validation; and
writing rows as JSONL (`write_jsonl`: every tool's output file, replaced whole).

A row is one JSON object a line (README "Data"): `prompt` (text or chat messages) is required; the
reference-based graders read `reference`, `answer`, `labels`, `key_points`, `rubric`, ... Bad input is
reported with the file, the line and the field before any model is loaded.

The rows may also come from a CSV file (a header row), a Parquet file, a `datasets` folder (save_to_disk)
or `NAME:SPLIT` from the local Hugging Face cache (docs/DATA.md "Formats and column mapping"); columns are
renamed (--data.prompt-field, --data.rename, ...) before the same checks, and errors name the row.
"""

from __future__ import annotations

import csv
import importlib
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from nanogrpo.infra.metrics import replace_atomically
from nanogrpo_base.rows import (
    MAX_LINE_BYTES,
    DataError,
    check_prompt,
    check_values,
    json_line,
    numbered_rows,
    parse_line,
    read_rows,
)

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
    if isinstance(row.get("completion"), list):  # --algo sft: a transcript (a graded file's is a string)
        check_completion(row["completion"], where)
    return row


def check_completion(messages: list, where: str) -> None:
    """A transcript to train on: chat messages, the last one the assistant's, every content a string."""
    for k, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise DataError(
                f'{where}: completion[{k}] must be a chat message {{"role": str, "content": str}}, got {m!r:.80}'
            )
    if not messages or messages[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: a completion must end on an assistant message (what SFT trains on last); "
            "drop the messages after it"
        )


FORMATS = (
    "a JSONL, CSV or Parquet file, a datasets folder (save_to_disk), NAME:SPLIT from the local Hugging Face "
    "cache, 'demo' or 'recipe:NAME'"
)
# NAME:SPLIT or NAME:CONFIG:SPLIT, NAME possibly owner/name (not a path that exists)
_HUB_SPEC = re.compile(r"^[\w.-]+(/[\w.-]+)?(:[\w.-]+){1,2}$")
# fields a CSV cell holds as JSON text (a chat prompt, lists, objects), and the numeric ones
_JSON_CELLS = {"prompt", "references", "labels", "key_points", "rubric", "options"}
_NUMBER_CELLS = {"human"}


def load_rows(path: str | Path, columns: dict[str, str] | None = None) -> list[dict]:
    """Read, rename (`columns`: source column -> field) and validate the rows of `path`, chosen by its form:
    a .csv file (a header row), a .parquet / .pq file, a folder written by datasets' save_to_disk,
    NAME:SPLIT (or NAME:CONFIG:SPLIT) from the local HF cache, anything else JSONL (nanogrpo_base's read_rows).
    Each row gets `_line` (its line, spreadsheet row or index) and, when it has none, that as its `id`."""
    columns = columns or {}
    p = Path(path)
    spec = str(path)
    if p.is_dir() and any((p / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        return _finish(_disk_rows(p), spec, columns)
    if not p.exists() and _HUB_SPEC.match(spec) and not spec.startswith("recipe:"):
        return _finish(_hub_rows(spec), spec, columns)
    suffix = p.suffix.lower()
    if suffix == ".csv" and p.is_file():
        return _finish(_csv_rows(p, columns), spec, columns, _csv_cells)
    if suffix in (".parquet", ".pq") and p.is_file():
        return _finish(_parquet_rows(p), spec, columns)

    def check(row: dict, where: str) -> None:
        validate_row(_rename(row, columns, where), where)

    return read_rows(path, check, what=FORMATS)


def _rename(row: dict, columns: dict[str, str], where: str) -> dict:
    """Rename the row's fields in place; a column mapped to 'prompt' must be there."""
    for src, dst in columns.items():
        if src in row:
            row[dst] = row.pop(src)
        elif dst == "prompt":
            raise DataError(f"{where}: no field '{src}' (the column mapped to 'prompt'); fix the mapping")
    return row


def _finish(
    raw: Iterable[tuple[int, dict]], source: str, columns: dict[str, str], convert=None
) -> list[dict]:
    """The checks read_rows makes of a JSONL row, for (row number, row) pairs of another format."""

    def check(row: dict, where: str) -> None:
        _rename(row, columns, where)
        if convert is not None:
            convert(row, where)
        check_values(row, where)
        validate_row(row, where)

    return numbered_rows(raw, source, check)


def _need(module: str, pip: str, what: str):
    """Import an optional package, or a DataError with the pip line."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(
            f"reading {what} needs the optional package '{pip}': pip install {pip} "
            "(or pip install -e '.[data]' for every format)"
        ) from None


def _plain(x: Any) -> Any:
    """A value of a columnar row as JSON would hold it: NaN (a missing float) is None, bytes are decoded,
    dates and decimals become text."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return None if math.isnan(x) else x
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, bytes):
        return x.decode("utf-8", errors="replace")
    if hasattr(x, "tolist"):  # numpy scalars and arrays
        return _plain(x.tolist())
    return str(x)


def _columnar(row: dict) -> dict:
    """A row of a Parquet or datasets table: missing (null) cells are left out, as a JSONL row omits them."""
    return {str(k): v for k, v in ((k, _plain(v)) for k, v in row.items()) if v is not None}


def _csv_rows(path: Path, columns: dict[str, str]) -> Iterator[tuple[int, dict]]:
    """(spreadsheet row number: the header is row 1, row) of each non-blank record of a UTF-8 CSV file."""
    csv.field_size_limit(max(csv.field_size_limit(), MAX_LINE_BYTES))
    with path.open("rb") as f:
        head = f.read(4)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(f"{path}: the file is UTF-16 encoded; save it as UTF-8 (CSV UTF-8)")
    n = 1
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header:
                raise DataError(f"{path}: the file is empty; the first row names the columns")
            header = [h.strip() for h in header]
            if "" in header or len(set(header)) < len(header):
                raise DataError(f"{path}:1: the header row has an empty or repeated column name: {header}")
            for src, dst in columns.items():
                if src not in header and dst == "prompt":
                    raise DataError(
                        f"{path}:1: no column '{src}' (the column mapped to 'prompt'); the columns are "
                        f"{', '.join(header)}"
                    )
            for cells in reader:
                n += 1
                if not any(c.strip() for c in cells):
                    continue
                if len(cells) > len(header):
                    raise DataError(
                        f"{path}:{n}: {len(cells)} cells, the header names {len(header)} columns "
                        "(quote a cell that holds a comma)"
                    )
                yield n, dict(zip(header, cells))
    except UnicodeDecodeError:
        raise DataError(f"{path}:{n + 1}: not UTF-8; save the file as UTF-8 (CSV UTF-8)") from None
    except csv.Error as e:
        raise DataError(f"{path}:{n}: malformed CSV ({e})") from None


def _csv_cells(row: dict, where: str) -> None:
    """CSV cells are text: an empty cell is a missing field (CSV has no null; an empty prompt is refused), a
    chat prompt, a list or an object is read from its JSON, a number from its text."""
    for name, cell in list(row.items()):
        if cell == "" and name != "prompt":
            del row[name]
        elif name in _JSON_CELLS and cell.lstrip()[:1] in ("[", "{"):
            try:
                row[name] = parse_line(f'{{"v": {cell}}}', where)["v"]
            except DataError as e:
                raise DataError(f"{e} in field '{name}' (a CSV cell holding JSON)") from None
        elif name in _NUMBER_CELLS:
            try:
                row[name] = float(cell)
            except ValueError:
                raise DataError(f"{where}: field '{name}' must be a number, got {cell[:40]!r}") from None


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """(row index from 0, row) of each row of a Parquet file, read a batch at a time."""
    _need("pyarrow", "pyarrow", "a Parquet file")
    pq = _need("pyarrow.parquet", "pyarrow", "a Parquet file")
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors for a file that is not Parquet
        raise DataError(f"{path}: not a Parquet file ({e})") from None
    i = 0
    for batch in pf.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield i, _columnar(row)
            i += 1


def _disk_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """(row index from 0, row) of a folder written by Dataset.save_to_disk; a DatasetDict folder with one
    split reads that split, with several asks for one (DIR/SPLIT)."""
    datasets = _need("datasets", "datasets", "a datasets folder")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"{path}: not a folder written by datasets' save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise DataError(
                f"{path}: holds the splits {', '.join(ds)}; give one, e.g. {path / next(iter(ds))}"
            )
        ds = next(iter(ds.values()))
    for i, row in enumerate(ds):
        yield i, _columnar(row)


@contextmanager
def _offline(datasets):
    """HF_DATASETS_OFFLINE=1 for the call: datasets and huggingface_hub read only the local cache."""
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def _hub_rows(spec: str) -> Iterator[tuple[int, dict]]:
    """(row index from 0, row) of NAME:SPLIT or NAME:CONFIG:SPLIT from the local HF datasets cache; nothing
    is downloaded."""
    if sys.modules.get("datasets") is None:  # datasets reads HF_DATASETS_OFFLINE once, at import
        saved = os.environ.get("HF_DATASETS_OFFLINE")
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        try:
            datasets = _need("datasets", "datasets", f"{spec} from the Hugging Face cache")
        finally:
            if saved is None:
                del os.environ["HF_DATASETS_OFFLINE"]
            else:
                os.environ["HF_DATASETS_OFFLINE"] = saved
    else:
        datasets = sys.modules["datasets"]
    name, *config, split = spec.split(":")
    try:
        with _offline(datasets):
            ds = datasets.load_dataset(name, *config, split=split, download_mode="reuse_cache_if_exists")
    except Exception as e:
        raise DataError(
            f"{spec}: not in the local Hugging Face cache ({type(e).__name__}: {str(e)[:200]}); nanogrpo "
            "reads the cache only, never downloads: load it once online with datasets.load_dataset, or give "
            f"a file or a save_to_disk folder ({FORMATS})"
        ) from None
    for i, row in enumerate(ds):
        yield i, _columnar(row)


def jsonl_text(rows: Iterable[dict]) -> str:
    """Rows as JSONL, one a line; keys starting with '_' are the reader's bookkeeping (the source line, the
    prompt's tokens), not data."""
    return "".join(json_line({k: v for k, v in row.items() if not k.startswith("_")}) + "\n" for row in rows)


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Write rows as JSONL (jsonl_text), replacing the file whole: a crash or a full disk leaves the old one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, jsonl_text(rows))
