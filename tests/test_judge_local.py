"""The judges' local backend: a model folder run in-process (tiny random model: plumbing and parity)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rewards import Sample
from rewards.judge import Judge
from rewards.judge_entropy import EntropyJudge, mark_distributions
from rewards.llm_client import ChatRequest, LocalClient, render_chat
from rewards.options import JudgeConfig


@pytest.fixture(scope="module")
def local_cfg(tiny_model_dir) -> JudgeConfig:
    return JudgeConfig(backend="local", model=str(tiny_model_dir), max_tokens=8, top_logprobs=5)


@pytest.fixture(scope="module")
def client(local_cfg) -> LocalClient:
    return LocalClient(local_cfg)


def batch() -> list[Sample]:
    comps = [["first answer", "second"]]
    return [
        Sample(f"user: question {g}", c, group=g, row={"reference": "ref"})
        for g, cs in enumerate(comps)
        for c in cs
    ]


def test_local_judge_end_to_end(local_cfg):
    judge = Judge(local_cfg)
    scores = judge(batch())
    assert len(scores) == 2 and all(s is None or 0 <= s <= 1 for s in scores)
    m = judge.metrics()
    # a random model writes no valid JSON: one call per group, one repair each, every answer unparsable
    assert m["calls"] == 1 + m["repairs"] and m["prompt_tokens"] > 0 and m["completion_tokens"] > 0
    assert m["unparsable"] == sum(s is None for s in scores)


def test_local_entropy_judge_end_to_end(local_cfg):
    judge = EntropyJudge(local_cfg)
    scores = judge(batch())
    assert all(s is None or 0 <= s <= 1 for s in scores)
    assert judge.metrics()["calls"] >= 1


def test_local_reply_is_greedy_and_logprobs_match_transformers(client, tiny_model_dir):
    msgs = [{"role": "user", "content": "Mark the answer."}]
    reply = client.chat([ChatRequest(msgs, max_tokens=6, top_logprobs=5)])[0]
    ids = client.encode(msgs)
    assert ids == client.tokenizer(render_chat(client.tokenizer, msgs), add_special_tokens=False)["input_ids"]
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    out_ids = ids[:]
    for t in reply.tokens:  # greedy: each generated token is the argmax of the reference model
        with torch.no_grad():
            logp = torch.log_softmax(ref(torch.tensor([out_ids])).logits[0, -1].float(), -1)  # (V,)
        top = logp.topk(5)
        assert t.token == client.tokenizer.decode([int(top.indices[0])])
        assert t.logprob == pytest.approx(float(top.values[0]), abs=1e-4)
        assert max(t.top.values()) == pytest.approx(float(top.values[0]), abs=1e-4)
        out_ids.append(int(top.indices[0]))
    assert reply.completion_tokens == len(reply.tokens)


def test_local_mark_probabilities_match_the_logits(client, tiny_model_dir):
    """The entropy judge's p_0..p_5 at a mark token = softmax of the logits restricted to the digits."""
    msgs = [{"role": "user", "content": "Mark answer 1 from 0 to 5."}]
    prompt = client.encode(msgs)
    reply = client.tokenizer('{"Answer 1": 3}', add_special_tokens=False)["input_ids"]
    V = len(client.tokenizer)
    toks = client.token_logprobs(prompt, reply, k=V)  # every token: exact digit mass
    dists, _ = mark_distributions(toks, 1)
    pos = [client.tokenizer.decode([i]) for i in reply].index(" 3")
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1 + pos].double()  # (V,)
    probs = torch.softmax(logits, -1)
    p = [0.0] * 6
    for i in range(logits.shape[0]):
        s = client.tokenizer.decode([i]).strip(" \"':,")
        if len(s) == 1 and s in "012345":
            p[int(s)] += float(probs[i])
    p = [x / sum(p) for x in p]
    assert dists[0] == pytest.approx(p, abs=1e-5)
    assert math.isclose(sum(dists[0]), 1.0, abs_tol=1e-9)
