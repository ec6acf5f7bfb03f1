"""`python -m nanogrpo.build`: every subcommand against a fake OpenAI-compatible server on 127.0.0.1.

The server (tests/test_judge.py's FakeServer) answers from canned replies chosen by what the request
asks: good, malformed and partial drafts, a bad first draft and a good repair, a draft bad twice. The
tests check the rows written, the rows left out and reported, the repair requests, the cache (a rerun
sends nothing), the sandbox of LLM-written checks, the no-LLM baselines and filter's counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_judge import FakeServer, chat_body

from nanogrpo.build import keypoints
from nanogrpo.build.__main__ import main
from rewards import RewardConfig, Sample, build_reward
from rewards.keywords import key_point_lists

REF_A = "Stop warfarin at once, give vitamin K, then check the INR every day until it falls."
REF_B = (
    "Use a **list**:\n\n- Preheat the oven to 200 C.\n- Roast the squash for 40 minutes.\n- Season with salt."
)
ROWS = [
    {"prompt": "The INR is 9 and the patient bleeds. What now?", "reference": REF_A, "source": "x"},
    {"prompt": "How do I roast squash?", "reference": REF_B},
]


@pytest.fixture
def server():
    made: list[FakeServer] = []

    def start(script, **kw):
        made.append(FakeServer(script, **kw))
        return made[-1]

    yield start
    for s in made:
        s.close()


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_out(path: Path | str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def user_of(payload: dict) -> str:
    return [m["content"] for m in payload["messages"] if m["role"] == "user"][0]


def is_repair(payload: dict) -> bool:
    return payload["messages"][-1]["content"].startswith("Your reply could not be used")


def reply(obj) -> tuple:
    return 200, {}, chat_body(obj if isinstance(obj, str) else json.dumps(obj)), 0


POINTS = {REF_A: ["Stop the warfarin", "Reverse it", "Monitor the INR"], REF_B: ["Heat the oven", "Roast"]}
KEYWORDS = {
    REF_A: [["stop warfarin"], ["vitamin K"], ["check the INR", "every day"]],
    REF_B: [["preheat", "200 C"], ["roast the squash", "40 minutes"]],
}


def which_ref(payload: dict) -> str:
    user = user_of(payload)
    return REF_A if "warfarin" in user else REF_B


def good_llm(payload: dict, n: int) -> tuple:
    """Key points for the first request of a row, keywords for the second, keywords directly for one-level."""
    user, ref = user_of(payload), which_ref(payload)
    if "<key_points>" in user:
        items = [{"point": k, "keywords": kw} for k, kw in enumerate(KEYWORDS[ref], 1)]
        return reply({"key_points": items})
    if "Copy from the reference the keywords" in user:
        return reply({"keywords": [w for kp in KEYWORDS[ref] for w in kp]})
    return reply({"key_points": POINTS[ref]})


def kp_args(tmp_path: Path, srv: FakeServer, *extra: str, rows: list[dict] = ROWS) -> list[str]:
    src = write_rows(tmp_path / "in.jsonl", rows)
    return ["keypoints", src, "--out", str(tmp_path / "out.jsonl"), "--llm.base-url", srv.url,
            "--llm.model", "fake-judge", "--llm.backoff-s", "0.01", "--llm.api-key-env", "NANOGRPO_TEST_KEY",
            *extra]  # fmt: skip


# ----------------------------------------------------------------------------- keypoints


def test_keypoints_two_level(server, tmp_path, capsys):
    srv = server(good_llm)
    main(kp_args(tmp_path, srv, "--price-in", "1", "--price-out", "2"))
    out = read_out(tmp_path / "out.jsonl")
    assert len(out) == 2 and len(srv.requests) == 4, "two requests a row: key points, then keywords"
    assert out[0]["source"] == "x" and out[0]["prompt"] == ROWS[0]["prompt"], "rows keep their fields"
    assert "_line" not in out[0] and out[0]["id"] == 1
    assert [kp["point"] for kp in out[0]["key_points"]] == POINTS[REF_A]
    assert key_point_lists(out[0]["key_points"]) == [
        [("stop", "warfarin")], [("vitamin", "k")], [("check", "the", "inr"), ("every", "day")]
    ]  # fmt: skip
    said = capsys.readouterr().out
    # 4 requests x (100 prompt, 20 completion) tokens at $1 / $2 per 1M
    assert "400 prompt + 80 completion" in said and "$0.0006 this run" in said, said
    assert not (tmp_path / "out.rejected.jsonl").exists()
    # the keywords grader reads them: the reference scores 1 on its own key points
    reward = build_reward(RewardConfig(spec="keywords:1"))
    reward.validate(out)
    scores, _ = reward([Sample(r["prompt"], r["reference"], i, r) for i, r in enumerate(out)])
    assert scores == [1.0, 1.0]


def test_keypoints_one_level_and_multiple_references(server, tmp_path):
    srv = server(good_llm)
    rows = [{"prompt": "q", "references": ["Roast it.", REF_B]}]  # the keywords are in the second one
    main(kp_args(tmp_path, srv, "--one-level", rows=rows))
    (out,) = read_out(tmp_path / "out.jsonl")
    assert len(srv.requests) == 1, "one-level: one request a row"
    assert out["key_points"] == [[w for kp in KEYWORDS[REF_B] for w in kp]], "one key point: the chain"
    assert 'reference id="2"' in user_of(srv.requests[0]["payload"]), "every reference is shown"


def test_keypoints_repair_then_good(server, tmp_path):
    def script(p, n):
        if "<key_points>" in user_of(p) and not is_repair(p) and which_ref(p) == REF_A:
            bad = [
                ["stop warfarin"],
                ["vitamin K1"],
                ["every day", "check the INR"],
            ]  # not there; out of order
            return reply({"key_points": [{"point": k, "keywords": kw} for k, kw in enumerate(bad, 1)]})
        return good_llm(p, n)

    srv = server(script)
    main(kp_args(tmp_path, srv))
    out = read_out(tmp_path / "out.jsonl")
    assert len(out) == 2 and len(srv.requests) == 5, "one repair request for the bad draft"
    repair = next(r["payload"]["messages"] for r in srv.requests if is_repair(r["payload"]))
    said = repair[-1]["content"]
    assert "'vitamin K1' is not in the reference word for word" in said
    assert "not listed in the order they appear" in said
    assert repair[-2]["role"] == "assistant" and "vitamin K1" in repair[-2]["content"]


def test_keypoints_bad_twice_is_reported_and_left_out(server, tmp_path, capsys):
    def script(p, n):
        if which_ref(p) == REF_B and "<key_points>" in user_of(p):
            return reply(
                {"key_points": [{"point": 1, "keywords": ["bake it for an hour"]}]}
            )  # partial, wrong
        if which_ref(p) == REF_A and "<key_points>" not in user_of(p):
            return reply("I think the key points are: stop warfarin.")  # not JSON, twice
        return good_llm(p, n)

    srv = server(script)
    main(kp_args(tmp_path, srv))
    assert read_out(tmp_path / "out.jsonl") == []
    err = capsys.readouterr().err
    src = str(tmp_path / "in.jsonl")
    assert f"{src}:1: key points: still wrong after one repair: it is not a JSON object" in err
    assert f"{src}:2: keywords: still wrong after one repair: no keywords list for key point(s) 2" in err
    rejected = read_out(tmp_path / "out.rejected.jsonl")
    assert [r["line"] for r in rejected] == [1, 2] and all(r["why"] for r in rejected)
    assert sum(is_repair(r["payload"]) for r in srv.requests) == 2, "exactly one repair each"


def test_keypoints_resume_from_cache(server, tmp_path):
    srv = server(good_llm)
    main(kp_args(tmp_path, srv))
    first = read_out(tmp_path / "out.jsonl")
    assert len(srv.requests) == 4 and (tmp_path / "out.cache.jsonl").is_file()
    main(kp_args(tmp_path, srv))
    assert len(srv.requests) == 4, "the rerun is served from the cache: no request sent"
    assert read_out(tmp_path / "out.jsonl") == first


def test_keyword_problems():
    refs = ["Stop warfarin, give vitamin K.", "Check the INR daily."]
    assert keypoints.keyword_problems([["warfarin", "vitamin k"], ["INR", "daily"]], refs, 3, True) == []
    bad = keypoints.keyword_problems([["warfarin", "inr"], ["four words are too"]], refs, 3, True)
    assert len(bad) == 2 and "order" in bad[0] and "has 4 words" in bad[1]
    assert keypoints.keyword_problems([["vitamin k", "warfarin"]], refs, 3, False) == [], "--no-order"
