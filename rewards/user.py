"""Your own grader from a Python file: `--reward.spec "my_rewards.py:brevity:0.3,rouge_l:0.7"`.

`file.py:function[:weight]` loads `function` from `file.py` (relative to the working directory, or
absolute) and logs it as `reward/<function>`. It runs your code, so it needs --reward.allow-user-code,
checked at start-up before the file is imported. A Windows path with a drive letter, or a file name
holding ':' or ',', cannot be written in a spec.

Two signatures are accepted, told apart by the first parameter:

- nanogrpo's `f(batch: list[Sample]) -> list[float | None]`: the first parameter is named `batch`, or
  its annotation names `Sample`;
- otherwise TRL's `f(prompts, completions, **columns) -> list[float | None]`: prompts and completions
  are lists of strings (a chat prompt is its 'role: content' lines), and each field of the rows is a
  keyword argument holding a list, one entry per completion (None where a row lacks the field; fields
  starting with '_', the loader's own, are left out). A function without `**columns` gets only the
  fields it names, and a named field without a default is required of every row at start-up.

None means "does not apply to this row", as for every grader. The numbers are used as returned (not
clipped to [0, 1]: a TRL penalty of -1 stays -1) and NaN counts as None. An exception in your code, a
list of the wrong length or a value that is not a number stops the run with one line naming the file,
the function and the row (its `_line` and `id`) where it can be told: `UserGraderError`, a ValueError,
which train.py prints without a traceback (NANOGRPO_DEBUG=1 shows it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rewards.base import Grader, Sample
from rewards.options import RewardConfig

ALLOW_FLAG = "--reward.allow-user-code"
_REF = re.compile(r"(?P<path>.+?\.py):(?P<func>[A-Za-z_][A-Za-z0-9_]*)")
_TRL_FIXED = ("prompts", "completions")


class UserGraderError(ValueError):
    """A user grader failed: raised, or returned something that is not one score per completion. A
    ValueError, so train.py prints it as one line and exits 2."""


def split_ref(text: str) -> tuple[str, str, str] | None:
    """'my_rewards.py:brevity:0.3' -> ('my_rewards.py', 'brevity', '0.3'); 'x.py:f' -> ('x.py', 'f', '');
    None when `text` does not start with 'file.py:function'."""
    m = _REF.match(text)
    if m is None or (text[m.end() :] and text[m.end()] != ":"):
        return None
    return m["path"], m["func"], text[m.end() + 1 :]


def _row_label(sample: Sample, i: int) -> str:
    """How an error names a sample's row: 'row line 3, id 'q1'', else its position in the batch."""
    row = sample.row if isinstance(sample.row, dict) else {}
    parts = [f"line {row['_line']}"] if "_line" in row else []
    if row.get("id") is not None:
        parts.append(f"id {row['id']!r}")
    return "row " + (", ".join(parts) if parts else f"{i + 1} of the batch")


def _load(path: str, func: str, flag: str) -> Callable[..., Any]:
    """Import `path` (a fresh module each time) and return its callable `func`; ValueError with the fix."""
    file = Path(path).expanduser()
    file = file if file.is_absolute() else Path(os.getcwd()) / file
    where = f"{flag} '{path}:{func}'"
    if not file.is_file():
        raise ValueError(
            f"{where}: no file {str(file)!r} (a relative path is read from the working directory)"
        )
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:8]
    name = "_user_grader_" + re.sub(r"\W", "_", file.stem) + "_" + digest
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ValueError(f"{where}: importing {path} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, func, None)
    if not callable(fn):
        have = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise ValueError(
            f"{where}: {path} has no function '{func}' (its functions: {', '.join(have) or 'none'})"
        )
    return fn


def is_batch_style(fn: Callable[..., Any]) -> bool:
    """nanogrpo's `f(batch)`: the first parameter is named `batch` or annotated with `Sample`."""
    params = list(inspect.signature(fn).parameters.values())
    if not params:
        return False
    first = params[0]
    ann = first.annotation
    ann = ann if isinstance(ann, str) else getattr(ann, "__name__", "") + repr(ann)
    return first.name == "batch" or "Sample" in ann


class UserGrader(Grader):
    """A function from a user's file as a grader (see the module docstring)."""

    def __init__(self, path: str, func: str, fn: Callable[..., Any], flag: str = "--reward.spec"):
        self.name, self.path, self.func, self.fn = func, path, func, fn
        self.where = f"{path}:{func}"
        self.batch_style = is_batch_style(fn)
        params = list(inspect.signature(fn).parameters.values())
        kinds = inspect.Parameter
        self.takes_all = any(p.kind is kinds.VAR_KEYWORD for p in params)
        if self.batch_style:
            self.columns: tuple[str, ...] = ()
            return
        positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 2 and not any(p.kind is kinds.VAR_POSITIONAL for p in params):
            raise ValueError(
                f"{flag} '{self.where}': {func}{inspect.signature(fn)} takes neither (prompts, completions, "
                "**columns), TRL's signature, nor (batch: list[Sample]), nanogrpo's; see docs/GRADERS.md"
            )
        named = [p for p in params[2:] if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
        self.columns = tuple(p.name for p in named)
        self.requires = tuple(p.name for p in named if p.default is kinds.empty)

    def _call(self, batch: list[Sample]) -> Any:
        if self.batch_style:
            return self.fn(batch)
        rows = [s.row if isinstance(s.row, dict) else {} for s in batch]
        keys: dict[str, None] = {}
        for row in rows:
            keys.update(dict.fromkeys(k for k in row if not k.startswith("_")))
        wanted = [k for k in keys if k not in _TRL_FIXED] if self.takes_all else list(self.columns)
        columns = {k: [row.get(k) for row in rows] for k in wanted}
        return self.fn([s.prompt for s in batch], [s.completion for s in batch], **columns)

    def _fail(self, what: str, cause: BaseException | None = None) -> UserGraderError:
        err = UserGraderError(f"user grader {self.where}: {what}")
        err.__cause__ = cause
        return err

    def score(self, batch: list[Sample]) -> list[float | None]:
        try:
            out = self._call(batch)
        except Exception as e:
            raise self._fail(f"raised {type(e).__name__}: {e} ({self._culprit(batch)})", e) from e
        try:
            out = list(out)
        except TypeError:
            raise self._fail(f"returned {type(out).__name__}, not a list of numbers or None") from None
        if len(out) != len(batch):
            raise self._fail(
                f"returned {len(out)} scores for {len(batch)} completions; return one per completion"
            )
        scores: list[float | None] = []
        for i, v in enumerate(out):
            if v is None:
                scores.append(None)
                continue
            if not isinstance(v, numbers.Real):
                raise self._fail(
                    f"returned {type(v).__name__} {v!r} for {_row_label(batch[i], i)}; return a number or None"
                )
            v = float(v)
            if math.isinf(v):
                raise self._fail(
                    f"returned {v} for {_row_label(batch[i], i)}; return a finite number or None"
                )
            scores.append(None if v != v else v)  # NaN is no score
        return scores

    def _culprit(self, batch: list[Sample]) -> str:
        """The first row that raises alone (the batch is scored again one row at a time), else the batch."""
        if len(batch) > 1:
            for i, s in enumerate(batch):
                try:
                    self._call([s])
                except Exception:
                    return "on " + _row_label(s, i)
        labels = sorted({_row_label(s, i) for i, s in enumerate(batch)})
        return "on a batch of " + "; ".join(labels) if len(labels) > 1 else "on " + labels[0]

    def __call__(self, batch: list[Sample]) -> list[float | None]:
        return self.score(batch)  # checked in score; not clipped to [0, 1] as the built-ins are


def make_user_grader(ref: str, cfg: RewardConfig, flag: str = "--reward.spec") -> UserGrader:
    """The grader of 'file.py:function' (`ref`), refused without --reward.allow-user-code."""
    parsed = split_ref(ref)
    assert parsed is not None, f"not a user grader reference: {ref!r}"
    path, func, _ = parsed
    if not cfg.allow_user_code:
        raise ValueError(
            f"{flag} '{ref}' runs your Python code (it imports {path} and calls {func}); "
            f"add {ALLOW_FLAG} to allow it"
        )
    return UserGrader(path, func, _load(path, func, flag), flag)
