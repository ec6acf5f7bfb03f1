"""The allowed range of every numeric flag, and the one check that holds a command's flags to them.

A flag's Range sits on its own field, as `typing.Annotated` metadata that tyro ignores:

    steps: Annotated[int, at_least(1)] = 20
    r: Annotated[int, at_least(0, "0 = full fine-tune")] = 16

`check_ranges(cfg)` walks a command's parsed flags (a dataclass with its nested ones: each field's Range is
read from `typing.get_type_hints(cls, include_extras=True)`) and raises FlagRangeError, a ValueError, for the
first number outside its range, naming the flag as it is typed:

    --lora.r -1: must be >= 0 (0 = full fine-tune)
    --optim.lr nan: must be a finite number > 0

A command without a dataclass (an argparse Namespace, or a dict of a function's arguments) passes a table,
{dotted path: Range}: `check_ranges(args, TABLE)`. Every float must be finite. Every numeric flag needs a
range: a number without one is a bug, raised as LookupError, and tests/test_flag_ranges.py walks every
command's fields (and tries a value just outside each range) so that a new flag cannot go without one.
"""

from __future__ import annotations

import functools
import math
import sys
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass
from types import MappingProxyType
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


def flag_name(path: str) -> str:
    """'grpo.eps_low' -> '--grpo.eps-low', as tyro and argparse spell it."""
    return "--" + path.replace("_", "-")


def _show(v: Any) -> str:
    return f"{v:.12g}" if isinstance(v, float) else str(v)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@functools.cache
def field_ranges(cls: type, prefix: str = "") -> Mapping[str, Range]:
    """{dotted path: Range} of a dataclass's fields, nested dataclasses included: each field's Range is its
    `Annotated` metadata. A field without one is left out (check_ranges refuses its number)."""
    out: dict[str, Range] = {}
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in fields(cls):
        hint = hints[f.name]
        bare = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
        if is_dataclass(bare):
            out.update(field_ranges(bare, f"{prefix}{f.name}."))
        elif rng := next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Range)), None):
            out[prefix + f.name] = rng
    return MappingProxyType(out)  # read-only: the answer is cached


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


def check_ranges(args: Any, table: Mapping[str, Range] | None = None) -> None:
    """FlagRangeError naming the first flag of `args` whose number is outside its range: the ranges on the
    fields of a dataclass `args`, or `table`'s for a command without one (a Namespace, a dict)."""
    if table is None:
        if not is_dataclass(args) or isinstance(args, type):
            raise TypeError(
                f"check_ranges: a {type(args).__name__} has no fields to read ranges from; pass a table"
            )
        table = field_ranges(type(args))
        fix = "annotate its field with its Range, e.g. Annotated[int, at_least(0)]"
    else:
        fix = "add {path!r} to its command's table"
    for path, value in numbers(args):
        rng = table.get(path)
        if rng is None:
            raise LookupError(f"{flag_name(path)} has no declared range: {fix.format(path=path)}")
        if not all(rng.allows(v) for v in (value if isinstance(value, (tuple, list)) else (value,))):
            raise FlagRangeError(rng.message(flag_name(path), value))


def check_or_exit(args: Any, table: Mapping[str, Range] | None = None) -> None:
    """check_ranges for a command without a one-line error of its own: the line on stderr, exit 2."""
    try:
        check_ranges(args, table)
    except FlagRangeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
