"""What a run refuses before it trains, and how it stops when training goes wrong: settings that run code
never come from a file, numbers must be finite, a step that goes non-finite stops the run (exit 3) with its
last finite checkpoint kept, --data.eval is checked with the training data, odd config files get one line."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from nanogrpo import startup
from nanogrpo.recipes.presets import PRESETS
from train import NonFiniteStep, cli, main

ROOT = Path(__file__).resolve().parents[1]
TINY = replace(PRESETS["tiny"][1], plots=False)  # no PNGs or run page: nothing here reads them

EVIL = """from pathlib import Path
Path(__file__).with_name("ran").write_text("imported")
def f(batch):
    return [0.5 for _ in batch]
"""


def tampered_run(tmp_path: Path) -> Path:
    """A finished one-step run whose config.json someone edited to run their grader file, allowed."""
    run = tmp_path / "run"
    main(replace(TINY, out_dir=str(run), steps=1))
    (tmp_path / "evil.py").write_text(EVIL)
    cfg = json.loads((run / "config.json").read_text())
    cfg["reward"].update(spec=f"{tmp_path / 'evil.py'}:f:1,rouge_l:1", allow_user_code=True)
    (run / "config.json").write_text(json.dumps(cfg))
    return run


def test_a_config_file_someone_else_wrote_runs_none_of_its_code(tmp_path):
    run = tampered_run(tmp_path)
    with pytest.raises(ValueError):  # --resume of the folder
        main(cli(["--resume", "--out-dir", str(run), "--steps", "2"]))
    with pytest.raises(ValueError, match=r"evil\.py.*calls f.*--reward\.allow-user-code"):  # --config FILE
        main(cli(["--config", str(run / "config.json"), "--out-dir", str(tmp_path / "rerun")]))
    assert not (tmp_path / "ran").exists()  # the file was never imported


def test_code_runs_when_this_command_line_allows_it(tmp_path, monkeypatch):
    run = tampered_run(tmp_path)
    flag = ["--config", str(run / "config.json"), "--steps", "1", "--reward.allow-user-code"]
    cfg = cli([*flag, "--out-dir", str(tmp_path / "typed")])
    assert cfg.reward.allow_user_code
    main(cfg)
    assert (tmp_path / "ran").read_text() == "imported"
    saved = json.loads((tmp_path / "typed" / "config.json").read_text())
    assert saved["reward"]["allow_user_code"] is True  # the run records that it ran code
    monkeypatch.setenv("NANOGRPO_ALLOW_USER_CODE", "1")  # the environment variable docs/RUNS.md names
    assert cli(
        ["--config", str(run / "config.json"), "--out-dir", str(tmp_path / "env")]
    ).reward.allow_user_code


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_numbers_are_refused_at_start_up(tmp_path, value):
    with pytest.raises(ValueError, match=rf"--optim.lr {value}: must be a finite number > 0"):
        main(cli(["tiny", "--optim.lr", value, "--out-dir", str(tmp_path / "flag")]))
    cfg = json.loads(json.dumps({"optim": {"lr": float(value)}}))  # JSON's Infinity / NaN
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="--optim.lr .*: must be a finite number"):
        main(cli(["--config", str(tmp_path / "c.json"), "--out-dir", str(tmp_path / "file")]))
    assert not (tmp_path / "flag").exists() and not (tmp_path / "file").exists()


def test_a_step_that_goes_non_finite_stops_the_run_and_keeps_the_last_finite_checkpoint(tmp_path):
    import torch
    from safetensors.torch import load_file

    run = tmp_path / "run"
    cfg = replace(TINY, out_dir=str(run), steps=6, save_every=1, optim=replace(TINY.optim, lr=1e30))
    with pytest.raises(NonFiniteStep, match=r"step \d: .* is not finite, so the run stops") as e:
        main(cfg)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    bad_step = json.loads(lines[-1])["step"]
    assert bad_step < 6 and f"step {bad_step}:" in str(e.value)  # it stopped there, with the step logged
    kept = sorted((run / "ckpt").glob("step_*"))
    assert kept and kept[-1].name == f"step_{bad_step - 1:06d}" and str(kept[-1]) in str(e.value)
    for t in load_file(str(kept[-1] / "adapter_model.safetensors")).values():
        assert torch.isfinite(t).all()
    assert not (run / "adapter").exists()  # no final adapter from non-finite weights


def test_a_grader_of_huge_scores_stops_the_run_instead_of_training_on_nan(tmp_path):
    """+-1.7e308 is a finite float64 but not a float32: the rewards become +-inf, the advantages NaN."""
    (tmp_path / "huge.py").write_text(
        "def f(prompts, completions, **kw):\n"
        "    return [1.7e308 if i % 2 else -1.7e308 for i in range(len(completions))]\n"
    )
    spec = f"{tmp_path / 'huge.py'}:f:1"
    args = ["tiny", "--reward.spec", spec, "--reward.allow-user-code", "--out-dir", str(tmp_path / "run")]
    with pytest.raises(NonFiniteStep, match="step 1: loss nan"):
        main(cli(args))
    assert not (tmp_path / "run" / "adapter").exists()


def test_a_non_finite_run_exits_3_from_the_command_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = ["tiny", "--optim.lr", "1e30", "--steps", "6", "--out-dir", str(tmp_path / "run")]
    r = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 3, r.stderr[-2000:]
    assert "is not finite, so the run stops" in r.stderr.splitlines()[-1]


def test_the_eval_file_is_checked_before_the_model_loads(tmp_path, monkeypatch):

    monkeypatch.setattr(startup, "load_policy", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match="missing.jsonl"):
        main(cli(["tiny", "--data.eval", str(tmp_path / "missing.jsonl"), "--out-dir", str(tmp_path / "a")]))
    rows = tmp_path / "no_reference.jsonl"  # the graders (rouge_l) need a reference: refused, naming the line
    rows.write_text(json.dumps({"prompt": "q"}) + "\n")
    with pytest.raises(ValueError, match="no_reference.jsonl"):
        main(cli(["tiny", "--data.eval", str(rows), "--eval-prompts", "1", "--out-dir", str(tmp_path / "b")]))


def test_an_empty_out_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--out-dir '': name the run's folder"):
        main(cli(["tiny", "--out-dir", ""]))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"steps": ' + "9" * 5000 + "}", "not valid JSON"),
    ],
    ids=["deep", "long-int"],
)
def test_odd_config_files_get_one_line_naming_the_file(tmp_path, text, needle):
    path = tmp_path / "odd.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"odd\.json: {needle}"):
        cli(["--config", str(path), "--out-dir", str(tmp_path / "run")])
