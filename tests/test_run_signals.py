"""What a run says when it learns nothing, and what its files keep: the entropy bonus paused in a step without
reward spread, a tool environment's calls logged and its silence said, episodes cut by a budget said, the
trained turns marked in samples.jsonl, the final evaluation's transcripts and distinct answers (and eval.py
compare's), and no same-grader warning for an environment's own outcome."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import metrics, run_eval, saved_run, tiny, write_rows

from nanogrpo.config import EnvConfig, GRPOConfig
from nanogrpo.eval import evaluate
from nanogrpo.eval.provenance import same_judge_warning
from nanogrpo.eval.report import eval_html
from nanogrpo.summary import StepNotes, episode_summary
from rewards import RewardConfig

SPEC = str(Path(__file__).with_name("env_examples.py"))

GRADERS = """
def flat(batch):
    return [0.0 for s in batch]  # every group scores alike: no learning signal


def one_group(batch):
    return [float(i == 0) for i, s in enumerate(batch)]  # group 0 has spread, the others none
"""


def grpo_run(tmp_path: Path, name: str, grader: str, coef: float, steps: int = 1):
    """`steps` tiny GRPO steps graded by tests' `grader` (GRADERS) at --grpo.entropy-coef `coef`: its metrics."""
    import train

    (tmp_path / "graders.py").write_text(GRADERS)
    reward = RewardConfig(spec=f"{tmp_path / 'graders.py'}:{grader}:1", allow_user_code=True)
    cfg = tiny(
        tmp_path / name, steps=steps, reward=reward, grpo=replace(tiny(tmp_path).grpo, entropy_coef=coef)
    )
    train.main(cfg)
    return metrics(tmp_path / name)


def test_the_entropy_bonus_is_paused_while_every_group_is_flat(tmp_path, capsys) -> None:
    """All groups flat: the entropy term adds nothing to the gradient (the whole gradient is 0), said once; one
    group with spread: the bonus is on, and it changes the gradient."""
    flat = grpo_run(tmp_path, "flat", "flat", 0.1, steps=3)
    assert [(m["entropy_paused"], m["entropy_bonus"], m["grad_norm"]) for m in flat] == [(1.0, 0.0, 0.0)] * 3
    out = capsys.readouterr().out
    assert out.count("the entropy bonus (--grpo.entropy-coef 0.1) is paused") == 1, out
    on, off = grpo_run(tmp_path, "on", "one_group", 0.1)[0], grpo_run(tmp_path, "off", "one_group", 0.0)[0]
    assert on["entropy_paused"] == 0.0 and on["entropy_bonus"] > 0 and 0 < on["frac_zero_std"] < 1
    assert on["grad_norm"] != off["grad_norm"] and "entropy_paused" not in off
    assert "is paused" not in capsys.readouterr().out


def test_step_notes_say_each_condition_once_when_it_begins() -> None:
    cfg = replace(
        tiny(Path("/tmp")), grpo=GRPOConfig(entropy_coef=0.01), env=EnvConfig(max_turns=4, max_tokens=99)
    )
    notes = StepNotes(cfg)
    said = [
        notes({"step": s, "entropy_paused": p})
        for s, p in enumerate([0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1], 1)
    ]
    assert [s for s, lines in enumerate(said, 1) if lines] == [2, 13]  # the start of a streak, 10 steps apart
    tools = [
        notes({"step": s, "env/no_tool_call": v})
        for s, v in enumerate([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0], 1)
    ]
    assert [s for s, lines in enumerate(tools, 1) if lines] == [6]  # the third step in a row without a call
    assert "SFT on tool-use transcripts" in tools[5][0] and "larger model" in tools[5][0]
    cut = notes({"step": 1, "env/truncated": 0.5, "env/truncated_turns": 0.5})
    assert len(cut) == 1 and "50% of the episodes were cut" in cut[0] and "--env.max-turns (now 4" in cut[0]
    assert "--env.max-tokens" not in cut[0]
    assert (
        notes({"step": 2, "env/truncated": 0.9, "env/truncated_turns": 0.0}) == []
    )  # still holds: said once
    assert notes({"step": 3, "env/truncated": 0.1}) == []  # at most 20%: nothing to say
    fresh = StepNotes(cfg)({"step": 1, "env/truncated": 0.3, "env/truncated_turns": 0.0})
    assert "--env.max-tokens (now 99" in fresh[0] and "--env.max-turns" not in fresh[0]


def test_episode_summary_counts_tool_calls_and_wins_over_the_episodes_with_a_reward() -> None:
    infos = [
        {"turns": 2, "max_turns": 2, "truncated": True, "tool_calls": 3, "tool_parse_errors": 1, "won": True},
        {
            "turns": 1,
            "max_turns": 2,
            "truncated": True,
            "tool_calls": 0,
            "tool_parse_errors": 2,
            "won": False,
        },
        {"turns": 2, "max_turns": 2, "done": True, "tool_calls": 1},  # no "won": not a win
        {
            "turns": 1,
            "max_turns": 2,
            "error": "step: raised",
            "tool_calls": 5,
            "won": True,
        },  # failed: not counted
    ]
    roll = SimpleNamespace(
        samples=[SimpleNamespace(env_info=i) for i in infos], batch=SimpleNamespace(mask=torch.ones(4, 3)),
        lengths=torch.full((4,), 3.0), failed=torch.tensor([False, False, False, True]),
        truncated=torch.tensor([True, True, False, False]),
    )  # fmt: skip
    m = episode_summary(roll)
    assert (
        m["env/tool_calls"] == 4 / 3 and m["env/tool_parse_errors"] == 1.0 and m["env/no_tool_call"] == 1 / 3
    )
    assert m["env/win_rate"] == 1 / 3 and m["env/truncated"] == 0.5 and m["env/truncated_turns"] == 0.25
    quiet = {k for k in episode_summary(replace_infos(roll, [{"turns": 1, "max_turns": 2}] * 4))}
    assert not quiet & {"env/tool_calls", "env/no_tool_call", "env/win_rate"}  # no tool environment, no game


def replace_infos(roll, infos):
    return SimpleNamespace(**{**vars(roll), "samples": [SimpleNamespace(env_info=i) for i in infos]})


# -- a tool environment whose model never calls: one run, read by the tests below -----------------------------


@pytest.fixture(scope="module")
def no_calls(tmp_path_factory):
    """Three steps of the tiny model on NoCalls (never done: a budget cuts every episode), every step's samples
    logged, and the final evaluation on 4 held-out rows: (the run folder, what it printed)."""
    import contextlib
    import io

    import train

    out = tmp_path_factory.mktemp("runs") / "no_calls"
    cfg = tiny(
        out, steps=3, prompts_per_step=2, log_samples_every=1, eval_prompts=4,
        reward=RewardConfig(spec="env:1", allow_user_code=True), env=EnvConfig(spec=f"{SPEC}:NoCalls"),
        grpo=replace(tiny(out).grpo, group_size=2), sampling=replace(tiny(out).sampling, max_new_tokens=8),
    )  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train.main(cfg)
    return out, printed.getvalue()


def test_a_tool_environments_calls_are_logged_and_its_silence_said(no_calls) -> None:
    out, printed = no_calls
    ms = metrics(out)
    assert [(m["env/tool_calls"], m["env/tool_parse_errors"], m["env/no_tool_call"]) for m in ms] == [
        (0, 0, 1)
    ] * 3
    assert printed.count("made no tool call") == 1 and "SFT on tool-use transcripts" in printed
    assert "| calls 0.00 |" in printed  # on the step's line


def test_episodes_cut_by_a_budget_are_said_with_the_budget_to_raise(no_calls) -> None:
    out, printed = no_calls
    assert all(m["env/truncated"] == 1.0 and m["env/truncated_turns"] == 1.0 for m in metrics(out))
    assert printed.count("100% of the episodes were cut by a budget") == 1
    # NoCalls' own max_turns is 3: no flag raises it, and the note does not advise one
    assert (
        "--env.max-turns" not in printed
        and "each scores the lowest reward of the environment's range" in printed
    )
    assert (
        "the environment's own max_turns (3) ended the episodes that ran out of turns, which no flag"
        in printed
    )


def test_samples_mark_the_trained_turns(no_calls) -> None:
    out, _ = no_calls
    steps = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    turns = [t for c in steps[0]["groups"][0]["completions"] for t in c["turns"]]
    assert {(t["role"], t["trained"]) for t in turns} == {("assistant", True), ("tool", False)}


def test_the_final_evaluation_keeps_transcripts_and_counts_distinct_answers(no_calls) -> None:
    out, printed = no_calls
    for side in ("base", "trained"):
        rows = [json.loads(line) for line in (out / f"eval_{side}.jsonl").read_text().splitlines()]
        assert len(rows) == 4 and all(len(r["turns"]) == 6 for r in rows)  # the prompt, 3 turns, 2 results
        assert all(r["completion"] == r["turns"][-1]["content"] and "env_reward" in r for r in rows)
    answers = json.loads((out / "eval.json").read_text())["answers"]
    assert set(answers) == {"base", "trained"} and answers["trained"]["n"] == 4
    assert (
        1 <= answers["trained"]["distinct"] <= 4
        and f"trained {answers['trained']['distinct']} distinct of 4" in printed
    )


# -- distinct answers, and an environment's outcome as a grader ----------------------------------------------


def test_distinct_answers_read_the_answer_tag_and_normalise() -> None:
    texts = [
        "<think>2+2</think><answer>1</answer>",
        " 1.",
        "The answer: <answer> 1 </answer>",
        "<answer>7</answer>",
    ]
    a = evaluate.answer_summary(texts)
    assert a == {"n": 4, "distinct": 2, "top": "1", "top_share": 0.75}
    assert evaluate.answer_summary(texts, RewardConfig(answer_tag=""))["distinct"] == 4  # the whole text
    table = evaluate.format_answers({"base": a, "trained": {**a, "n": 10, "distinct": 1, "top_share": 1.0}})
    assert table.splitlines()[0].startswith("answers: base 2 distinct of 4, the most common 75% ('1')")
    assert "note: trained gives the answer '1' to 100% of the rows" in table and "note: base" not in table


def test_compare_shows_each_systems_distinct_answers(tmp_path) -> None:
    rows = [{"id": i, "prompt": f"q{i}", "reference": str(i % 3)} for i in range(10)]
    write_rows(
        tmp_path / "base.jsonl", [{**r, "completion": f"<answer>{i}</answer>"} for i, r in enumerate(rows)]
    )
    write_rows(tmp_path / "trained.jsonl", [{**r, "completion": "<answer>1</answer>"} for r in rows])
    r = run_eval("compare", "base.jsonl", "trained.jsonl", "--resamples", "200", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "answers: base 10 distinct of 10" in r.stdout and "trained 1 distinct of 10" in r.stdout
    assert "note: trained gives the answer '1' to 100% of the rows" in r.stdout
    js = run_eval("compare", "base.jsonl", "trained.jsonl", "--resamples", "200", "--json", "-", cwd=tmp_path)
    assert json.loads(js.stdout)["answers"]["b"] == {"n": 10, "distinct": 1, "top": "1", "top_share": 1.0}


def test_an_environments_own_outcome_is_no_same_grader_warning(tmp_path) -> None:
    run = tmp_path / "run"
    saved_run(run, reward=RewardConfig(spec="env:1,valid:0.5,rouge_l:0.5"))
    write_rows(run / "eval_trained.jsonl", [{"id": 0, "prompt": "p", "completion": "c"}])
    msg = same_judge_warning(run / "eval_trained.jsonl", ["env", "valid", "turns", "rouge_l"])
    assert (
        msg is not None and "grader rouge_l" in msg and "grader env" not in msg and "grader valid" not in msg
    )
    assert same_judge_warning(run / "eval_trained.jsonl", ["env", "valid"]) is None
    cfg = json.loads((run / "config.json").read_text())
    ev = {"metrics": {"env": {"n": 1, "mean_a": 0, "mean_b": 1, "diff": 1, "low": 0.5, "high": 1}}}
    assert "graders the run trained on" not in eval_html(ev, cfg)  # the run page: no such note either
