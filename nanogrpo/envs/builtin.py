"""The built-in environments: they run offline on a CPU, each with a small task file (nanogrpo/recipes/).

- `guess`: guess a number in [lo, hi]; each wrong guess is answered "higher" or "lower". Reward 1 when
  found, less a little per turn used (0.1), 0 if never found. Rows: {"lo", "hi"}; the target is drawn from
  the reset seed, so a group plays one number.
- `calc`: a calculator tool. The model writes `<calc>12 * (3 + 4)</calc>` and gets the value back as a
  tool message; it answers with `<answer>...</answer>`. Reward 1 for the row's `answer`, else 0. The
  arithmetic is evaluated by `arith` (numbers, + - * / // % ** and parentheses, every value a finite real
  within 1e15), never by eval(); anything else is answered `error: ...`.
- `search`: a search tool over a small shipped corpus (recipes/search_corpus.jsonl). `<search>words</search>`
  returns the best two passages with their ids; the model answers with `<answer>...</answer>` citing the
  ids it used as [doc-id]. Reward: 0.7 for the row's `answer` in the answer as whole words (answer "4" is
  not found in "14"), 0.3 for citing a passage it searched that is in the row's `sources` (an id, or a
  list of ids). The rubric judges can grade the transcript on top (rows carry a `rubric`).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from functools import cache
from pathlib import Path

from nanogrpo.envs import Environment, Step, register

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def _answer(text: str) -> str | None:
    m = ANSWER.search(text)
    return m.group(1).strip() if m else None


def _norm(s: str) -> str:
    return re.sub(r"[^0-9a-z.\-]+", " ", s.lower()).strip()


def _holds(text: str, phrase: str) -> bool:
    """Does text hold phrase as whole words and numbers, normalised ("4" is in "it has 4." but not in "14",
    "1400" or "-4")? A word's trailing full stops are the sentence's, not the word's."""
    words = lambda s: " ".join(w.rstrip(".") for w in _norm(s).split())  # noqa: E731
    want = words(phrase)
    return bool(want) and f" {want} " in f" {words(text)} "


@register("guess")
class Guess(Environment):
    max_turns, stop, role, reward_range = 6, (), "user", (0.0, 1.0)

    def reset(self, row: dict, seed: int) -> str:
        self.lo, self.hi = int(row.get("lo", 1)), int(row.get("hi", 20))
        self.target = random.Random(seed).randint(self.lo, self.hi)
        self.turn = 0
        return (
            f"I am thinking of a whole number from {self.lo} to {self.hi}. Guess it: reply with one number "
            "only. I will say higher or lower."
        )

    def step(self, text: str) -> Step:
        self.turn += 1
        m = re.search(r"-?\d+", text)
        if m is None:
            return Step("Reply with one number.", 0.0, False, {"invalid": True})
        g = int(m.group())
        if g == self.target:
            return Step(None, max(0.0, 1.0 - 0.1 * (self.turn - 1)), True, {"solved": True})
        hint = "Higher" if g < self.target else "Lower"
        return Step(f"{hint}. Guess again: one number.", 0.0, False, {"solved": False})


# -- a safe arithmetic evaluator ------------------------------------------------------------------------

_OPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip


LIMIT = 1e15  # the largest magnitude a constant, an intermediate value or the result may have
# what arithmetic is written with; anything else (names, strings, brackets, `^`) never reaches the parser
ARITH_CHARS = re.compile(r"[0-9eE._+\-*/%() \t\n]*")


def _real(v: float) -> float:
    """v when it is a finite real number within LIMIT; a complex number (a negative base to a fractional
    power), inf, nan or a number past LIMIT is no value to answer with."""
    if isinstance(v, complex):
        raise ValueError("not a real number (a negative number to a fractional power)")
    if not abs(v) <= LIMIT:  # also inf, and nan (which compares false)
        raise ValueError(f"not a finite number within ±{LIMIT:g}")
    return v


def arith(expr: str) -> float:
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses. Anything else (names,
    calls, attributes), an exponent above 64, a constant or intermediate value that is not a finite real
    within 1e15, or more than 200 characters: ValueError (its message is the tool's reply)."""
    if len(expr) > 200:
        raise ValueError("expression too long (200 characters at most)")
    if not ARITH_CHARS.fullmatch(expr):
        raise ValueError("not arithmetic: use numbers, + - * / // % ** and parentheses")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression ({e.msg})") from None
    except (RecursionError, MemoryError):  # the parser's own limits on nesting
        raise ValueError("too deeply nested") from None

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return _real(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > 64:
                raise ValueError("exponent too large (64 at most)")
            return _real(_OPS[type(node.op)](a, b))
        raise ValueError(f"not arithmetic: {type(node).__name__}")

    try:
        return ev(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:  # float ** float past the float range
        raise ValueError(f"not a finite number within ±{LIMIT:g}") from None
    except RecursionError:
        raise ValueError("too deeply nested") from None


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"


CALC = re.compile(r"<calc>(.*?)</calc>", re.S)


@register("calc")
class Calc(Environment):
    max_turns, stop, role, reward_range = 3, ("</calc>",), "tool", (0.0, 1.0)

    def reset(self, row: dict, seed: int) -> None:
        self.answer = str(row["answer"])
        return None  # the row's own prompt

    def step(self, text: str) -> Step:
        if (a := _answer(text)) is not None:
            right = _norm(a) == _norm(self.answer)
            return Step(None, float(right), True, {"solved": right})
        m = CALC.search(text)
        if m is None:  # neither a tool call nor an answer: the episode ends without reward
            return Step(None, 0.0, True, {"invalid": True})
        try:
            return Step(_fmt(arith(m.group(1))), 0.0, False, {})
        except ValueError as e:
            return Step(f"error: {e}", 0.0, False, {"invalid": True})


# -- search over a small corpus -----------------------------------------------------------------------

SEARCH = re.compile(r"<search>(.*?)</search>", re.S)
CITE = re.compile(r"\[([a-z0-9-]+)\]")


@cache
def corpus() -> list[dict]:
    """The passages {"id", "text"} of recipes/search_corpus.jsonl."""
    path = Path(__file__).resolve().parents[1] / "recipes" / "search_corpus.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def search(query: str, k: int = 2) -> list[dict]:
    """The k passages sharing the most words with the query (ties: corpus order)."""
    words = set(_norm(query).split())
    scored = [(len(words & set(_norm(p["text"]).split())), -i, p) for i, p in enumerate(corpus())]
    return [p for s, _, p in sorted(scored, reverse=True)[:k] if s > 0]


@register("search")
class Search(Environment):
    max_turns, stop, role, reward_range = 3, ("</search>",), "tool", (0.0, 1.0)

    def reset(self, row: dict, seed: int) -> None:
        sources = row.get("sources") or ()
        self.answer, self.seen = str(row["answer"]), set()
        self.sources = {sources} if isinstance(sources, str) else set(sources)  # one id, or a list of ids
        return None

    def step(self, text: str) -> Step:
        if (a := _answer(text)) is not None:
            right = _holds(a, self.answer)
            cited = set(CITE.findall(a)) & self.sources & self.seen
            return Step(None, 0.7 * right + 0.3 * bool(cited), True, {"solved": right, "cited": bool(cited)})
        m = SEARCH.search(text)
        if m is None:
            return Step(None, 0.0, True, {"invalid": True})
        hits = search(m.group(1))
        self.seen |= {p["id"] for p in hits}
        return Step("\n".join(f"[{p['id']}] {p['text']}" for p in hits) or "no results", 0.0, False, {})
