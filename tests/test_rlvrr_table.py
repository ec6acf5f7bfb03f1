"""nanogrpo.lab.rlvrr: RLVRR's keyword ablation, every arm trained over seeds, one table of held-out scores."""

import json

import pytest
from helpers import train_py_here

from nanogrpo.lab import rlvrr


def test_every_arm_over_two_seeds_gives_one_table(tmp_path, capsys):
    """The smallest run that trains every default arm (5 arms x 2 seeds, 1 step of the tiny model, 2 held-out
    rows: about a minute of CPU): the table has every arm, the CI columns, and scores in range."""
    out = tmp_path / "table"
    argv = ["--model", "tiny", "--seeds", "2", "--steps", "1", "--eval-prompts", "2", "--resamples", "500"]
    with train_py_here():  # each run as train.py would, in this process
        rlvrr.main([*argv, "--out", str(out)])
    printed = capsys.readouterr().out
    res = json.loads((out / "table.json").read_text())
    assert list(res["arms"]) == list(rlvrr.DEFAULT_ARMS) and res["seeds"] == [42, 123]
    for arm, row in res["arms"].items():
        assert f"| {arm} |" in printed
        for m in rlvrr.METRICS:
            s = row["trained"][m]
            assert 0 <= s["mean"] <= 1 and s["std"] is not None and s["std"] >= 0
            assert set(row["prompts"][m].values()) == {2}
            if arm == "chains":
                assert not row["vs_chains"]
                continue
            d = row["vs_chains"][m]
            assert d["n"] == 4 and -1 <= d["low"] <= d["diff"] <= d["high"] <= 1  # 2 seeds x 2 rows, paired
    assert all(0 <= res["base"][m]["mean"] <= 1 for m in rlvrr.METRICS)
    header = printed[printed.index("| arm |") :].splitlines()[0]
    assert header.count("Δ vs chains [95% CI]") == len(rlvrr.METRICS)
    assert (out / "table.md").read_text().strip() in printed
    # each arm trained on its own keywords; all are judged on the same held-out rows, the chains' key points
    chains = [json.loads(x) for x in (out / "data" / "chains.jsonl").read_text().splitlines()]
    tfidf = [json.loads(x) for x in (out / "data" / "tfidf15.jsonl").read_text().splitlines()]
    assert len(chains) == len(tfidf) == 24 and chains[0]["key_points"] != tfidf[0]["key_points"]
    cfg = json.loads((out / "no-content" / "seed42" / "config.json").read_text())
    assert cfg["reward"]["spec"] == rlvrr.STYLE_SPEC and cfg["lora"]["r"] > 0
    # a second call trains nothing: every run has finished
    rlvrr.main([*argv, "--out", str(out)])
    assert "finished already" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_arm_commands_are_valid_train_configs(tmp_path, model):
    """Both model names give each arm a train.py command that the trainer's start-up checks accept: LoRA (so
    the held-out base-vs-trained eval runs), the arm's reward, the shared held-out rows."""
    from nanogrpo.infra.flag_checks import check_config
    from train import cli

    a = rlvrr.TableArgs(out=str(tmp_path), model=model, arms=tuple(rlvrr.ARMS))
    files, held_out = rlvrr.write_arm_data(tmp_path / "data", a.arms, a.eval_prompts)
    assert len(held_out.read_text().splitlines()) == 8  # the recipe's open-ended held-out rows
    for arm in a.arms:
        cfg = cli(rlvrr.train_args(arm, files[arm], held_out, 8, a))
        check_config(cfg)
        assert cfg.lora.r > 0 and cfg.eval_prompts == 8 and cfg.data.eval == str(held_out)
        assert cfg.reward.spec == rlvrr.ARMS[arm].spec and cfg.reward.tasks == "" and cfg.model.path == model


def test_refuses_a_table_without_chains(tmp_path):
    with pytest.raises(SystemExit) as e:
        rlvrr.main(["--arms", "tfidf15", "no-content", "--out", str(tmp_path)])
    assert e.value.code == 2
