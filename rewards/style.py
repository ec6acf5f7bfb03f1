"""The style reward of RLVRR: weighted checks derived from the reference.

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

A row may carry its own checks as data, `style_spec` (what `python -m nanogrpo.reward_data style` drafts
from the reference, with an LLM's weights); for that row they replace the built-in checks, and the user
checks still run with their --reward.style-weights weights:

    "style_spec": [{"check": "length", "min_words": 80, "max_words": 200, "weight": 2},
                   {"check": "lists", "present": true, "weight": 1},
                   {"check": "includes", "phrases": ["in summary"], "weight": 0.5}]

- length: 1 for min_words <= n <= max_words; above, max_words / n; below, n / min_words.
- headings, lists, emphasis, code, tables: 1 when the answer's use of the element is `present`.
- includes: the share of `phrases` found in the answer (case-folded word sequences, as keywords match).
A row's spec is checked at start-up with the other fields; a row with a spec needs no reference.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from collections.abc import Callable
from typing import Any

from rewards.base import Grader, Sample, check_text_field, combine
from rewards.options import RewardConfig
from rewards.registry import register
from rewards.spec import parse_spec
from rewards.text import reply_text, words

_PATTERNS = {
    "headings": re.compile(r"(?m)^ {0,3}#{1,6}[ \t]+\S"),
    "lists": re.compile(r"(?m)^[ \t]*(?:[-*+•]|\d{1,3}[.)])[ \t]+\S"),
    "emphasis": re.compile(  # the lookahead first lets the scan skip to the next '*' or '_' at C speed
        r"(?=[*_])(?:\*\*[^*\n]+\*\*|__[^_\n]+__|(?<![*\w])\*[^*\s\n][^*\n]*\*(?![*\w])|(?<![_\w])_[^_\s\n][^_\n]*_(?![_\w]))"
    ),
    "code": re.compile(r"(?m)^[ \t]*(?:```|~~~)"),
    # '[ \t]*\|?[ \t]*' would retry every split of a line of spaces between its two runs (81 s on a
    # 64k-space line): the second run of spaces comes only after the pipe
    "tables": re.compile(r"(?m)^[ \t]*(?:\|[ \t]*)?:?-{3,}:?[ \t]*\|"),
}
# Every pattern is linear in the text: no two quantifiers in a row take the same characters, and each
# emphasis run stops at the next marker or newline, so the runs tried from different starts do not overlap.
ELEMENTS = tuple(_PATTERNS)
"""The markdown elements the checks look for."""
BUILTIN = ("length", *ELEMENTS)
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


def text_style(text: str, checks: tuple[str, ...] = BUILTIN) -> tuple[int, frozenset[str]]:
    """(word count, the markdown elements of `checks` the text uses): what the built-in checks compare."""
    n = len(words(text)) if "length" in checks else 0
    return n, frozenset(name for name in checks if name in _PATTERNS and _PATTERNS[name].search(text))


_reference_style = functools.lru_cache(maxsize=256)(text_style)  # the G answers share a reference


SPEC_CHECKS = (*BUILTIN, "includes")
_SPEC_FIELDS = {
    "length": {"min_words", "max_words"},
    "includes": {"phrases"},
    **{name: {"present"} for name in ELEMENTS},
}
SPEC_EXAMPLE = '[{"check": "length", "min_words": 80, "max_words": 200, "weight": 2}, {"check": "lists", "present": true}]'


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def parse_style_spec(value: Any) -> list[tuple[dict[str, Any], float]]:
    """`style_spec` -> [(check, weight)]; ValueError saying what is wrong (see the module docstring)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be a non-empty list of checks, e.g. {SPEC_EXAMPLE}")
    out, seen = [], set()
    for k, item in enumerate(value):
        name = item.get("check") if isinstance(item, dict) else None
        if name not in SPEC_CHECKS:
            raise ValueError(f'item {k} needs "check": one of {", ".join(SPEC_CHECKS)}, got {name!r}')
        if name in seen:
            raise ValueError(f"item {k}: check '{name}' appears twice; give it once")
        seen.add(name)
        w = item.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
            raise ValueError(f"item {k} ('{name}'): \"weight\" must be a number >= 0, got {w!r}")
        missing = _SPEC_FIELDS[name] - set(item)
        if missing:
            raise ValueError(f"item {k} ('{name}') needs {', '.join(sorted(missing))}")
        if name == "length":
            lo, hi = item["min_words"], item["max_words"]
            if not (_count(lo) and _count(hi) and lo <= hi):
                raise ValueError(
                    f"item {k} ('length'): min_words and max_words must be integers, 0 <= min <= max; got {lo!r}, {hi!r}"
                )
        elif name == "includes":
            ph = item["phrases"]
            if not (isinstance(ph, list) and ph and all(isinstance(p, str) and words(p) for p in ph)):
                raise ValueError(f"item {k} ('includes'): \"phrases\" must be a non-empty list of phrases")
        elif not isinstance(item["present"], bool):
            raise ValueError(f"item {k} ('{name}'): \"present\" must be true or false")
        out.append((item, float(w)))
    if not any(w > 0 for _, w in out):
        raise ValueError("has only zero weights; give the checks that count a weight > 0")
    return out


def spec_score(check: dict[str, Any], n_words: int, has: frozenset[str], spaced: str) -> float:
    """One `style_spec` check on an answer of `n_words` words, using the elements `has`; `spaced` is
    the answer's words joined by spaces with a space at each end (for `includes`)."""
    name = check["check"]
    if name == "length":
        lo, hi = check["min_words"], check["max_words"]
        if n_words > hi:
            return hi / n_words
        return n_words / lo if n_words < lo else 1.0
    if name == "includes":
        phrases = check["phrases"]
        return sum(f" {' '.join(words(p))} " in spaced for p in phrases) / len(phrases)
    return float((name in has) == check["present"])


def spec_scores(spec: list[tuple[dict[str, Any], float]], answer: str) -> list[float]:
    """Each check's score on the answer (the text as the grader sees it)."""
    toks = words(answer)
    _, has = text_style(answer, ELEMENTS)
    spaced = f" {' '.join(toks)} "
    return [spec_score(c, len(toks), has, spaced) for c, _ in spec]


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
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # an error or sys.exit() in the module: one line, never a quiet exit
        raise ValueError(
            f"--reward.style-user-checks {path!r}: importing {mod} failed: {type(e).__name__}: {e}"
        ) from e
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
        if cfg.style_user_checks and not (cfg.allow_user_code or cfg.style_allow_user_code):
            raise ValueError(
                "--reward.style-user-checks runs your Python code; add --reward.allow-user-code to allow it"
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
        if row.get("style_spec") is not None:
            try:
                parse_style_spec(row["style_spec"])
            except ValueError as e:
                return "style_spec", str(e)
            return None
        return check_text_field(row, "reference")

    def _user(self, name: str, answer: str, ref: str, row: dict) -> float | None:
        try:
            v = self.user[name](answer, ref, row)
            return None if v is None else min(1.0, max(0.0, float(v)))
        except KeyboardInterrupt:
            raise
        except BaseException:  # a user check's bug (sys.exit() too) must not stop training; counted, logged
            self.user_errors += 1
            return 0.0

    def score(self, batch: list[Sample]) -> list[float | None]:
        tol = self.cfg.style_length_tolerance
        out: list[float | None] = []
        for s in batch:
            ref = s.row.get("reference")
            if s.row.get("style_spec") is not None:
                out.append(self._row_spec(s, ref if isinstance(ref, str) else ""))
                continue
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

    def _row_spec(self, s: Sample, ref: str) -> float | None:
        """The row's own checks (`style_spec`) and the user checks, weighted together."""
        try:
            spec = parse_style_spec(s.row["style_spec"])
        except ValueError:
            return None  # refused at start-up; a bad row met later is simply not graded
        answer = reply_text(s.completion, self.cfg.text_tag, self.cfg.think_tag)
        vals: list[float | None] = list(spec_scores(spec, answer))
        weights = [w for _, w in spec]
        for n, w in zip(self.checks, self.weights):
            if n in self.user:
                vals.append(self._user(n, answer, ref, s.row))
                weights.append(w)
        return combine(vals, weights, total=1.0)

    def metrics(self) -> dict[str, float]:
        return {"user_check_errors": float(self.user_errors)} if self.user else {}


@register("style")
def _style(cfg: RewardConfig) -> Grader:
    return Style(cfg)
