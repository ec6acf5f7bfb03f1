"""Rubric judges: the weighted score with pitfalls, and the generative / logprob / probe readouts."""

from __future__ import annotations

import json
import math
import re

import pytest
from helpers import chat_body, synthetic  # chat_body: a reply of the fake server on 127.0.0.1

from rewards import RewardConfig, Sample, build_reward
from rewards.options import JudgeConfig, RubricConfig
from rewards.probe import train_probe
from rewards.rubric import Rubric, parse_rubric, parse_yes_no, rubric_score, yes_no_probs

RUBRIC = [
    {"criterion": "mentions heparin", "weight": 2},
    {"criterion": "mentions dosage", "weight": 1},
    {"criterion": "mentions warfarin", "weight": -1},  # a pitfall
]


@pytest.mark.parametrize(
    "verdicts,weights,expected",
    [
        ([1, 1], [2, 1], 1.0),
        ([1, 0], [2, 1], 2 / 3),  # no pitfalls: the weighted share S / P
        ([1, 1, 0], [2, 1, -1], 1.0),  # every criterion met, pitfall avoided
        ([0, 0, 1], [2, 1, -1], 0.0),  # nothing met, pitfall hit
        ([1, 0, 1], [2, 1, -1], (2 - 1 + 1) / 4),
        ([0], [-2], 1.0),  # pitfalls only: avoiding them all is full marks
        ([1, None, 0], [2, 1, -1], (2 + 1) / 3),  # no verdict: the criterion drops out
        ([None, None], [1, -1], None),
        ([1, 0.5], [1, 0], 1.0),  # weight 0: ignored
        ([0.8, 0.25], [1, -1], (0.8 - 0.25 + 1) / 2),  # soft verdicts
    ],
)
def test_rubric_score(verdicts, weights, expected):
    got = rubric_score(verdicts, weights)
    assert got == expected if expected is None else got == pytest.approx(expected)


def test_parse_rubric_and_yes_no():
    assert parse_rubric(RUBRIC) == [
        ("mentions heparin", 2.0),
        ("mentions dosage", 1.0),
        ("mentions warfarin", -1.0),
    ]
    for bad in (
        [],
        "x",
        [{"weight": 1}],
        [{"criterion": "c", "weight": "heavy"}],
        [{"criterion": "c", "weight": 0}],
    ):
        with pytest.raises(ValueError):
            parse_rubric(bad)
    assert [parse_yes_no(t) for t in ["Yes.", " **no**", "YES, because", "Maybe", "Nope", ""]] == [
        1,
        0,
        1,
        None,
        None,
        None,
    ]
    y, n = yes_no_probs(
        {" Yes": math.log(0.5), "yes": math.log(0.2), "No": math.log(0.1), "Maybe": math.log(0.2)}
    )
    assert (y, n) == (pytest.approx(0.7), pytest.approx(0.1))


def test_bad_rubric_rows_are_refused_at_start_up():
    reward = build_reward(RewardConfig(spec="rubric:1"))
    rows = [{"prompt": "q", "rubric": RUBRIC}, {"prompt": "q", "rubric": [{"criterion": "", "weight": 1}]}]
    with pytest.raises(ValueError, match=r"train.jsonl:2: field 'rubric'.*criterion"):
        reward.validate(rows, "train.jsonl")


def criterion_of(payload: dict) -> tuple[str, str]:
    user = payload["messages"][-1]["content"]
    response = re.search(r"Response:\n(.*)\n\nCriterion: ", user, re.S).group(1)
    return re.search(r"Criterion: (.*)\n", user).group(1), response


def fake_verdict(payload: dict) -> bool:
    criterion, response = criterion_of(payload)
    return criterion.split()[-1] in response  # 'mentions heparin' is met when 'heparin' is in the response


def batch() -> list[Sample]:
    texts = ["Give heparin at the right dosage.", "Give warfarin.", "Give heparin, or warfarin."]
    return [Sample("user: anticoagulant?", t, group=0, row={"rubric": RUBRIC}) for t in texts]


def judge_cfg(srv) -> JudgeConfig:
    return JudgeConfig(base_url=srv.url, model="fake", backoff_s=0.01, max_retries=1)


def test_generative_readout(server):
    def script(p, n):
        criterion, response = criterion_of(p)
        if "dosage" in criterion and response == "Give warfarin.":
            return 200, {}, chat_body("I cannot tell."), 0  # unparsable: that criterion drops out
        return 200, {}, chat_body("Yes" if fake_verdict(p) else "No, it does not."), 0

    srv = server(script)
    grader = Rubric(RewardConfig(judge=judge_cfg(srv), rubric=RubricConfig(readout="generative")))
    scores = grader(batch())
    assert len(srv.requests) == 9  # one request per (answer, criterion)
    # answer 2: heparin no, dosage unknown, warfarin hit -> (0 - 1 + 1) / (2 + 1) = 0
    assert scores == pytest.approx([1.0, 0.0, (2 + 0 - 1 + 1) / 4])
    d = grader.last_details[1]["criteria"]
    assert [c["verdict"] for c in d] == [0.0, None, 1.0] and d[2]["weight"] == -1.0
    m = grader.metrics()
    assert m["calls"] == 9 and m["unparsable"] == 1


def test_logprob_readout_hard_and_soft(server):
    def script(p, n):
        y = 0.8 if fake_verdict(p) else 0.3
        top = [{"token": "Yes", "logprob": math.log(y)}, {"token": " No", "logprob": math.log(1 - y - 0.05)}]
        top.append({"token": "The", "logprob": math.log(0.05)})
        lp = [{"token": "Yes" if y > 0.5 else " No", "logprob": top[0]["logprob"], "top_logprobs": top}]
        return 200, {}, chat_body(lp[0]["token"], lp), 0

    srv = server(script)
    hard = Rubric(RewardConfig(judge=judge_cfg(srv), rubric=RubricConfig(readout="logprob")))
    assert hard(batch()) == pytest.approx([1.0, 0.0, 0.5])
    assert srv.requests[0]["payload"]["max_tokens"] == 1 and srv.requests[0]["payload"]["top_logprobs"] == 20
    soft = Rubric(RewardConfig(judge=judge_cfg(srv), rubric=RubricConfig(readout="logprob", soft=True)))
    p_met, p_not = 0.8 / 0.95, 0.3 / 0.95  # P(Yes) / (P(Yes) + P(No))
    expected = (2 * p_met + 1 * p_met - 1 * p_not + 1) / 4  # answer 1: heparin, dosage met; warfarin not
    assert soft(batch())[0] == pytest.approx(expected)


def test_probe_readout_matches_the_probe(tiny_model_dir, tmp_path):
    probe = train_probe(synthetic(60, 0), str(tiny_model_dir), batch_size=32)
    probe.save(tmp_path / "probe")
    cfg = RewardConfig(spec="rubric:1", rubric=RubricConfig(readout="probe", probe=str(tmp_path / "probe")))
    reward = build_reward(cfg)
    b = batch()
    scores, _ = reward(b)
    rows = [
        {"prompt": s.prompt, "response": s.completion, "criterion": c["criterion"]} for s in b for c in RUBRIC
    ]
    p = probe.predict_proba(rows)
    for i, s in enumerate(scores):
        v = [float(q >= probe.threshold) for q in p[3 * i : 3 * i + 3]]
        assert s == pytest.approx(rubric_score(v, [2, 1, -1]))
    assert json.dumps(reward.graders["rubric"].last_details)  # serialisable for samples.jsonl


def test_the_probe_reads_an_episode_whole_as_the_other_readouts_do(tiny_model_dir, tmp_path):
    """An episode's probe verdicts come from its transcript (rewards.base.transcript: every turn after the
    prompt, the tool's messages included), the text the generative and logprob readouts judge and the probe's
    labels for an episode hold, not its last assistant turn."""
    probe = train_probe(synthetic(60, 0), str(tiny_model_dir), batch_size=32)
    probe.save(tmp_path / "probe")
    cfg = RewardConfig(spec="rubric:1", rubric=RubricConfig(readout="probe", probe=str(tmp_path / "probe")))
    rubric = build_reward(cfg).graders["rubric"]
    asked = []
    read = rubric.probe.predict_proba
    rubric.probe.predict_proba = lambda rows, *a: asked.extend(rows) or read(rows, *a)
    turns = [
        {"role": "user", "content": "Which drug? Search first."},
        {"role": "assistant", "content": "<search>anticoagulant</search>"},
        {"role": "tool", "content": "[h] heparin, at a dosage of 5000 units"},
        {"role": "assistant", "content": "<answer>warfarin [h]</answer>"},
    ]
    s = Sample(turns[0]["content"], turns[-1]["content"], row={"rubric": RUBRIC}, turns=turns)
    assert rubric([s])[0] is not None
    whole = "\n\n".join(f"{t['role']}: {t['content']}" for t in turns[1:])
    assert whole.startswith("assistant: <search>") and "tool: [h] heparin" in whole
    assert asked == [{"prompt": s.prompt, "response": whole, "criterion": c["criterion"]} for c in RUBRIC]


def test_a_missing_probe_is_refused_at_start_up(tmp_path):
    cfg = RewardConfig(spec="rubric:1", rubric=RubricConfig(readout="probe", probe=str(tmp_path / "none")))
    reward = build_reward(cfg)
    with pytest.raises(ValueError, match="holds no probe .*python -m rewards.probe train"):
        reward.validate([{"prompt": "q", "rubric": RUBRIC}], "rows.jsonl")


def test_cache_spares_repeated_criteria(server, tmp_path):
    srv = server(lambda p, n: (200, {}, chat_body("Yes" if fake_verdict(p) else "No"), 0))
    cfg = RewardConfig(judge=JudgeConfig(**{**judge_cfg(srv).__dict__, "cache": str(tmp_path / "c.jsonl")}))
    first = Rubric(cfg)(batch())
    again = Rubric(cfg)
    assert again(batch()) == first and len(srv.requests) == 9 and again.metrics()["cached"] == 9
