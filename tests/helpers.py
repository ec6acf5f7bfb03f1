"""Small helpers the test files share: writing JSONL rows, running eval.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_rows(path: Path, rows: list[dict]) -> Path:
    """`rows` as a JSONL file at `path` (returned)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_eval(*args, cwd) -> subprocess.CompletedProcess:
    """`python eval.py ARGS` in `cwd`, output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), *map(str, args)], cwd=cwd, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
