"""Hostile input: every grader that needs no model and no server scores megabyte-long adversarial
completions (and references) in linear time, in [0, 1] or None, without raising; numbers compare exactly.

A grader call is timed by the smaller of its wall time and its CPU time: the first inflates when other
processes share the cores, the second when a grader runs threads, and a quadratic blow-up inflates both
(1 MB of spaces after '<think' once took minutes).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewards import RewardConfig, Sample, known, make
from rewards.judge import fenced_blocks
from rewards.judge_entropy import _BEFORE_MARK
from rewards.match import unfenced
from rewards.text import MAX_DIGITS, canonical, figures, normalize

LOCAL = ["exact", "contains", "label", "json", "format", "think", "rouge_l", "numbers", "consistency"]
LOCAL += ["random"]
LOCAL += ["concepts", "keywords", "style"]
LOCAL += ["env", "turns", "valid", "reasoning_gym"]  # an episode's columns in ROW; reasoning-gym's verifier
SERVICE = {"judge", "judge+similarity", "judge+numbers", "judge_entropy", "judge_entropy_expected"}
SERVICE |= {"rubric", "semantic"}  # an LLM judge, a rubric judge or probe, an embedding model
TOKENS_ONLY = {"overlong"}  # reads Sample.tokens, never the text (tests/test_rewards_stability.py)

CFG = dataclasses.replace(
    RewardConfig(), style_weights="length:1,headings:1,lists:1,emphasis:1,code:1,tables:1"
)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the demo-vocabulary warning of concepts
    BUILT = {name: make(name, CFG) for name in LOCAL}

MB = 1 << 20
HOSTILE = {
    "spaces after <think": "<think" + " " * MB,
    "spaces after </think": "</think" + " " * MB,
    "spaces after <answer, then </answer>": "<answer" + " " * MB + "</answer>",
    "<answer> never closed": "<answer>" + "x " * (MB // 2),
    "<think never closed, then words": "<think " + "a" * MB,
    "nested tags": "<think><answer>" * (MB // 15) + "</answer></think>" * (MB // 17),
    "opening tags": "<think>" * (MB // 7),
    "a million digits": "1" * MB,
    "a million digits, trillions": "-" + "9" * MB + "T",
    "a million digits after the point": "0." + "0" * MB + "1%",
    "thousands separators": "1" + ",000" * (MB // 4),
    "thousands separators, then a letter": "1" + ",000" * (MB // 4) + "x",
    "dotted groups": "1" + ".000" * (MB // 4),
    "ones": "1 " * (MB // 2),
    "list markers": "1. " * (MB // 3),
    "percentages": "1 % " * (MB // 4),
    "amounts": "$1,705M " * (MB // 8),
    "distinct numbers": " ".join(str(i) for i in range(MB // 7)),
    "a line of pipes and spaces": "|" + " " * MB + "|",
    "pipes": "| " * (MB // 2),
    "a line of spaces": " " * MB,
    "a line of tabs": "\t" * MB,
    "short lines of spaces": (" " * 100 + "\n") * (MB // 101),
    "stars": "*" * MB,
    "star-letter": "*a" * (MB // 2),
    "underscores": "_" * MB,
    "underscore-letter": "_a" * (MB // 2),
    "hashes": "#" * MB,
    "a heading of spaces": "# " + " " * MB,
    "a bullet of spaces": "- " + " " * MB,
    "backticks": "`" * MB,
    "fences": "```\n" + "``` " * (MB // 4),
    "an open fence of brackets": "```json\n" + "[" * MB,
    "a fence and spaces": "```json" + " " * MB,
    "a fence, spaces, a fence": "```" + " " * MB + "```x",
    "table rules": "|" + "---|" * (MB // 4),
    "a colon and dashes": ":" + "-" * MB,
    "markdown": "**a** _b_ `c` # d\n- e\n" * (MB // 21),
    "no newline": "word " * (MB // 5),
    "one letter": "a" * MB,
    "unicode": "é中🙂" * (MB // 3),
    "less-than signs": "<" * MB,
}
ROW = {
    "reference": "Start heparin; 12% of 1,705M.\n\n# Plan\n- a list, **bold**\n\n| a | b |\n|---|---|",
    "answer": "1705",
    "labels": ["1705", "no"],
    "key_points": [["heparin", "12"], ["plan", "list", "bold"]],
    # an episode as eval.py writes it (rewards/episode.py), and a reasoning-gym task (rewards/reasoninggym.py)
    "turns": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}],
    "env_reward": 0.5,
    "env_info": {"reward_range": [0.0, 1.0], "turns": 1, "max_turns": 3, "invalid": 0},
    "metadata": {"source_dataset": "chain_sum"},
}


# A linear grader scores these megabytes in 0.02-0.8 s on a 2-core VM (the heaviest: `exact` on a megabyte
# of `1 `), a quadratic one in minutes: 3 s tells them apart on a slow or loaded CI machine, where 1 s did
# not (`exact` took 1.02 s there once)
BUDGET_S = 3.0


def timed_call(grader, completion: str, row: dict) -> tuple[float | None, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    scores = grader([Sample("p", completion, 0, row)])
    took = min(time.perf_counter() - wall, time.process_time() - cpu)
    assert len(scores) == 1
    return scores[0], took


def _in_range(score) -> bool:
    return score is None or (isinstance(score, float) and 0.0 <= score <= 1.0)


def test_every_grader_is_tested_or_needs_a_service():
    assert set(known()) == set(LOCAL) | SERVICE | TOKENS_ONLY, "a new grader: add it to LOCAL (or SERVICE)"


@pytest.mark.parametrize("name", LOCAL)
def test_hostile_completions_score_fast(name):
    grader = BUILT[name]
    grader([Sample("p", "warm up: 12 heparin", 0, ROW)])  # lazy imports (torch for the LCS) happen here
    slow = {}
    for case, text in HOSTILE.items():
        score, took = timed_call(grader, text, ROW)
        assert _in_range(score), (case, score)
        if took >= BUDGET_S:
            slow[case] = round(took, 2)
    assert not slow, f"{name}: over {BUDGET_S} s on 1 MB: {slow}"


@pytest.mark.parametrize("name", ["style", "keywords", "numbers", "rouge_l", "concepts"])
def test_hostile_references_score_fast(name):
    grader = BUILT[name]
    grader([Sample("p", "warm up: 12 heparin", 0, ROW)])
    slow = {}
    for case, text in HOSTILE.items():
        row = {**ROW, "reference": text, "references": [text[: MB // 2]]}
        for completion in ("Start heparin at 12%. **a**", text):
            score, took = timed_call(grader, completion, row)
            assert _in_range(score), (case, score)
            if took >= BUDGET_S:
                slow[case] = round(took, 2)
    assert not slow, f"{name}: over {BUDGET_S} s with a 1 MB reference: {slow}"


# ----------------------------------------------------------------------------- exact numbers


def grade(name: str, completion: str, row: dict, **opts) -> float | None:
    return make(name, dataclasses.replace(CFG, **opts))([Sample("p", completion, 0, row)])[0]


THIRTY = "123456789012345678901234567890"
THIRTY_1 = "123456789012345678901234567891"


def test_long_numbers_compare_exactly():
    # a 28-digit decimal context rounds both to 1.234567890123456789012345679E+29
    assert normalize(THIRTY) != normalize(THIRTY_1)
    assert normalize(THIRTY) == THIRTY and normalize(f"{THIRTY}.000") == THIRTY
    assert canonical(figures(f"{THIRTY}T")[0].value) == THIRTY + "0" * 12
    assert canonical(figures(f"-{THIRTY_1}")[0].value) == "-" + THIRTY_1
    completion = f"<answer>{THIRTY_1}</answer>"
    assert grade("exact", completion, {"answer": THIRTY}) == 0.0
    assert grade("exact", f"<answer>{THIRTY}</answer>", {"answer": THIRTY}) == 1.0
    assert grade("contains", completion, {"answer": THIRTY}) == 0.0
    assert grade("label", completion, {"labels": [THIRTY, "no"]}) == 0.0
    # 1e-27 relative: full credit by the bands, and the two stay distinct figures
    assert grade("numbers", f"x {THIRTY_1}", {"reference": f"x {THIRTY}"}) == 1.0
    assert len(figures(f"{THIRTY} {THIRTY_1}")) == 2


def test_tolerance_bands_are_exact_at_the_edges():
    row = {"reference": "rate 100"}
    assert grade("numbers", "rate 101", row) == 1.0  # exactly 1% off
    assert grade("numbers", "rate 101.000000000000000000000000001", row) == 0.5  # just past 1%
    assert grade("numbers", "rate 105", row) == 0.5
    assert grade("numbers", "rate 105.000000000000000000000000001", row) == 0.0
    big = "9" * 400  # beyond any float: compared exactly, not as inf
    assert grade("numbers", f"x {big}1", {"reference": f"x {big}0"}) == 1.0
    assert grade("numbers", f"x {big}", {"reference": f"x {big}0"}) == 0.0
    tiny = "0." + "0" * 400
    assert grade("numbers", f"x {tiny}1", {"reference": f"x {tiny}1"}) == 1.0
    assert grade("numbers", f"x {tiny}2", {"reference": f"x {tiny}1"}) == 0.0  # not 0 == 0 after underflow


def test_digit_runs_past_the_bound_are_text():
    ok, long = "7" * MAX_DIGITS, "7" * (MAX_DIGITS + 1)
    assert [canonical(f.value) for f in figures(f"a {ok} b")] == [ok]
    assert figures(f"a {long} b") == [] and figures(f"a 1,{long} b") == []
    assert normalize(f"{long}.0") == f"{long} 0"  # kept as text: the point is punctuation
    assert grade("exact", f"<answer>{long}</answer>", {"answer": long}) == 1.0
    assert grade("exact", f"<answer>{long}.0</answer>", {"answer": long}) == 0.0
    assert grade("numbers", f"x {long}", {"reference": f"x {long}"}) is None  # no figure in it


@pytest.mark.parametrize("name", ["exact", "contains", "label", "numbers"])
@pytest.mark.parametrize("where", ["completion", "reference"])
def test_a_million_digits_scores_without_raising(name, where):
    text = "-" + "9" * 1_000_000 + "T and 1.5" + "0" * 1_000_000 + "%"
    row = {"answer": text, "labels": [text, "no"], "reference": text}
    if where == "completion":
        row = {"answer": "1.5%", "labels": ["1.5%"], "reference": "1.5%"}
    score, took = timed_call(BUILT[name], text if where == "completion" else "1.5%", row)
    assert _in_range(score) and took < BUDGET_S


# ----------------------------------------------------------------------------- fences, braces, judge replies
#
# Every parser of text that a policy or a judge server writes, on the shapes that once took seconds to
# minutes: a code fence followed by a long run of one character (the fence regex of `json` retried every
# split of the run: 4.6 s for a fence and 16,000 spaces, 30 s for 64 KB; the judges' reply parser took
# 3 s on 16 KB and did not finish on 64 KB), unclosed fences, nested braces. Each case must take under
# CASE_CPU_S of CPU time (time.process_time: not inflated by other processes sharing the cores).

KB64 = 1 << 16
CASE_CPU_S = 1.0
FENCED = {
    "a fence and 16,000 spaces": "```" + " " * 16_000,
    "a fence and 64 KB of spaces": "```" + " " * KB64,
    "a json fence and spaces": "```json" + " " * KB64,
    "a json fence, a newline and spaces": "```json\n" + " " * KB64,
    "a fence and newlines": "```" + "\n" * KB64,
    "a fence, tabs, a letter": "```" + "\t" * KB64 + "x",
    "a fence and letters": "```" + "a" * KB64,
    "a fence and dashes": "```" + "-" * KB64,
    "a fence and backslashes": "```" + "\\" * KB64,
    "spaces after a closed fence": '```json\n{"a": 1}\n```' + " " * KB64 + "x",
    "spaces inside a closed fence": "```" + " " * KB64 + "```x",
    "an unclosed fence and a brace": "```json\n{" + " " * KB64,
    "an unclosed fence and quotes": '```json\n{"reason": "' + " " * KB64,
    "spaces, then a fence": " " * KB64 + "```",
    "fences": "```" * (KB64 // 3),
    "fences and spaces": "``` " * (KB64 // 4),
    "fences and newlines": "```\n" * (KB64 // 4),
    "two backticks and spaces": "``" + " " * KB64,
    "nested braces": "{" * KB64,
    "nested objects": '{"a":' * (KB64 // 5),
    "nested brackets": "[" * KB64,
    "braces open then closed": "{" * (KB64 // 2) + "}" * (KB64 // 2),
    "braces closed then open": "}" * (KB64 // 2) + "{" * (KB64 // 2),
    "a fenced answer tag": "<answer>```" + " " * KB64 + "</answer>",
    "a valid reply, then 64 KB of spaces": '{"answers": []}' + " " * KB64,
    "64 KB of reason": '{"answers": [{"answer": 1, "reason": "' + "x " * (KB64 // 2) + '"}]}',
    "a key prefix and a long run": "sk-" + "a-" * (KB64 // 2) + "!",
    "bearer and spaces": "Bearer" + " " * KB64 + "x",
}


def cpu_s(fn, *args) -> float:
    """CPU seconds of fn(*args) in this process."""
    t = time.process_time()
    fn(*args)
    return time.process_time() - t


def _slow_cases(fn) -> dict[str, float]:
    slow = {}
    for case, text in FENCED.items():
        took = cpu_s(fn, text)
        if took >= CASE_CPU_S:
            slow[case] = round(took, 2)
    return slow


@pytest.mark.parametrize("name", LOCAL)
def test_fences_and_braces_score_fast(name):
    grader = BUILT[name]
    grader([Sample("p", "warm up: 12 heparin", 0, ROW)])
    scores = {}

    def one(text):
        scores[text[:20]] = grader([Sample("p", text, 0, ROW)])[0]

    slow = _slow_cases(one)
    assert all(_in_range(s) for s in scores.values()), scores
    assert not slow, f"{name}: over {CASE_CPU_S} s of CPU: {slow}"


def _entropy_tokens(text: str) -> list:
    """A reply's tokens where the mark token of answer 1 carries, before its digit, the text's spaces,
    quotes, colons and braces: what the mark reader looks back through."""
    from rewards.llm_client import TokenLogprob

    lead = "".join(c for c in text if c in " \t\n:=\"'{},")
    return [TokenLogprob('{"Answer 1', -0.1), TokenLogprob(lead + "3", -0.1, {"3": -0.1, "4": -2.0})]


def _untrusted_parsers() -> dict:
    """Every reader of text from a policy or a judge server that is not a grader of LOCAL."""
    from nanogrpo.reward_data.llm import read_json_object
    from rewards import judge, judge_entropy, llm_client, rubric, style, text

    entropy = judge_entropy.EntropyJudge(dataclasses.replace(CFG.judge, model="m"))
    return {
        "judge.extract_json": judge.extract_json,
        "judge.parse_group_marks": lambda t: judge.parse_group_marks(t, 4),
        "reward_data.read_json_object": read_json_object,  # the reward-data builder's reader (extract_json)
        "judge_entropy.read": lambda t: entropy.read(llm_client.Reply(t, tokens=_entropy_tokens(t)), 4),
        "judge_entropy.mark_distributions": lambda t: judge_entropy.mark_distributions(_entropy_tokens(t), 4),
        "rubric.parse_yes_no": rubric.parse_yes_no,
        "llm_client.redact": lambda t: llm_client.redact(t, "sk-test-5f3a9c1e7b2d4e6f"),
        "llm_client.read_chat": lambda t: llm_client.read_chat(
            json.dumps({"choices": [{"message": {"content": t}, "logprobs": {"content": [{"token": t}]}}]})
        ),
        "style.text_style": style.text_style,
        "text.strip_think": text.strip_think,
        "text.think_content": text.think_content,
        "text.extract": lambda t: text.extract(t, "answer"),
        "text.normalize": text.normalize,
        "text.figures": text.figures,
    }


@pytest.mark.parametrize("name", list(_untrusted_parsers()))
def test_judge_replies_and_text_parsers_are_fast(name):
    fn = _untrusted_parsers()[name]
    slow = _slow_cases(fn)
    assert not slow, f"{name}: over {CASE_CPU_S} s of CPU: {slow}"


# The linear parsers read what the regular expressions they replaced read: compared on short texts
# built from the characters that matter to them (where the old patterns are fast).
PIECES = [
    "`",
    "```",
    " ",
    "\n",
    "\t",
    "\r",
    "\x85",
    "\u3000",
    "a",
    "-",
    "_",
    "é",
    "{",
    "}",
    "1",
    "json",
    "JSON",
]
OLD_FENCE = re.compile(r"^\s*```[\w-]*[ \t]*\n?(.*?)\n?```\s*$", re.S)
OLD_BLOCKS = re.compile(r"```(?:json)?\s*(.*?)```", re.S)
OLD_BEFORE_MARK = re.compile(r"""answer\s*(\d{1,9})\s*["']?\s*[:=]\s*["']?\s*$""", re.I)


@settings(max_examples=800, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14).map("".join))
def test_fence_readers_match_the_old_patterns(text):
    m = OLD_FENCE.match(text)
    assert unfenced(text) == (m.group(1) if m else None)
    assert fenced_blocks(text) == OLD_BLOCKS.findall(text)


@settings(max_examples=800, deadline=None)
@given(
    st.lists(
        st.sampled_from(["answer", "Answer", " ", "\n", '"', "'", ":", "=", "1", "12", "x"]), max_size=12
    )
)
def test_the_mark_reader_matches_the_old_pattern(pieces):
    text = "".join(pieces)
    old, new = OLD_BEFORE_MARK.search(text), _BEFORE_MARK.search(text)
    assert (old and (old.group(1), old.span())) == (new and (new.group(1), new.span()))
