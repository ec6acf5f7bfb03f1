"""Where the side commands write: their output flags checked before any work, and results files written whole.

`output_folder` and `output_file` check an output flag before a model loads or a run starts, so a mistyped flag
costs nothing: '' is refused (it would write into the current folder), so is a file where a folder goes and a
folder where a file goes, and, for a command that writes a run set (`known`: the names it writes there), a folder
that already holds anything else (a checkout, a home folder: its results would be mixed into someone else's
files). A folder of the command's own names is its earlier run, which the command continues as it always has.
train.py's --out-dir has its own checks (nanogrpo/infra/run_dir.py).

Weights files are written by nanogrpo_base/files.py's `save_tensors` (the umask's mode, I/O errors as
OSError). `write_or_keep` replaces a results file whole and, when that fails late, keeps what was computed
under a new name beside it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def output_file(path: str, flag: str) -> Path:
    """The file an output flag names, checked before any work: not '', not a folder, in a folder (or a place
    for one) that is not a file. Creates nothing."""
    if not path.strip():
        raise ValueError(f"{flag} '': name the file to write (e.g. {flag} out.jsonl)")
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a folder: name a file (e.g. {flag} {p / 'completions.jsonl'})")
    _parents_are_folders(p.parent, flag, path)
    return p


def output_folder(path: str, flag: str, known: Callable[[str], bool] | Iterable[str] | None = None) -> Path:
    """The folder an output flag names, checked before any work: not '', not a file (nor under one), and, with
    `known` (the names the command writes there, or a test of a name), empty or holding only those. Creates
    nothing."""
    if not path.strip():
        raise ValueError(f"{flag} '': name the output folder (e.g. {flag} runs/NAME); '' would write here")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder: name a folder (a new one is created)")
    _parents_are_folders(p, flag, path)
    if known is not None and p.is_dir():
        ok = known if callable(known) else set(known).__contains__
        others = sorted(e.name for e in p.iterdir() if not ok(e.name))
        if others:
            shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
            raise ValueError(
                f"{flag} {path} holds files this command did not write ({shown}): give a new or empty folder "
                "(or the folder of an earlier run of this command, to continue it)"
            )
    return p


def folder_or_exit(path: str, flag: str, known: Callable[[str], bool] | Iterable[str] | None = None) -> Path:
    """output_folder for a command without a one-line error of its own (argparse's): the line, exit 2."""
    try:
        return output_folder(path, flag, known)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _parents_are_folders(p: Path, flag: str, given: str) -> None:
    for up in [p, *p.parents]:
        if up.exists() or up.is_symlink():
            if not up.is_dir():
                raise ValueError(f"{flag} {given}: {up} is a file, not a folder; name another place")
            return


def write_or_keep(path: str | Path, text: str, what: str = "the results") -> None:
    """path's content becomes text, written whole (a temporary name, renamed). If that fails, `text` is kept
    under a new name beside `path` and the ValueError says where, so a late error (the name taken by a folder
    meanwhile, permissions) loses nothing computed; a disk too full for both says so."""
    from nanogrpo.infra.metrics import replace_atomically

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, text)
        return
    except OSError as e:
        why = e.strerror or str(e)
    kept = path.with_name(f"{path.name}.kept-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    try:
        replace_atomically(kept, text)
    except OSError as e2:
        raise ValueError(
            f"cannot write {path} ({why}), nor keep {what} beside it ({e2.strerror or e2})"
        ) from None
    raise ValueError(
        f"cannot write {path} ({why}): {what} are kept in {kept}: rename it once the cause is fixed"
    ) from None
