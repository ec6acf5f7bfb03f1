"""The style reward of RLVRR (seed 003): weighted checks derived from the reference.

RLVRR has an LLM write a few Python checks per reference (length, markdown) with importance weights.
nanogrpo ships the checks that recur, derived from each row's reference at scoring time, and lets
you add your own:

- length: word count ratio r = answer / reference. Within (1 + tol) either way scores 1
  (--reward.style-length-tolerance, default 0.5: 0.67x to 1.5x); beyond, it falls off as
  (1 + tol) / r above and r (1 + tol) below, continuous at the edges.
- headings, lists, emphasis, code, tables: 1 when the answer uses the element exactly when the
  reference does (markdown headings '#', bullet or numbered lists, **bold**/*italic*/_italic_,
  fenced code blocks, pipe tables), else 0. Absence counts too: a reference in plain prose asks for
  plain prose.
- user checks (--reward.style-user-checks mypkg.checks.cites_source ...): functions
  f(completion: str, reference: str, row: dict) -> float | bool | None, imported by dotted path.
  They run your code, so they are enabled only with --reward.style-allow-user-code. A check that
  raises scores 0 for that row and is counted in the `user_check_errors` metric.

The score is the weighted mean of the checks (--reward.style-weights 'length:2,lists:1,...'; a user
check's weight is keyed by its function name); a check that returns None drops out. None when the
row has no reference. The text checked is the completion without its think block.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from typing import Any

from rewards.base import Grader, Sample, check_text_field
from rewards.options import RewardConfig
from rewards.registry import combine, parse_spec, register
from rewards.text import reply_text, words

_PATTERNS = {
    "headings": re.compile(r"(?m)^ {0,3}#{1,6}[ \t]+\S"),
    "lists": re.compile(r"(?m)^[ \t]*(?:[-*+•]|\d{1,3}[.)])[ \t]+\S"),
    "emphasis": re.compile(
        r"\*\*[^*\n]+\*\*|__[^_\n]+__|(?<![*\w])\*[^*\s\n][^*\n]*\*(?![*\w])|(?<![_\w])_[^_\s\n][^_\n]*_(?![_\w])"
    ),
    "code": re.compile(r"(?m)^[ \t]*(?:```|~~~)"),
    # '[ \t]*\|?[ \t]*' would retry every split of a line of spaces between its two runs (81 s on a
    # 64k-space line): the second run of spaces comes only after the pipe
    "tables": re.compile(r"(?m)^[ \t]*(?:\|[ \t]*)?:?-{3,}:?[ \t]*\|"),
}
# Every pattern is linear in the text: no two quantifiers in a row take the same characters, and each
# emphasis run stops at the next marker or newline, so the runs tried from different starts do not overlap.
BUILTIN = ("length", *_PATTERNS)
UserCheck = Callable[[str, str, dict], Any]


def length_check(answer: str, reference: str, tol: float = 0.5) -> float | None:
    """1 within (1 + tol)x of the reference's word count either way, then decaying; None for an empty reference."""
    return length_ratio_check(len(words(answer)), len(words(reference)), tol)


def length_ratio_check(n_answer: int, n_ref: int, tol: float = 0.5) -> float | None:
    """`length_check` on word counts."""
    if n_ref == 0:
        return None
    r = n_answer / n_ref
    hi = 1.0 + tol
    if r > hi:
        return hi / r
    if r * hi < 1.0:
        return r * hi
    return 1.0


def element_check(name: str, answer: str, reference: str) -> float:
    """1 when the answer has the markdown element exactly when the reference has it."""
    pat = _PATTERNS[name]
    return float(bool(pat.search(answer)) == bool(pat.search(reference)))


def text_style(text: str, checks: tuple[str, ...] = BUILTIN) -> tuple[int, frozenset[str]]:
    """(word count, the markdown elements of `checks` the text uses): what the built-in checks compare."""
    n = len(words(text)) if "length" in checks else 0
    return n, frozenset(name for name in checks if name in _PATTERNS and _PATTERNS[name].search(text))


_reference_style = functools.lru_cache(maxsize=256)(text_style)  # the G answers share a reference


def load_check(path: str) -> UserCheck:
    """Import 'package.module.function'; ValueError with the fix when it is not there."""
    mod, _, fn = path.rpartition(".")
    if not mod:
        raise ValueError(
            f"--reward.style-user-checks {path!r}: write 'module.function', e.g. 'mychecks.cites_source'"
        )
    try:
        f = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"--reward.style-user-checks {path!r}: cannot import it ({e}); is the module on PYTHONPATH?"
        ) from None
    if not callable(f):
        raise ValueError(f"--reward.style-user-checks {path!r} is not a function")
    return f


class Style(Grader):
    requires = ("reference",)

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        if cfg.style_length_tolerance < 0:
            raise ValueError(
                f"--reward.style-length-tolerance must be >= 0, got {cfg.style_length_tolerance}"
            )
        if cfg.style_user_checks and not cfg.style_allow_user_code:
            raise ValueError(
                "--reward.style-user-checks runs your Python code; add --reward.style-allow-user-code to allow it"
            )
        self.user = {p.rpartition(".")[2]: load_check(p) for p in cfg.style_user_checks}
        weights = (
            dict(parse_spec(cfg.style_weights, "--reward.style-weights")) if cfg.style_weights.strip() else {}
        )
        unknown = set(weights) - set(BUILTIN) - set(self.user)
        if unknown:
            raise ValueError(
                f"--reward.style-weights names unknown checks {sorted(unknown)}; built-in: {', '.join(BUILTIN)}, "
                f"user: {', '.join(self.user) or 'none'}"
            )
        self.checks = [n for n in weights if n in BUILTIN] + list(self.user)
        self.weights = [weights.get(n, 1.0) for n in self.checks]
        if not self.checks:
            raise ValueError("style: no checks enabled; set --reward.style-weights, e.g. 'length:1,lists:1'")
        self.builtin = tuple(n for n in self.checks if n in BUILTIN)
        self.user_errors = 0

    def check_row(self, row):
        return check_text_field(row, "reference")

    def _user(self, name: str, answer: str, ref: str, row: dict) -> float | None:
        try:
            v = self.user[name](answer, ref, row)
            return None if v is None else min(1.0, max(0.0, float(v)))
        except Exception:  # a user check's bug must not stop training; it is counted and logged
            self.user_errors += 1
            return 0.0

    def score(self, batch: list[Sample]) -> list[float | None]:
        tol = self.cfg.style_length_tolerance
        out: list[float | None] = []
        for s in batch:
            ref = s.row.get("reference")
            if not isinstance(ref, str):
                out.append(None)
                continue
            answer = reply_text(s.completion, self.cfg.text_tag, self.cfg.think_tag)
            (n_ref, ref_has), (n_ans, ans_has) = (
                _reference_style(ref, self.builtin),
                text_style(answer, self.builtin),
            )
            vals: list[float | None] = []
            for n in self.checks:
                if n == "length":
                    vals.append(length_ratio_check(n_ans, n_ref, tol))
                elif n in _PATTERNS:  # the element is used exactly when the reference uses it
                    vals.append(float((n in ans_has) == (n in ref_has)))
                else:
                    vals.append(self._user(n, answer, ref, s.row))
            out.append(combine(vals, self.weights, total=1.0))
        return out

    def metrics(self) -> dict[str, float]:
        return {"user_check_errors": float(self.user_errors)} if self.user else {}


@register("style")
def _style(cfg: RewardConfig) -> Grader:
    return Style(cfg)
