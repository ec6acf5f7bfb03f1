"""Property tests: every rule-based grader takes any text (unicode, empty, enormous) without raising and
returns None or a score in [0, 1]; the semantic grader is covered in test_rewards_semantic.py."""

from __future__ import annotations

import dataclasses
import time
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rewards import RewardConfig, Sample, build_reward, make

GRADERS = ["exact", "contains", "label", "json", "format", "think", "rouge_l", "numbers", "consistency"]
GRADERS += ["concepts", "keywords", "style"]

CFG = dataclasses.replace(
    RewardConfig(), style_weights="length:1,headings:1,lists:1,emphasis:1,code:1,tables:1"
)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    BUILT = {name: make(name, CFG) for name in GRADERS}

# text that hits the parsers: tags, numbers with units, markdown, list markers, JSON, emptiness
PIECES = ["<think>", "</think>", "<answer>", "</answer>", "1,705M", "-3.5%", "9,91", "1.", "\n2) ", "# ", "- ",
          "**", "```", "|---|", "{", "}", "[", "heparin", "heart attack", " ", "\n", "", "é", "中文", "🙂", "\x00", "\ud800"]  # fmt: skip
texts = st.one_of(
    st.text(max_size=300),
    st.lists(st.sampled_from(PIECES) | st.text(max_size=5), max_size=40).map("".join),
)
rows = st.fixed_dictionaries(
    {},
    optional={
        "reference": texts,
        "references": st.lists(texts, max_size=3),
        "answer": texts | st.integers() | st.floats(allow_nan=True),
        "labels": st.lists(texts, max_size=4),
        "key_points": st.lists(st.lists(texts, max_size=4) | texts, max_size=4),
    },
)


def _check(scores: list, n: int) -> None:
    assert len(scores) == n
    for s in scores:
        assert s is None or (isinstance(s, float) and 0.0 <= s <= 1.0), s


@pytest.mark.parametrize("name", GRADERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completions=st.lists(texts, min_size=1, max_size=4), row=rows)
def test_any_text_scores_in_range(name, completions, row):
    _check(BUILT[name]([Sample("p", c, i % 2, row) for i, c in enumerate(completions)]), len(completions))


LONG = [
    "",
    "word " * 200_000,
    "<think>" * 50_000,
    "<answer>" * 50_000 + "</answer>",
    "1,705M " * 50_000,
    "[" * 100_000,
    "é中🙂" * 100_000,
    "- **a**\n" * 50_000,
]


@pytest.mark.parametrize("name", GRADERS)
def test_empty_and_enormous_completions(name):
    row = {
        "reference": "Start heparin; 12% of 1,705M. - a list",
        "answer": "B",
        "labels": ["a", "b"],
        "key_points": [["heparin", "12"]],
    }
    t = time.perf_counter()
    _check(BUILT[name]([Sample("p", c, 0, row) for c in LONG]), len(LONG))
    assert time.perf_counter() - t < 20, f"{name} is too slow on long text"


@settings(max_examples=40, deadline=None)
@given(
    completions=st.lists(texts, min_size=1, max_size=4),
    row=rows,
    weights=st.lists(st.floats(0, 5), min_size=3, max_size=3),
)
def test_composite_never_raises(completions, row, weights):
    spec = ",".join(f"{n}:{w}" for n, w in zip(["rouge_l", "numbers", "consistency"], weights))
    if sum(weights) <= 0:
        return
    fn = build_reward(dataclasses.replace(CFG, spec=spec))
    rewards, comps = fn([Sample("p", c, 0, row) for c in completions])
    assert len(rewards) == len(completions) and set(comps) == {"rouge_l", "numbers", "consistency"}
    for r in rewards:
        assert r is None or 0.0 <= r <= sum(weights) + 1e-9


# numbers-heavy text: long digit runs, separators, signs, units and percentages glued together
NUMERIC = ["0", "7", "1" * 40, "9" * 400, "9" * 1200, ",", ".", ",000", ".000", "-", "\u2212", "+", "%", " %", "$",
           "M", "K", "T", "bn", " million", " percent", "e", "E+", " ", "\n", "1.", "(", "x", "<answer>", "</answer>"]  # fmt: skip
numeric = st.lists(
    st.sampled_from(NUMERIC) | st.integers(-(10**40), 10**40).map(str) | st.decimals(allow_nan=True).map(str),
    max_size=30,
).map("".join)
NUMBER_GRADERS = ["exact", "contains", "label", "numbers"]


@pytest.mark.parametrize("name", NUMBER_GRADERS)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completions=st.lists(numeric, min_size=1, max_size=3), gold=numeric)
def test_numbers_heavy_text_scores_in_range(name, completions, gold):
    row = {"answer": gold, "labels": [gold, "no"], "reference": gold}
    _check(BUILT[name]([Sample("p", c, 0, row) for c in completions]), len(completions))


@settings(max_examples=200, deadline=None)
@given(a=st.integers(-(10**60), 10**60), b=st.integers(-(10**60), 10**60))
def test_integers_keep_every_digit(a, b):
    from rewards.text import canonical, figures, normalize

    assert [canonical(f.value) for f in figures(f"x {a} y")] == [str(a)]
    assert (normalize(str(a)) == normalize(str(b))) == (a == b)
    assert BUILT["exact"]([Sample("p", f"<answer>{a}</answer>", 0, {"answer": str(b)})]) == [float(a == b)]
