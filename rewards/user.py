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

The return value is a list (or a tuple, or a 1-D NumPy array or tensor) with one entry per completion:
a number, or None, which means "does not apply to this row", as for every grader. The numbers are used as
returned (not clipped to [0, 1]: a TRL penalty of -1 stays -1) and NaN counts as None, as a built-in
grader's NaN does. An exception in your code, anything else returned (a dict, whose keys would be taken
for scores; a string; a generator), a list of the wrong length or a value that is not a finite number
stops the run with one line naming the file, the function and the row (its `_line` and `id`) where it
can be told: `UserGraderError`, a ValueError, which train.py prints without a traceback
(NANOGRPO_DEBUG=1 shows it), exiting 2.

Your code cannot end or stall the run without a word:
- `sys.exit()` (SystemExit, and any BaseException but KeyboardInterrupt) at import or in a call is that
  same one-line error, never a quiet exit with your status; Ctrl-C (KeyboardInterrupt) still stops the
  run as Ctrl-C does.
- each call has a time limit, --reward.user-timeout-s (DEFAULT_TIMEOUT_S; 0 = none): past it the run
  stops with the one line, naming the rows of the call (nanogrpo_base/limits.py's call_with_limit). On
  the main thread (train.py, eval.py) a timer signal interrupts your function where it is (a
  BaseException, so `except Exception` in your code does not swallow it); elsewhere (another thread, or
  a SIGALRM timer already in use) the call runs in a thread of its own and is abandoned at the limit: a
  Python thread cannot be killed, so a hung call keeps its thread (a daemon thread, gone when the process
  exits) while the run stops with the error. A call stuck inside C code that never releases the GIL (a
  catastrophic regular expression) can be stopped by neither: keep such work bounded in your code. The
  import itself is not limited: it runs once, at start-up, and may load a model.
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

from nanogrpo_base.limits import Overtime, call_with_limit
from rewards.base import Grader, Sample
from rewards.options import RewardConfig

ALLOW_FLAG = "--reward.allow-user-code"
_REF = re.compile(r"(?P<path>.+?\.py):(?P<func>[A-Za-z_][A-Za-z0-9_]*)")
_TRL_FIXED = ("prompts", "completions")


DEFAULT_TIMEOUT_S = RewardConfig.user_timeout_s
"""The default time limit of one call of a user grader (--reward.user-timeout-s): long enough for a
batch that calls a service or runs tests, short enough that a hung grader stops the run within minutes."""


class UserGraderError(ValueError):
    """A user grader failed: raised, exited, took too long, or returned something that is not one score
    per completion. A ValueError, so train.py prints it as one line and exits 2."""


def _raised(e: BaseException) -> str:
    """'KeyError: 'score'', 'SystemExit: 3', 'SystemExit' for an exception that says nothing."""
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


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


def _rows(batch: list[Sample]) -> str:
    """'on row line 3, id 'q1'', or 'on a batch of ...' naming each row of the batch."""
    labels = sorted({_row_label(s, i) for i, s in enumerate(batch)})
    return "on a batch of " + "; ".join(labels) if len(labels) > 1 else "on " + labels[0]


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
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # sys.exit() at import too: one line, not a quiet exit with its status
        sys.modules.pop(name, None)
        raise ValueError(f"{where}: importing {path} failed: {_raised(e)}") from e
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

    def __init__(
        self,
        path: str,
        func: str,
        fn: Callable[..., Any],
        flag: str = "--reward.spec",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        if not timeout_s >= 0:
            raise ValueError(f"--reward.user-timeout-s must be >= 0 seconds (0 = no limit), got {timeout_s}")
        self.timeout_s = timeout_s
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
        return call_with_limit(lambda: self._call_unlimited(batch), self.timeout_s, "nanogrpo-user-grader")

    def _call_unlimited(self, batch: list[Sample]) -> Any:
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
        except Overtime:  # not run again row by row: each try of a hung grader costs the whole limit
            raise self._fail(
                f"took longer than {self.timeout_s:g} s ({_rows(batch)}); make it faster, or raise "
                "--reward.user-timeout-s (0 = no limit)"
            ) from None
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit too: the run stops with this line, never quietly
            raise self._fail(f"raised {_raised(e)} ({self._culprit(batch)})", e) from e
        if getattr(out, "ndim", None) == 1 and hasattr(out, "tolist"):  # a 1-D NumPy array or tensor
            out = out.tolist()
        if not isinstance(out, (list, tuple)):  # a dict would give its keys, a string its characters
            raise self._fail(
                f"returned {type(out).__name__}, not a list of numbers or None (one per completion)"
            )
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
        """The first row that fails alone (the batch is scored again one row at a time), else the batch."""
        if len(batch) > 1:
            for i, s in enumerate(batch):
                try:
                    self._call([s])
                except KeyboardInterrupt:
                    raise
                except BaseException:  # Overtime and SystemExit too: that row fails alone
                    return "on " + _row_label(s, i)
        return _rows(batch)

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
    if not cfg.user_timeout_s >= 0:  # before the file is imported
        raise ValueError(
            f"--reward.user-timeout-s must be >= 0 seconds (0 = no limit), got {cfg.user_timeout_s}"
        )
    return UserGrader(path, func, _load(path, func, flag), flag, cfg.user_timeout_s)
