"""The allowed range of every numeric flag, and the one check that holds a command's flags to them.

A table maps each numeric field, by its dotted path as the config spells it ('lora.r',
'reward.judge.timeout_s'), to its Range. `check_ranges(args, table)` walks a command's parsed flags (a
dataclass with its nested ones, an argparse Namespace, or a dict of a function's arguments) and raises
FlagRangeError, a ValueError, for the first number outside its range, naming the flag as it is typed:

    --lora.r -1: must be >= 0 (0 = full fine-tune)
    --optim.lr nan: must be a finite number > 0

Every float must be finite. Every numeric field needs a row: a number the table lacks is a bug, raised as
LookupError, and tests/test_flag_ranges.py walks every command's fields (and tries a value just outside
each range) so that a new flag cannot go without one. This module holds the checker (rewards/ imports
nothing of nanogrpo, and its own commands need it) and the tables of rewards' options and commands;
nanogrpo's tables are in nanogrpo/infra/flag_checks.py.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any


class FlagRangeError(ValueError):
    """A flag's number outside its declared range: a ValueError, printed as one line; exit status 2."""


@dataclass(frozen=True)
class Range:
    """lo <= v <= hi (either bound may be None, either may be open); `also`: one more allowed value outside
    the interval (0 = off, say); `note`: what a boundary value means, shown after the rule."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""
    also: float | None = None

    def allows(self, v: float) -> bool:
        if not math.isfinite(v):
            return False
        if self.also is not None and v == self.also:
            return True
        if self.lo is not None and not (v > self.lo if self.lo_open else v >= self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def rule(self) -> str:
        """'>= 0', '> 0', 'in [0, 1)', '<= 1', '' (any finite number); ', or 0' with `also`."""
        lo, hi = _show(self.lo), _show(self.hi)
        if self.lo is not None and self.hi is not None:
            text = f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            text = f"{'>' if self.lo_open else '>='} {lo}"
        elif self.hi is not None:
            text = f"{'<' if self.hi_open else '<='} {hi}"
        else:
            text = ""
        return text + (f", or {_show(self.also)}" if self.also is not None else "")

    def message(self, flag: str, value: Any) -> str:
        vals = value if isinstance(value, (tuple, list)) else (value,)
        rule = self.rule()
        finite = all(math.isfinite(v) for v in vals)
        must = f"must be {rule}" if finite else f"must be a finite number{' ' + rule if rule else ''}"
        each = "each " if isinstance(value, (tuple, list)) else ""
        note = f" ({self.note})" if self.note else ""
        return f"{flag} {' '.join(_show(v) for v in vals)}: {each}{must}{note}"


def at_least(lo: float, note: str = "") -> Range:
    return Range(lo, note=note)


def above(lo: float, note: str = "") -> Range:
    return Range(lo, lo_open=True, note=note)


def within(lo: float, hi: float, note: str = "", lo_open: bool = False, hi_open: bool = False) -> Range:
    return Range(lo, hi, lo_open, hi_open, note)


ANY = Range()
"""Any finite number (a reward threshold, say)."""


def nested(prefix: str, table: Mapping[str, Range]) -> dict[str, Range]:
    """`table` under a nested section: {'r': ...} -> {'lora.r': ...}."""
    return {f"{prefix}.{k}": r for k, r in table.items()}


def flag_name(path: str) -> str:
    """'grpo.eps_low' -> '--grpo.eps-low', as tyro and argparse spell it."""
    return "--" + path.replace("_", "-")


def _show(v: Any) -> str:
    return f"{v:.12g}" if isinstance(v, float) else str(v)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def numbers(args: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every number, or tuple of numbers, in `args` (nested dataclasses included)."""
    if is_dataclass(args) and not isinstance(args, type):
        items = [(f.name, getattr(args, f.name)) for f in fields(args)]
    else:
        items = list((args if isinstance(args, Mapping) else vars(args)).items())
    for name, v in items:
        path = prefix + name
        if is_dataclass(v) and not isinstance(v, type):
            yield from numbers(v, path + ".")
        elif _is_number(v) or (isinstance(v, (tuple, list)) and v and all(_is_number(x) for x in v)):
            yield path, v


def check_ranges(args: Any, table: Mapping[str, Range]) -> None:
    """FlagRangeError naming the first flag of `args` whose number is outside its range in `table`."""
    for path, value in numbers(args):
        rng = table.get(path)
        if rng is None:
            raise LookupError(f"{flag_name(path)} has no declared range: add {path!r} to its command's table")
        if not all(rng.allows(v) for v in (value if isinstance(value, (tuple, list)) else (value,))):
            raise FlagRangeError(rng.message(flag_name(path), value))


def check_or_exit(args: Any, table: Mapping[str, Range]) -> None:
    """check_ranges for a command without a one-line error of its own: the line on stderr, exit 2."""
    try:
        check_ranges(args, table)
    except FlagRangeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# ----------------------------------------------------------------------------- rewards' own options

JUDGE = {  # JudgeConfig: --reward.judge.*, and --llm.* / --server.* where a command drafts or judges
    "concurrency": at_least(1),
    "timeout_s": above(0),
    "max_retries": at_least(0, "0 = no retry"),
    "backoff_s": at_least(0),
    "max_backoff_s": at_least(0),
    "temperature": at_least(0, "0 = greedy"),
    "max_tokens": at_least(0, "0 = enough for the group"),
    "top_logprobs": at_least(1),
    "max_answer_chars": at_least(1),
    "seed": at_least(0),
}
RUBRIC = {"batch_size": at_least(1)}
REWARD = {  # RewardConfig: --reward.*
    "numbers_full": at_least(0, "a relative error"),
    "numbers_half": at_least(0, "a relative error"),
    "semantic_batch_size": at_least(1),
    "semantic_scale": above(0),
    "semantic_baseline_samples": at_least(1),
    "semantic_seed": at_least(0),
    "consistency_n": at_least(1),
    "style_length_tolerance": at_least(0),
    "user_timeout_s": at_least(0, "0 = no limit"),
    "overlong_buffer": at_least(0, "0 = a quarter of the limit"),
    "overlong_max_tokens": at_least(0, "0 = --sampling.max-new-tokens"),
    "random_seed": at_least(0),
    "max_empty_steps": at_least(0, "0 = never stop"),
    **nested("judge", JUDGE),
    **nested("rubric", RUBRIC),
}
GRADE = {"batch_size": at_least(1), "top": at_least(0), **nested("reward", REWARD)}  # rewards.grade
PROBE_TRAIN = {  # python -m rewards.probe train (and nanogrpo.probe)
    "dev_frac": within(0, 1, "the share of questions held out", lo_open=True, hi_open=True),
    "seed": at_least(0),
    "l2": at_least(0, "0 = no penalty"),
    "batch_size": at_least(1),
    "max_len": at_least(1),
}
PROBE_EVAL = {"batch_size": at_least(1)}
