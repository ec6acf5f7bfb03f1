"""The seed papers' presets (semantic, judge-numbers, clinical, rlvrr, rubric): each runs end to end on the
tiny model with its embedded data, keeps the paper's settings, and shows them in --help. And the demo
preset's reward: what it pays along the way from a sentence to the one-word answer."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanogrpo.data import PromptOrder, load_task
from nanogrpo.recipes import RECIPES, file_path, recipe_path
from nanogrpo.recipes.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
PAPERS = ("semantic", "judge-numbers", "clinical", "rlvrr", "rubric")
# the smallest run that still passes every stage: one prompt, two completions of a few tokens, one step
SMALL = ["--model.path", "tiny", "--model.dtype", "float32", "--steps", "1", "--prompts-per-step", "1"]
SMALL += ["--grpo.group-size", "2", "--sampling.max-new-tokens", "6", "--eval-prompts", "0"]
LOCAL_JUDGE = ["--reward.judge.model", "tiny"]  # the judge presets' local judge, on the tiny model


def run(name: str, out: Path, *extra: str) -> list[dict]:
    from train import cli, main

    main(cli([name, *SMALL, "--no-plots", "--out-dir", str(out), *extra]))
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def saved(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())


def test_every_paper_has_a_preset_and_embedded_data():
    assert set(PAPERS) <= set(PRESETS) and set(RECIPES) == set(PAPERS)
    for name in PAPERS:
        cfg = PRESETS[name][1]
        assert cfg.data.train == cfg.data.eval == f"recipe:{name}" and cfg.out_dir == f"runs/{name}"
        assert cfg.model.path == "smollm2"
        train, source = load_task(cfg.data.train, "train")
        held_out, _ = load_task(cfg.data.eval, "eval")
        assert source == str(recipe_path(name)) and len(train) >= 20 and len(held_out) >= 8
        assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}  # held out for real
    with pytest.raises(ValueError, match="no recipe 'nope'.*semantic"):
        load_task("recipe:nope")


def test_the_papers_settings():
    from rewards.judge_entropy import SEED002_SPEC

    s = PRESETS["semantic"][1]
    assert (s.grpo.group_size, s.sampling.temperature, s.lora.r, s.lora.alpha) == (6, 0.7, 32, 64)
    assert (s.grpo.kl_placement, s.grpo.beta, s.grpo.eps_low, s.grpo.eps_high) == ("loss", 0.05, 0.2, 0.2)
    assert s.reward.spec == "semantic:1,exact:1,format:1,think:1" and s.reward.semantic_baseline
    assert s.reward.semantic_scale == 4 and s.reward.answer_tag == "risposta"
    assert s.reward.format_tags == ("spiegazione", "risposta") and s.reward.text_tag == "spiegazione"
    c = PRESETS["clinical"][1]
    assert c.reward.spec == SEED002_SPEC and (c.grpo.group_size, c.sampling.temperature) == (4, 0.7)
    assert (c.lora.r, c.lora.alpha, c.grpo.kl_placement, c.grpo.beta) == (8, 32, "loss", 0.05)
    assert c.optim.lr == 1e-5 and c.prompts_per_step == 1 and c.steps == 2000
    assert c.reward.judge.backend == PRESETS["judge-numbers"][1].reward.judge.backend == "local"
    r = PRESETS["rlvrr"][1]
    assert (r.grpo.group_size, r.epochs, r.optim.lr, r.sampling.max_new_tokens) == (8, 1.0, 5e-7, 1024)
    assert r.reward.tasks == "math=exact:1;open=keywords:0.5,style:0.5" and r.lora.r == 0
    assert {row["task"] for row in load_task(r.data.train)[0]} == {"open", "math"}
    assert PRESETS["rubric"][1].reward.rubric.readout == "probe"


def test_the_recipe_files_are_found_by_name(capsys):
    from nanogrpo.recipes import main

    assert file_path("rubric.labels") == file_path("rubric.labels.jsonl") and file_path("rubric").is_file()
    assert main(["rubric.labels"]) == 0 and capsys.readouterr().out.strip() == str(file_path("rubric.labels"))
    assert main(["nope"]) == 2 and "rubric.labels" in capsys.readouterr().err


def test_semantic_runs_and_keeps_its_settings(tmp_path):
    ms = run("semantic", tmp_path / "run", "--eval-prompts", "2")
    for part in ("semantic", "exact", "format", "think"):
        assert f"reward/{part}" in ms[0], part
    assert 0 <= ms[0]["reward"] <= 4  # an unweighted sum of four graders in [0, 1]
    cfg = saved(tmp_path / "run")
    # a flag wins, the rest of the preset stays
    assert cfg["grpo"]["group_size"] == 2 and cfg["grpo"]["kl_placement"] == "loss"
    assert cfg["lora"]["r"] == 32 and cfg["reward"]["answer_tag"] == "risposta"
    assert (tmp_path / "run" / "eval.json").exists()  # the held-out split: semantic.eval.jsonl


def test_semantic_sft_stage_renders_the_tagged_target(tmp_path):
    """The SFT stage of docs/RECIPES.md's Shaping Explanations pipeline, on the embedded quiz rows."""
    template = "<spiegazione>{reference}</spiegazione><risposta>{answer}</risposta>"
    ms = run("semantic", tmp_path / "sft", "--algo", "sft", "--data.template", template)
    assert ms[0]["loss"] > 0 and (tmp_path / "sft" / "adapter" / "adapter_config.json").exists()


def test_judge_numbers_runs_with_the_local_judge(tmp_path):
    ms = run("judge-numbers", tmp_path / "run", *LOCAL_JUDGE)
    assert "reward/judge+numbers" in ms[0] and ms[0]["judge+numbers/judge/calls"] == 1  # one group, one call


@pytest.mark.filterwarnings("ignore:concepts. no --reward.concepts-vocab")  # the demo vocabulary, on purpose
def test_clinical_runs_with_the_entropy_judge(tmp_path):
    ms = run("clinical", tmp_path / "run", *LOCAL_JUDGE)
    for part in ("judge_entropy", "concepts", "consistency"):
        assert f"reward/{part}" in ms[0], part
    assert saved(tmp_path / "run")["seed"] == 42


def test_rlvrr_runs_its_two_tasks_as_a_full_fine_tune(tmp_path):
    # two prompts a step, and a seed whose first step draws a row of each task (the trainer's PromptOrder)
    rows = load_task("recipe:rlvrr")[0]
    tasks = {s: {rows[i]["task"] for i in PromptOrder(len(rows), s).take(2)} for s in range(100)}
    seed = min(s for s, t in tasks.items() if t == {"open", "math"})
    # the preset counts its steps in epochs: --epochs 0 lets --steps 1 count
    ms = run("rlvrr", tmp_path / "run", "--epochs", "0", "--prompts-per-step", "2", "--seed", str(seed))
    for part in ("keywords", "style", "exact", "task/open", "task/math"):
        assert ms[0][f"reward/{part}"] is not None, part
    assert (tmp_path / "run" / "model" / "config.json").exists()  # --lora.r 0: an HF folder, not an adapter


def test_rubric_trains_its_probe_from_the_labels_then_runs(tmp_path, tiny_model_dir):
    from rewards.probe import read_rows, train_probe

    # docs/RECIPES.md's first command: python -m rewards.probe train --data LABELS --model FOLDER
    probe = train_probe(read_rows(file_path("rubric.labels")), str(tiny_model_dir))
    probe.save(tmp_path / "probe")
    ms = run("rubric", tmp_path / "run", "--reward.rubric.probe", str(tmp_path / "probe"))
    assert "reward/rubric" in ms[0] and 0 <= ms[0]["reward"] <= 1


def test_rubric_without_its_probe_says_how_to_train_one(tmp_path):
    with pytest.raises(ValueError, match=r"holds no probe.*python -m rewards.probe train"):
        run("rubric", tmp_path / "run", "--reward.rubric.probe", str(tmp_path / "missing"))


def test_help_shows_the_presets_values():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "90"}  # narrow: the option groups in one column
    out = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "clinical", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", out.stdout).split())  # the boxes' borders and line breaks out

    def default(flag: str) -> str:
        m = re.search(rf"{re.escape(flag)} \S+ ((?:(?! --).)*?)\(default: ([^)]*)\)", text)
        assert m, flag
        return m.group(2).replace(" ", "")  # a long value may wrap

    assert "Defaults below are the 'clinical' preset's" in text
    assert default("--grpo.group-size") == "4" and float(default("--lora.alpha")) == 32
    assert default("--sampling.temperature") == "0.7" and default("--seed") == "42"
    assert default("--reward.spec") == "judge_entropy:0.6,concepts:0.3,consistency:0.1"
    assert default("--data.train") == "recipe:clinical" and default("--reward.judge.backend") == "local"


def test_demo_reward_pays_for_every_word_a_sentence_drops():
    """The demo's reward (ROUGE-L + the overlong ramp from 4 tokens to 16) orders a question's answers by
    length: the one-word answer scores 1, each shorter sentence holding it more than the longer one, and a
    sentence of 8 tokens less than nothing (docs/STABILITY.md, "The demo on every CPU")."""
    from rewards import build_reward
    from rewards.base import Sample
    from rewards.options import with_max_tokens

    cfg = PRESETS["demo"][1]
    fn = build_reward(with_max_tokens(cfg.reward, cfg.sampling.max_new_tokens))
    row = {"reference": "Havana"}
    answers = [  # (completion, its length in tokens with the end token, as SmolLM2's tokenizer counts)
        ("Havana", 4),
        ("Havana.", 5),
        ("The capital is Havana.", 6),
        ("The capital of Cuba is Havana.", 8),
        ("The capital of Cuba, a country in the Caribbean, is Havana", 14),
    ]
    rewards, _ = fn([Sample("q", text, row=row, tokens=n) for text, n in answers])
    assert rewards[0] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(rewards, rewards[1:])), rewards
    assert rewards[3] < 0 < rewards[2]
    assert rewards[4] == pytest.approx(2 / 12 - 10 / 12)  # ROUGE-L of 1 word among 11, minus (14 - 4) / 12
