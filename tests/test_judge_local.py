"""The judges' local backend: a model folder run in-process (tiny random model: plumbing and parity)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanogrpo import judge_backend
from rewards import Sample, local_client, mean_metrics
from rewards.judge import Judge
from rewards.judge_entropy import EntropyJudge, mark_distributions, marks_shape
from rewards.llm_client import ChatRequest
from rewards.local_client import LocalClient, render_chat
from rewards.options import JudgeConfig


@pytest.fixture(scope="module", autouse=True)
def nanogrpo_backend():
    """rewards imports nothing of nanogrpo: the model comes from the backend nanogrpo registers."""
    judge_backend.register()


def test_without_a_backend_the_local_judge_says_how_to_get_one(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(local_client, "_backend", None)
    with pytest.raises(ValueError, match=r"no model backend.*set_backend"):
        LocalClient(JudgeConfig(backend="local", model=str(tiny_model_dir)))
    assert local_client.resolve_model(str(tiny_model_dir)) == tiny_model_dir  # a folder needs no backend
    with pytest.raises(ValueError, match="not a folder.*nanogrpo.model.zoo"):
        local_client.resolve_model("tiny")


def test_a_backend_handed_in_is_the_one_used(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(local_client, "_backend", None)
    calls = []

    def resolve(name):
        calls.append(name)
        return judge_backend.resolve(name)

    backend = local_client.LocalBackend(resolve, judge_backend.load, judge_backend.generate)
    client = LocalClient(JudgeConfig(backend="local", model="tiny", max_tokens=2), backend=backend)
    assert calls == ["tiny"] and client.backend is backend
    reply = client.chat([ChatRequest([{"role": "user", "content": "hi"}], max_tokens=2)])[0]
    assert reply.completion_tokens <= 2


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
    """The local judge fills the reply's JSON shape: even a random model gives valid marks."""
    judge = Judge(local_cfg)
    scores = judge(batch())
    assert len(scores) == 2 and all(s is not None and 0 <= s <= 1 for s in scores)
    m = judge.metrics()
    assert m["calls"] == 1 and m["repairs"] == 0 and m["unparsable"] == 0
    assert m["prompt_tokens"] > 0 and m["completion_tokens"] > 0
    for s, d in zip(scores, judge.last_details):
        assert set(d["marks"].values()) <= {1, 2, 3, 4, 5} and isinstance(d["reason"], str)
        assert s == pytest.approx((sum(d["marks"].values()) / 4 - 1) / 4)


def test_local_entropy_judge_end_to_end(local_cfg):
    judge = EntropyJudge(local_cfg)
    scores = judge(batch())
    assert all(s is not None and 0 <= s <= 1 for s in scores)
    for d in judge.last_details:
        assert sum(d["probs"]) == pytest.approx(1, abs=1e-3) and d["probs"][d["mark"]] == max(d["probs"])
    assert judge.metrics()["calls"] == 1


def test_local_fill_reads_the_mark_distribution_from_the_logits(client, tiny_model_dir):
    """The shaped reply's p_0..p_5 = softmax of the logits after '{"Answer 1":', over the mark tokens."""
    msgs = [{"role": "user", "content": "Mark answer 1 from 0 to 5."}]
    reply = client.chat([ChatRequest(msgs, max_tokens=0, top_logprobs=1, shape=marks_shape(1))])[0]
    assert json.loads(reply.text).keys() == {"Answer 1"}
    dists, _ = mark_distributions(reply.tokens, 1)
    ids = client.encode(msgs) + client.tokenizer('{"Answer 1":', add_special_tokens=False)["input_ids"]
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        probs = torch.softmax(ref(torch.tensor([ids])).logits[0, -1].double(), -1)  # (V,)
    p = [0.0] * 6
    for i in range(probs.shape[0]):
        m = re.fullmatch(r" ?([0-5])", client.tokenizer.decode([i]))
        if m:
            p[int(m.group(1))] += float(probs[i])
    assert dists[0] == pytest.approx([x / sum(p) for x in p], abs=1e-5)
    assert json.loads(reply.text)["Answer 1"] == max(range(6), key=lambda d: p[d])


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


@pytest.mark.slow
def test_smollm2_local_judges(smollm2_dir):
    """SmolLM2-135M-Instruct judging in-process: valid marks for every answer, both judges."""
    cfg = JudgeConfig(backend="local", model=str(smollm2_dir))
    ref = "Open the report, click Share and pick the client."
    answers = ["Click Share on the report and pick the client.", "I like turtles."]
    b = [Sample("user: How do I send the report to the client?", a, 0, {"reference": ref}) for a in answers]
    judge = Judge(cfg)
    assert all(s is not None and 0 <= s <= 1 for s in judge(b))
    assert judge.metrics()["unparsable"] == 0
    ent = EntropyJudge(cfg, client=judge.client)  # one model in memory for both
    assert all(s is not None and 0 <= s <= 1 for s in ent(b))
    assert mean_metrics(ent.metrics())["digit_mass"] > 0.3, (
        "the mark tokens are among SmolLM2's likely next tokens"
    )


def test_model_names_resolve_through_the_registered_backend(tiny_model_dir):
    """nanogrpo's backend gives the local judge and the probes' frozen LMs its model zoo's names."""
    from rewards.probe import FrozenLM

    assert local_client.resolve_model("tiny") == tiny_model_dir
    assert FrozenLM("tiny").tokenizer.name_or_path == str(tiny_model_dir)
