"""Text helpers shared by the graders: words, tags, answer extraction, normalisation, numbers.

Everything here is total: any string (empty, unicode, megabytes long) goes in, a value comes out, and
the cost is linear in the text: no regular expression has two quantifiers in a row that can take the
same characters (the shape that backtracks quadratically, e.g. '[^>]*\\s*>' on a megabyte of spaces).

Numbers are read the way a reader of a report would: '1,705' is one thousand seven hundred and five,
'9,91' (a European decimal comma) is 9.91, '1.705.000' is 1705000, and a unit glued to the figure or
written after it scales it (K, M, B/bn, T and the words thousand/million/billion/trillion, with the
Italian forms); '%' marks a percentage. Numbers glued to a word ('H2O', 'COVID-19', 'Qwen2.5') are
not figures, and neither are list markers at the start of a line ('1.', '2)') when `skip_lists`.
Numbers are exact: a figure is a Decimal built from its digits and scaled without rounding (Python's
default 28-digit context would make 123456789012345678901234567890 equal ...891). A run of more than
MAX_DIGITS digits is not a number but text, which bounds the cost of every comparison.
"""

from __future__ import annotations

import re
import unicodedata
from collections import deque
from collections.abc import Iterator
from decimal import Context, Decimal
from typing import NamedTuple

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """Case-folded word tokens (unicode letters and digits); punctuation and spaces separate them."""
    return _WORD.findall(text.casefold())


def well_formed(text: str) -> str:
    """The text as valid Unicode: each lone surrogate ('\\ud800'..'\\udfff', which no UTF-8 encoder takes,
    so a tokenizer raises TypeError on it) becomes U+FFFD, and a surrogate pair written as two code
    points becomes its character. Any other text comes back as it is, the same object."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


# ----------------------------------------------------------------------------- tags


def _open_re(tag: str) -> re.Pattern:
    return re.compile(rf"<{re.escape(tag)}(?:\s[^<>]*)?>", re.IGNORECASE)


def _close_re(tag: str) -> re.Pattern:
    return re.compile(rf"</{re.escape(tag)}\s*>", re.IGNORECASE)


def _last(matches: Iterator[re.Match]) -> re.Match | None:
    last = deque(matches, maxlen=1)
    return last[0] if last else None


def tag_content(text: str, tag: str) -> str | None:
    """Content of the last complete <tag>...</tag> block, or None when there is none.

    Found from the last closing tag backwards, so the cost is linear even with many unclosed tags.
    """
    close = _last(_close_re(tag).finditer(text))
    if close is None:
        return None
    start = _last(_open_re(tag).finditer(text, 0, close.start()))
    return None if start is None else text[start.end() : close.start()]


def strip_think(text: str, tag: str = "think") -> str:
    """The completion without its reasoning: drop <think>...</think> blocks, and everything up to a
    closing </think> whose opening tag was in the prompt (Qwen3 / R1 chat templates open it there)."""
    if not tag:
        return text
    open_re, close_re = _open_re(tag), _close_re(tag)
    kept, pos = [], 0
    while (start := open_re.search(text, pos)) and (end := close_re.search(text, start.end())):
        kept.append(text[pos : start.start()])  # a loop, not one regex: linear with many unclosed tags
        pos = end.end()
    text = " ".join([*kept, text[pos:]])
    close = _last(close_re.finditer(text))
    return text if close is None else text[close.end() :]


def think_content(text: str, tag: str = "think") -> str | None:
    """The reasoning block: <think>...</think>, or the text before a lone </think> (opened in the prompt)."""
    got = tag_content(text, tag)
    if got is not None:
        return got
    close = _close_re(tag).search(text)
    return text[: close.start()] if close else None


def extract(text: str, tag: str = "", regex: str = "") -> str | None:
    """The answer part of a completion: the last match of `regex` (its first group if it has one),
    else the content of the last <tag> block; None when asked for and absent; the text itself when
    neither is given."""
    if regex:
        try:
            matches = list(re.finditer(regex, text, re.S))
        except re.error as e:
            raise ValueError(
                f"--reward.answer-regex {regex!r} is not a valid regular expression: {e}"
            ) from None
        if not matches:
            return None
        m = matches[-1]
        return m.group(1) if m.re.groups and m.group(1) is not None else m.group(0)
    if tag:
        return tag_content(text, tag)
    return text


# ----------------------------------------------------------------------------- numbers

_SCALE = {
    "k": 3, "thousand": 3, "thousands": 3, "mila": 3,
    "m": 6, "mn": 6, "mln": 6, "million": 6, "millions": 6, "milione": 6, "milioni": 6,
    "b": 9, "bn": 9, "billion": 9, "billions": 9, "mld": 9, "miliardo": 9, "miliardi": 9,
    "t": 12, "tn": 12, "trillion": 12, "trillions": 12,
}  # fmt: skip
# a single capital letter scales only when glued to the figure ('1,705M'); '5 M' may be anything
_GLUED = r"(?-i:[kKMBT])|bn|mn|mln|mld"
_WORDS = r"thousands?|mila|millions?|milion[ei]|mld|mln|billions?|miliard[oi]|trillions?|bn|mn|tn"
_NUMBER = re.compile(
    rf"""
    (?=[-\u2212+$€£¥\d])                     # starts at a sign, a currency or a digit: lets the scan skip prose
    (?<![\w.,])(?<![^\W\d_][-\u2010])       # not glued to a word: 'H2O', 'COVID-19', 'v1.2'
    (?P<sign>[-\u2212+](?=[$€£¥]?\d))?
    [$€£¥]?
    (?P<num>\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?     # 1,705,000.5
          | \d{{1,3}}(?:\.\d{{3}}){{2,}}(?:,\d+)?  # 1.705.000,5
          | \d{{1,3}}\.\d{{3}},\d+                 # 1.705,5
          | \d+(?:[.,]\d+)?                        # 1705 / 9.91 / 9,91
          )
    (?:(?P<pct>\s?%|\s(?:percent|per\ cent|per\ cento|percento)\b)
      |(?P<glued>{_GLUED})(?![^\W_])
      |\s(?P<word>{_WORDS})\b
    )?
    (?![^\W_])                               # '3rd', '10x' are not figures
    """,
    re.VERBOSE | re.IGNORECASE,
)
_LIST_MARKER = re.compile(r"(?m)^([ \t]*(?:[-*+•][ \t]+)?)\(?\d{1,3}[.)](?=\s)")


MAX_DIGITS = 1000
"""The most digits one number may have (separators aside); a longer digit run is read as text."""
# exact for any figure: at most MAX_DIGITS digits, scaled by at most 10^12, so a difference or a product
# of two needs under 3 * MAX_DIGITS digits, and exponents stay far inside the limits
EXACT = Context(prec=3 * MAX_DIGITS, Emax=10 * MAX_DIGITS, Emin=-10 * MAX_DIGITS)


class Figure(NamedTuple):
    value: Decimal
    """The exact value after scaling by its unit (1,705M -> 1705000000); a percentage keeps its number."""
    percent: bool
    span: tuple[int, int]


def _digits(num: str) -> str:
    """'1,705.5' -> '1705.5', '1.705,5' -> '1705.5', '9,91' -> '9.91', '1,705' -> '1705'."""
    if "," in num and "." in num:
        dec = "," if num.rfind(",") > num.rfind(".") else "."
        return num.replace("." if dec == "," else ",", "").replace(",", ".")
    if num.count(".") > 1:
        return num.replace(".", "")
    if "," in num:
        groups = num.split(",")
        if len(groups) > 2 or len(groups[1]) == 3:  # thousands separators
            return num.replace(",", "")
        return num.replace(",", ".")
    return num


def _figure(m: re.Match) -> Figure | None:
    sign, num, pct, glued, word = m.group("sign", "num", "pct", "glued", "word")
    if len(num) > MAX_DIGITS and len(num) - num.count(",") - num.count(".") > MAX_DIGITS:
        return None  # the whole run is skipped, never a prefix of it: '1,777...' is not 1.777
    value = Decimal(_digits(num))  # the constructor is exact; arithmetic in the default context is not
    unit = glued or word
    if unit:
        value = value.scaleb(_SCALE[unit.lower()], EXACT)
    if sign == "-" or sign == "\u2212":
        value = value.copy_negate()
    return Figure(value, pct is not None, m.span())


def figures(text: str, skip_lists: bool = True) -> list[Figure]:
    """Every number in the text with its unit applied, left to right (digit runs past MAX_DIGITS skipped)."""
    if skip_lists:  # blank list markers, keeping offsets
        text = _LIST_MARKER.sub(lambda m: m.group(1) + " " * (m.end() - m.end(1)), text)
    return [f for m in _NUMBER.finditer(text) if (f := _figure(m)) is not None]


def figure_values(text: str, skip_lists: bool = True) -> list[Decimal]:
    """The distinct values of `figures(text)`, in order of first appearance (1705M and 1.705B are one);
    each distinct spelling is parsed once, so a megabyte of numbers costs about one regex pass."""
    if skip_lists:
        text = _LIST_MARKER.sub(lambda m: m.group(1) + " " * (m.end() - m.end(1)), text)
    seen: dict[str, None] = {}
    values: dict[Decimal, None] = {}
    for m in _NUMBER.finditer(text):
        key = m.group()
        if key not in seen:
            seen[key] = None
            if (f := _figure(m)) is not None:
                values[f.value] = None
    return list(values)


def canonical(value: Decimal, percent: bool = False) -> str:
    """One spelling per number: 1000, 0.5, -3 (no exponent, no trailing zeros), every digit kept."""
    s = format(value, "f")  # exact, where value.normalize() would round to 28 digits
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    if s == "-0":
        s = "0"
    return s + ("%" if percent else "")


# ----------------------------------------------------------------------------- normalisation

NORMALIZE_STEPS = ("case", "space", "punct", "numbers")


def _punct_table(text: str, repl: str) -> dict[int, str]:
    # punctuation (P*) and symbols (S*: $, +, emoji) go; letters, marks, digits and spaces stay.
    # One category lookup per distinct character, then str.translate: linear, at C speed.
    return {ord(c): repl for c in set(text) if unicodedata.category(c)[0] in "PS"}


def normalize(text: str, steps: tuple[str, ...] = NORMALIZE_STEPS) -> str:
    """Normalise an answer for comparison. Steps: 'case' (case-fold), 'space' (collapse runs of space,
    strip the ends), 'punct' (drop punctuation and symbols), 'numbers' (one exact spelling per number,
    so '1,000' == '1000' == '1000.0' and '-5' keeps its sign even when punctuation goes; a digit run
    longer than MAX_DIGITS stays text)."""
    bad = set(steps) - set(NORMALIZE_STEPS)
    assert not bad, f"unknown normalisation steps {sorted(bad)}; known: {NORMALIZE_STEPS}"
    text = unicodedata.normalize("NFKC", text)
    space = "space" in steps
    table = {}
    if "punct" in steps:  # the characters of the prose once case-folded: casefold can add some ('ß' -> 'ss')
        table = _punct_table(text.casefold() if "case" in steps else text, " " if space else "")
    # pieces alternate prose, number, prose, ..., prose; each distinct match is spelled once, so a
    # megabyte of numbers costs one regex pass and a dictionary look-up per number
    pieces: list[str] = []
    pos = 0
    spelled: dict[str, str | None] = {}  # None: a digit run past MAX_DIGITS, left in the prose
    for m in _NUMBER.finditer(text) if "numbers" in steps else ():
        key = m.group()
        if key not in spelled:
            f = _figure(m)
            c = None if f is None else canonical(f.value, f.percent)
            spelled[key] = None if c is None else f" {c} " if space else c
        if spelled[key] is None:
            continue
        start, end = m.span()
        pieces += (text[pos:start], spelled[key])
        pos = end
    pieces.append(text[pos:])
    case = "case" in steps
    pieces[0::2] = [(p.casefold() if case else p).translate(table) for p in pieces[0::2]]
    text = "".join(pieces)
    return " ".join(text.split()) if space else text


def reply_text(completion: str, text_tag: str = "", think_tag: str = "think") -> str:
    """What the reference-based graders compare with the reference: the content of `text_tag` when set
    ('' when the completion lacks it), else the completion without its think block."""
    if text_tag:
        got = tag_content(completion, text_tag)
        return "" if got is None else got
    return strip_think(completion, think_tag)
