"""The research preset's parts: its files made from the search task's rows (lab/research.py), SFT on a
tool-use transcript (stages/sft.target) training exactly the tokens a search episode samples, with the tool's
messages at mask 0, and a transcript row's checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import Scripted, run_train_here
from transformers import AutoTokenizer

from nanogrpo.config import EnvConfig, SamplingConfig
from nanogrpo.data import render_prompt
from nanogrpo.envs import make_factory
from nanogrpo.envs.spec import build_spec, check_start
from nanogrpo.formats import DataError, validate_row
from nanogrpo.lab import research
from nanogrpo.recipes import HERE
from nanogrpo.stages.sft import target


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]


def test_the_recipe_files_are_made_from_the_search_rows() -> None:
    """research.jsonl and research.labels.jsonl are what `python -m nanogrpo.lab.research files` writes; the
    held-out rows are none of the training rows, and the labels are balanced enough to learn from."""
    for name, text in research.made().items():
        assert (HERE / name).read_text() == text, f"run python -m nanogrpo.lab.research ({name})"
    train, held = rows("research.jsonl"), rows("research.eval.jsonl")
    assert len(train) == 18 and len(held) == 30
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    labels = rows("research.labels.jsonl")
    assert len(labels) == 18 * 18 * 2 and {r["label"] for r in labels} == {0, 1}
    assert 0.3 < sum(r["label"] for r in labels) / len(labels) < 0.6
    by = {(r["response"], r["criterion"][:5]): r["label"] for r in labels}
    row, q = train[0], research.question(train[0])
    said = (
        lambda text: "\n\n".join(  # noqa: E731
            f"{m['role']}: {m['content']}"
            for m in [*row["completion"][:2], {"role": "assistant", "content": text}]
        )
    )
    ans, src = row["answer"], row["sources"][0]
    assert (
        by[(said(f"<answer>{ans} [{src}]</answer>"), "State")],
        by[(said(f"<answer>{ans} [{src}]</answer>"), "Cites")],
    ) == (1, 1)
    assert (by[(said(f"<answer>{q}</answer>"), "State")], by[(said(f"<answer>{q}</answer>"), "Cites")]) == (
        0,
        0,
    )
    assert (
        by[(said(f"<answer>{ans}</answer>"), "State")],
        by[(said(f"<answer>{ans}</answer>"), "Cites")],
    ) == (1, 0)
    unsearched = f"assistant: <answer>{ans} [{src}]</answer>"  # an id it never read is no citation
    assert (by[(unsearched, "State")], by[(unsearched, "Cites")]) == (1, 0)
    first = train[0]["completion"]
    assert [m["role"] for m in first] == ["assistant", "tool", "assistant"]
    assert f"[{train[0]['sources'][0]}]" in first[1]["content"]  # the search finds the row's source
    assert first[2]["content"] == f"<answer>{train[0]['answer']} [{train[0]['sources'][0]}]</answer>"


def test_a_transcript_trains_the_tokens_a_search_episode_samples(monkeypatch, tiny_model_dir) -> None:
    """SFT's ids for a transcript row are the ids a search episode lays out when the model writes the
    transcript's assistant turns (the environment's own answers between them), token for token; SFT trains
    the assistant's tokens (mask 1) and not the tool's (mask 0), as the episode's mask does."""
    from nanogrpo.envs import episode
    from nanogrpo.model.transformer import Transformer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = Transformer.from_pretrained(tiny_model_dir).eval()
    row = dict(rows("research.jsonl")[0])
    row["_prompt_ids"] = render_prompt(tok, row)
    env = build_spec(make_factory("search", "", False), "search", EnvConfig(name="search"), 48)
    env = check_start(env, tok, [row], "", 900, 1024, 2)
    said = [m["content"] for m in row["completion"] if m["role"] == "assistant"]
    Scripted.turns = [tok(said[0])["input_ids"], tok(said[1])["input_ids"] + [tok.eos_token_id]]
    monkeypatch.setattr(episode, "Sampler", Scripted.make(episode.Sampler))
    with torch.no_grad():
        trajs = episode.play(model, tok, env, [row], [7], SamplingConfig(max_new_tokens=48), 2, system_prompt="",
                             eos_ids=(tok.eos_token_id,), pad_id=0)  # fmt: skip
    env.workers.close()
    ids, mask = target(row, tok, "", [tok.eos_token_id])
    for t in trajs:
        assert t.prompt_ids == row["_prompt_ids"]
        assert t.ids == ids and t.mask == [float(m) for m in mask]
        assert [m["content"] for m in t.turns] == [m["content"] for m in row["completion"]]
        assert t.reward == pytest.approx(1.0) and t.done  # the right answer, citing its source
    n1 = len(Scripted.turns[0])
    tool = tok.decode(ids[n1 : len(ids) - len(Scripted.turns[1])])
    assert row["completion"][1]["content"] in tool and mask[n1 : len(ids) - len(Scripted.turns[1])] == [0] * (
        len(ids) - n1 - len(Scripted.turns[1])
    )


def test_a_reference_row_trains_its_reference_then_eos(tiny_model_dir) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids, mask = target({"reference": "Paris."}, tok, "", [tok.eos_token_id])
    assert ids == tok("Paris.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert mask == [1] * len(ids)


@pytest.mark.parametrize(
    "completion, why",
    [
        ([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "b"}], "end on an assistant"),
        ([{"role": "assistant", "content": 3}], "must be a chat message"),
        (["text"], "must be a chat message"),
        ([], "end on an assistant"),
    ],
)
def test_a_transcript_row_is_checked(completion, why) -> None:
    with pytest.raises(DataError, match=why):
        validate_row({"prompt": "q", "completion": completion}, "rows.jsonl:1")


def test_the_pipeline_skips_done_stages_and_checks_the_judge(tmp_path, monkeypatch, capsys) -> None:
    """`run` with every stage's output there runs nothing, prints the base / SFT / GRPO table and the judge
    check: the probe's verdicts, read back from each episode's rubric score (weights 2 and 1), against the
    environment's solved / cited."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(research.subprocess, "call", lambda cmd: pytest.fail(f"ran {cmd}"))
    rubric = [
        {"criterion": "States that the answer is X", "weight": 2},
        {"criterion": "Cites it", "weight": 1},
    ]
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    episodes = [  # (rubric score, solved, cited): verdicts (1, 1) (1, 0) (0, 1) (0, 0)
        (1.0, True, True), (2 / 3, False, False), (1 / 3, False, True), (0.0, True, True),
    ]  # fmt: skip
    for stage in (research.SFT, research.GRPO):
        stage.mkdir(parents=True)
        recs = [
            {"prompt": "q", "rubric": rubric, "turns": turns, "scores": {"rubric": r}, "env_info": {"solved": s, "cited": c}}
            for r, s, c in episodes
        ]  # fmt: skip
        (stage / "eval_trained.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        m = {"mean_a": 0.1, "mean_b": 0.2, "diff": 0.1, "low": 0.05, "high": 0.15}
        (stage / "eval.json").write_text(json.dumps({"n": 4, "metrics": {"rubric": m}}))
    research.PROBE.mkdir(parents=True)
    (research.PROBE / "probe.json").write_text("{}")
    assert research.judge_check(research.GRPO / "eval_trained.jsonl") == (0.5, 0.75, 4)
    assert research.main(["run"]) == 0
    out = capsys.readouterr().out
    assert (
        out.count("done (") == 3
        and "rubric                0.100  0.100  0.200   +0.100 [+0.050, +0.150]" in out
    )
    assert "agree with the environment's own checks on 50% (answer) and 75% (citation)" in out


def test_the_research_preset_without_its_probe_names_the_pipeline(tmp_path) -> None:
    """`python train.py research` before the pipeline's first stage: exit 2 before any model loads, naming the
    command that trains the probe judge, not the generic one."""
    r = run_train_here("research", "--out-dir", tmp_path / "grpo", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "python -m nanogrpo.lab.research run" in r.stderr and "runs/research/probe" in r.stderr, r.stderr
    # the probe's own command names a file that is there
    labels = Path(r.stderr.split("--data ", 1)[1].split()[0])
    assert labels.is_file() and labels.name == "research.labels.jsonl", labels
    assert not (tmp_path / "grpo").exists()  # refused before the run folder
