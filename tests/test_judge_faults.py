"""A hostile judge server: bad replies, redirects, a server that drips, errors mid-run.

Everything runs through the real HTTP client against stub servers on 127.0.0.1 (tests/helpers.py's
FakeServer). The rule under test: an answer whose reply cannot be read scores None and is counted; no
exception escapes a grader, except the ValueErrors that stop a run with one line saying what to fix.
"""

from __future__ import annotations

import json
import math
import time

import pytest
from helpers import (
    EXPECTED,
    GROUPS,
    KEY,
    batch_of,
    cfg_for,
    chat_body,
    entropy_reply,
    good_marks,
    quality,
)
from helpers import shown_answers as shown

from rewards import RewardConfig, Sample, build_reward
from rewards.judge import Judge
from rewards.judge_entropy import EntropyJudge
from rewards.llm_client import JudgeServerError
from rewards.options import RubricConfig
from rewards.rubric import Rubric

NAN, INF = float("nan"), float("inf")
ALL = {1, 2, 3, 4}


def marked(edit):
    """A reply whose marks object is good_marks edited in place by `edit(items)` (NaN written as NaN)."""

    def body(p):
        obj = good_marks(p)
        edit(obj["answers"])
        return chat_body(json.dumps(obj))

    return body


def setk(pos: int, **kw):
    return marked(lambda items: items[pos].update(kw))


def envelope(edit):
    """A good reply whose envelope (the whole response object) is edited by `edit(body)`."""

    def body(p):
        b = chat_body(json.dumps(good_marks(p)))
        out = edit(b)
        return b if out is None else out

    return body


def content(value):
    return envelope(lambda b: b["choices"][0]["message"].update(content=value))


def extra_items(items):
    items += [dict(items[0], answer=5), dict(items[1], answer=6)]


# (name, reply body for a payload, the shown answers that can still be read)
JUDGE_REPLIES = [
    ("NaN mark", setk(0, tone=NAN), {2, 3, 4}),
    ("infinite mark", setk(1, correctness=INF), {1, 3, 4}),
    ("minus infinite mark", setk(2, format=-INF), {1, 2, 4}),
    ("mark 'NaN' as text", setk(0, tone="NaN"), {2, 3, 4}),
    ("mark as a word", setk(0, tone="five"), {2, 3, 4}),
    ("mark as an object", setk(0, tone={"value": 5}), {2, 3, 4}),
    ("mark as a list", setk(0, tone=[5]), {2, 3, 4}),
    ("mark as a bool", setk(0, tone=True), {2, 3, 4}),
    ("mark missing", marked(lambda items: items[0].pop("tone")), {2, 3, 4}),
    ("huge mark", setk(0, tone=10**30), {2, 3, 4}),
    ("mark above the scale", setk(0, tone=6), {2, 3, 4}),
    ("mark below the scale", setk(0, tone=0), {2, 3, 4}),
    ("fractional mark", setk(0, tone=4.5), {2, 3, 4}),
    ("answer number NaN", setk(0, answer=NAN), {2, 3, 4}),
    ("answer number infinite", setk(0, answer=INF), {2, 3, 4}),
    ("answer number as a word", setk(0, answer="first"), {2, 3, 4}),
    ("answer numbers out of range", marked(lambda it: (it[0].update(answer=0), it[1].update(answer=9))), {3, 4}),
    ("answer number repeated", setk(1, answer=1), {3, 4}),  # 1 marked twice, 2 not at all
    ("fewer answers than the group", marked(lambda items: items.__delitem__(slice(2, None))), {1, 2}),
    ("more answers than the group", marked(extra_items), ALL),
    ("reason as a number", setk(0, reason=5), ALL),  # the reason is text for people: any value will do
    ("reason as an object", setk(1, reason={"why": [1, 2]}), ALL),
    ("answers not objects", marked(lambda items: items.__setitem__(slice(None), [5, 5, 5, 5])), set()),
    ("answers an object", content(json.dumps({"answers": {"1": {"tone": 5}}})), set()),
    ("answers null", content('{"answers": null}'), set()),
    ("reply the JSON NaN", content("NaN"), set()),
    ("reply nested too deep", content("[" * 100_000), set()),
    ("content a number", content(5), set()),
    ("content an object", envelope(lambda b: b["choices"][0]["message"].update(content={"answers": []})), set()),
    ("content a list", content([1, 2]), set()),
    ("content null", content(None), set()),
    ("content missing", envelope(lambda b: b["choices"][0]["message"].pop("content")), set()),
    ("message a string", envelope(lambda b: b["choices"][0].update(message="hello")), set()),
    ("message null", envelope(lambda b: b["choices"][0].update(message=None)), set()),
    ("message missing", envelope(lambda b: b["choices"][0].pop("message")), set()),
    ("choice a string", envelope(lambda b: b.update(choices=["hello"])), set()),
    ("choices empty", envelope(lambda b: b.update(choices=[])), set()),
    ("choices an object", envelope(lambda b: b.update(choices={"0": b["choices"][0]})), set()),
    ("choices null", envelope(lambda b: b.update(choices=None)), set()),
    ("choices missing", envelope(lambda b: b.pop("choices")), set()),
    ("usage a string", envelope(lambda b: b.update(usage="lots")), ALL),  # the marks are fine: keep them
    ("usage counts not numbers", envelope(lambda b: b.update(usage={"prompt_tokens": INF, "completion_tokens": "x"})), ALL),
    ("usage counts NaN", envelope(lambda b: b.update(usage={"prompt_tokens": NAN, "completion_tokens": -3})), ALL),
    ("body not JSON", lambda p: "<html>502 Bad Gateway</html>", set()),
    ("body a JSON list", lambda p: [1, 2], set()),
    ("body JSON null", lambda p: "null", set()),
    ("body nested too deep", lambda p: "[" * 100_000, set()),
]  # fmt: skip


@pytest.mark.parametrize("name,reply,readable", JUDGE_REPLIES, ids=[c[0] for c in JUDGE_REPLIES])
def test_a_bad_judge_reply_gives_none_never_a_made_up_score(server, name, reply, readable):
    srv = server(lambda p, n: (200, {}, reply(p), 0))  # the repair request gets the same reply
    judge = Judge(cfg_for(srv, max_retries=1))
    batch = batch_of(GROUPS[:1])
    scores = judge(batch)
    answers = shown(srv.requests[0]["payload"])
    want = [None] * 4
    for k, a in enumerate(answers, 1):
        if k in readable:
            want[[s.completion for s in batch].index(a)] = (quality(a) - 1) / 4
    assert scores == want
    m = judge.metrics()
    assert m["unparsable"] + m["failed"] == 4 - len(readable), m
    assert all(math.isfinite(v) for v in m.values())


# -- judge_entropy: the marks' log-probs ------------------------------------------------------------


def tokens_edit(edit):
    """entropy_reply's body with its token list edited by `edit(tokens)` (mark k's token: 5 * k)."""

    def body(p):
        b = entropy_reply(p)
        toks = b["choices"][0]["logprobs"]["content"]
        edit(toks)
        b["choices"][0]["message"]["content"] = "".join(
            t["token"] for t in toks if isinstance(t.get("token"), str)
        )
        return b

    return body


def mark_alt(k: int, **kw):
    """Edit the first alternative of answer k's mark token."""
    return tokens_edit(lambda toks: toks[5 * k]["top_logprobs"][0].update(kw))


def mark_tok(k: int, **kw):
    return tokens_edit(lambda toks: toks[5 * k].update(kw))


def lp_envelope(edit):
    def body(p):
        b = entropy_reply(p)
        edit(b)
        return b

    return body


def duplicate_mark(toks):
    toks[8] = {
        "token": " 1",
        "logprob": 0.0,
        "top_logprobs": [{"token": " 1", "logprob": 0.0}],
    }  # 'Answer 1' twice


def drop_logprobs(toks):
    del toks[5]["logprob"], toks[5]["top_logprobs"]


ENTROPY_REPLIES = [
    ("NaN log-prob at a mark", mark_alt(1, logprob=NAN), {2, 3, 4}),
    ("infinite log-prob at a mark", mark_alt(2, logprob=INF), {1, 3, 4}),
    ("positive log-prob at a mark", mark_alt(3, logprob=3.0), {1, 2, 4}),
    ("log-prob as text", mark_alt(4, logprob="high"), {1, 2, 3}),
    ("log-prob missing", tokens_edit(drop_logprobs), {2, 3, 4}),
    ("alternatives an object", mark_tok(1, top_logprobs={"5": -0.1}), {2, 3, 4}),
    ("alternative token a number", mark_alt(1, token=5), {2, 3, 4}),
    ("token a number", mark_tok(1, token=5), {2, 3, 4}),
    ("mark above the scale", mark_tok(1, token=" 7", top_logprobs=[{"token": " 7", "logprob": -0.1},
                                                                   {"token": " 3", "logprob": -2.0}]), {2, 3, 4}),
    ("answer number repeated", tokens_edit(duplicate_mark), {3, 4}),
    ("tokens not objects", lp_envelope(lambda b: b["choices"][0]["logprobs"].update(content=[1, "a", None])), set()),
    ("token list an object", lp_envelope(lambda b: b["choices"][0]["logprobs"].update(content={"a": 1})), set()),
    ("logprobs a string", lp_envelope(lambda b: b["choices"][0].update(logprobs="yes")), set()),
    ("content a number", lp_envelope(lambda b: b["choices"][0]["message"].update(content=3)), set()),
    ("choices empty", lp_envelope(lambda b: b.update(choices=[])), set()),
]  # fmt: skip


@pytest.mark.parametrize("expected", [False, True])
@pytest.mark.parametrize("name,reply,readable", ENTROPY_REPLIES, ids=[c[0] for c in ENTROPY_REPLIES])
def test_a_bad_entropy_reply_gives_none_never_a_made_up_score(server, name, reply, readable, expected):
    srv = server(lambda p, n: (200, {}, reply(p), 0))
    judge = EntropyJudge(cfg_for(srv, max_retries=1), expected=expected)
    batch = batch_of(GROUPS[:1])
    scores = judge(batch)
    honest = EntropyJudge(cfg_for(server(lambda p, n: (200, {}, entropy_reply(p), 0))), expected=expected)
    good = honest(batch)
    answers = shown(srv.requests[0]["payload"])
    want = [None] * 4
    for k, a in enumerate(answers, 1):
        if k in readable:
            i = [s.completion for s in batch].index(a)
            want[i] = good[i]
    assert scores == pytest.approx(want, nan_ok=False)
    m = judge.metrics()
    assert m["unparsable"] + m["failed"] == 4 - len(readable), m


# -- rubric: Yes/No replies and their log-probs ---------------------------------------------------

RUBRIC_ROW = {"rubric": [{"criterion": "is right", "weight": 1.0}]}


def yes_reply(lp_yes=-0.105, lp_no=-2.303):
    top = [{"token": "Yes", "logprob": lp_yes}, {"token": " No", "logprob": lp_no}]
    return chat_body("Yes", [{"token": "Yes", "logprob": lp_yes, "top_logprobs": top}])


RUBRIC_REPLIES = [
    ("generative", "good", lambda: chat_body("Yes"), 1.0),
    ("generative", "content a number", lambda: chat_body(1), None),
    ("generative", "content an object", lambda: chat_body({"yes": True}), None),
    ("generative", "choices empty", lambda: {"choices": []}, None),
    ("logprob", "good", yes_reply, 1.0),
    ("logprob", "NaN log-prob", lambda: yes_reply(lp_yes=NAN), None),
    ("logprob", "infinite log-prob", lambda: yes_reply(lp_no=INF), None),
    ("logprob", "log-prob as text", lambda: yes_reply(lp_yes="sure"), None),
    ("logprob", "no tokens", lambda: chat_body("", []), None),
    ("logprob", "tokens not objects", lambda: chat_body("Yes", ["Yes"]), None),
]


@pytest.mark.parametrize(
    "readout,name,reply,verdict", RUBRIC_REPLIES, ids=[f"{c[0]}-{c[1]}" for c in RUBRIC_REPLIES]
)
def test_a_bad_rubric_reply_gives_none(server, readout, name, reply, verdict):
    srv = server(lambda p, n: (200, {}, reply(), 0))
    cfg = RewardConfig(judge=cfg_for(srv, max_retries=1), rubric=RubricConfig(readout=readout))
    grader = Rubric(cfg)
    score = grader([Sample("q", "an answer", 0, RUBRIC_ROW)])
    assert score == [verdict]
    assert grader.last_details[0]["criteria"][0]["verdict"] == verdict


# -- errors no retry fixes: one line that says what to fix ----------------------------------------


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_refusal_mid_run_is_a_one_line_value_error(server, monkeypatch, status):
    monkeypatch.setenv("NANOGRPO_TEST_JUDGE_KEY", KEY)
    srv = server(lambda p, n: (status, {}, f"<html>\n<h1>Nope</h1>\n{KEY}\n</html>", 0))
    with pytest.raises(JudgeServerError) as err:
        Judge(cfg_for(srv))(batch_of(GROUPS[:1]))
    assert isinstance(err.value, ValueError), "train.py prints a ValueError as one line, exit 2"
    msg = str(err.value)
    assert "\n" not in msg and KEY not in msg and f"HTTP {status}" in msg and "--reward.judge." in msg
    assert len(srv.requests) == 1, "not retried"


def test_no_logprobs_mid_run_is_a_one_line_value_error(server):
    srv = server(lambda p, n: (200, {}, chat_body('{"Answer 1": 3}'), 0))
    with pytest.raises(ValueError, match="top_logprobs") as err:
        EntropyJudge(cfg_for(srv))(batch_of([["x"]]))
    assert "\n" not in str(err.value)
    rubric = Rubric(RewardConfig(judge=cfg_for(srv), rubric=RubricConfig(readout="logprob")))

    with pytest.raises(ValueError, match="top_logprobs") as err:
        rubric([Sample("q", "a", 0, RUBRIC_ROW)])
    assert "\n" not in str(err.value)


# -- redirects: the key goes only to --reward.judge.base-url ----------------------------------------


@pytest.mark.parametrize("status", [302, 307])
def test_a_redirect_mid_run_is_not_followed(server, monkeypatch, status):
    monkeypatch.setenv("NANOGRPO_TEST_JUDGE_KEY", KEY)
    other = server(lambda p, n: (200, {}, chat_body(json.dumps(good_marks(p))), 0))
    where = other.url + "/chat/completions"
    srv = server(lambda p, n: (status, {"Location": where}, "moved", 0))
    judge = Judge(cfg_for(srv))
    t0 = time.monotonic()
    assert judge(batch_of(GROUPS[:1])) == [None] * 4
    assert other.requests == [] and other.gets == [], "the other origin saw a request (and the key)"
    assert len(srv.requests) == 1 and srv.requests[0]["headers"]["Authorization"] == f"Bearer {KEY}"
    assert judge.metrics()["failed"] == 4 and time.monotonic() - t0 < 5


@pytest.mark.parametrize("status", [301, 307])
def test_a_redirect_at_the_start_up_check_stops_with_the_location(server, monkeypatch, status):
    monkeypatch.setenv("NANOGRPO_TEST_JUDGE_KEY", KEY)
    other = server(lambda p, n: (200, {}, "{}", 0))
    srv = server(lambda p, n: (200, {}, "{}", 0), models_status=status,
                 models_headers={"Location": other.url + "/models"})  # fmt: skip
    reward = build_reward(RewardConfig(spec="judge:1", judge=cfg_for(srv)))
    with pytest.raises(ValueError, match="redirect") as err:
        reward.validate([{"prompt": "q", "reference": "r"}])
    msg = str(err.value)
    assert other.url in msg and "--reward.judge.base-url" in msg and KEY not in msg and "\n" not in msg
    assert other.gets == [] and other.requests == [], "the other origin saw a request (and the key)"
    assert srv.gets[0]["headers"]["Authorization"] == f"Bearer {KEY}"


# -- a deadline per request -----------------------------------------------------------------------


def drip(head: bytes, n: int = 12):
    """A raw reply: `head` at once, then one byte a second (at most n: the stub ends on its own)."""

    def write(wfile):
        wfile.write(head)
        wfile.flush()
        for _ in range(n):
            time.sleep(1.0)
            wfile.write(b" ")
            wfile.flush()

    return write


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A:",
    ],
    ids=["body", "headers"],
)
def test_a_server_that_drips_is_cut_off_at_the_deadline(server, head):
    srv = server(lambda p, n: (200, {}, drip(head), 0))
    judge = Judge(cfg_for(srv, timeout_s=1.5, max_retries=1))
    t0 = time.monotonic()
    scores = judge(batch_of(GROUPS[:1]))
    took = time.monotonic() - t0
    assert scores == [None] * 4 and judge.metrics()["failed"] == 4
    assert len(srv.requests) == 2 and took < 5, f"{took:.1f} s for 2 tries of 1.5 s"


def test_the_proxy_of_the_environment_is_used(server, monkeypatch):
    """http.client knows no proxies: the client reads http_proxy as urllib does (absolute URL, Host kept)."""
    srv = server(lambda p, n: (200, {}, chat_body(json.dumps(good_marks(p))), 0))
    for name in (
        "no_proxy",
        "NO_PROXY",
        "HTTP_PROXY",
        "https_proxy",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", srv.url.removesuffix("/v1"))
    judge = Judge(cfg_for(srv, base_url="http://judge.invalid/v1"))
    assert judge(batch_of(GROUPS[:1])) == EXPECTED[:4]
    assert srv.requests[0]["headers"]["Host"] == "judge.invalid"
