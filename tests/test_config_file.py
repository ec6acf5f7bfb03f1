"""`train.py --config FILE`: a new run whose defaults are a saved (or hand-written) config, and
RUN/environment.json, what a run ran on."""

import json
import subprocess
from dataclasses import replace

import pytest
import torch
from helpers import ROOT, TINY, metrics, run_train, run_train_here, saved_run

from nanogrpo.config import TrainConfig
from nanogrpo.infra import heap
from nanogrpo.infra.config_file import load_config
from nanogrpo.infra.cpu import cpu_capability
from nanogrpo.infra.provenance import git_state
from train import cli, main


def test_a_rerun_from_config_json_reproduces_the_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    main(replace(TINY, out_dir=str(a), steps=3))
    cfg = cli(["--config", str(a / "config.json"), "--out-dir", str(b)])
    assert cfg == replace(load_config(a), out_dir=str(b))
    r = run_train("--config", str(a / "config.json"), "--out-dir", str(b))  # the command line, end to end
    assert r.returncode == 0, r.stderr[-3000:]
    assert metrics(a) == metrics(b) and [m["step"] for m in metrics(b)] == [1, 2, 3]
    assert load_config(b) == cfg  # config.json stays a TrainConfig: nothing foreign in it
    env = json.loads((b / "environment.json").read_text())
    assert env["device"] == "cpu" and env["dtype"] == "float32"  # the tiny preset's dtype
    assert env["versions"]["torch"] == torch.__version__ and env["versions"]["transformers"]
    assert env["versions"]["nanogrpo"] and env["python"] and env["cpu"] == str(cpu_capability())
    assert "--config" in env["argv"] and "earlier" not in env
    assert env["heap_kept"] == bool(heap._glibc("mallopt") and heap._glibc("malloc_trim"))  # a CPU run, glibc


def test_flags_override_the_config(tmp_path):
    cfg = saved_run(tmp_path / "a", optim=replace(TINY.optim, lr=5e-4), resume=True)  # a resumed run's config
    new = cli(
        ["--config=" + str(tmp_path / "a" / "config.json"), "--out-dir", str(tmp_path / "b"), "--steps", "2"]
    )
    assert new == replace(cfg, out_dir=str(tmp_path / "b"), steps=2, resume=False)
    assert new.optim.lr == 5e-4  # from the file, not the preset


def test_the_command_line_refusals_are_one_line(tmp_path):
    saved_run(tmp_path / "a")
    conf = str(tmp_path / "a" / "config.json")
    r = run_train_here("--config", conf)  # no --out-dir: the config's own folder
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and lines[-1].startswith("error:") and "pass another --out-dir" in lines[-1]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "is the folder that config is in: pass another --out-dir"),
        (["--out-dir", "{a}"], "is the folder that config is in"),
        (["--out-dir", "{b}", "--resume"], "drop --resume"),
        (["--out-dir", "{ran}"], "already holds a run: pass another --out-dir"),
    ],
)
def test_a_rerun_is_a_new_run_in_a_new_folder(tmp_path, args, needle):
    saved_run(tmp_path / "a")
    (tmp_path / "ran").mkdir()
    (tmp_path / "ran" / "metrics.jsonl").write_text("")
    args = [x.format(a=tmp_path / "a", b=tmp_path / "b", ran=tmp_path / "ran") for x in args]
    with pytest.raises(ValueError, match=needle):
        cli(["--config", str(tmp_path / "a" / "config.json"), *args])


def test_a_moved_run_folder_is_refused_too(tmp_path):
    """The config names a folder that holds the run it came from: no --out-dir is refused there too."""
    main(replace(TINY, out_dir=str(tmp_path / "run"), steps=1))
    copy = tmp_path / "copy.json"
    copy.write_text((tmp_path / "run" / "config.json").read_text())
    with pytest.raises(ValueError, match="already holds a run"):
        cli(["--config", str(copy)])


def test_a_preset_with_config_is_refused(tmp_path):
    saved_run(tmp_path / "a")
    with pytest.raises(ValueError, match="drop 'tiny'"):
        cli(["tiny", "--config", str(tmp_path / "a" / "config.json"), "--out-dir", str(tmp_path / "b")])


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"grpo": {"groupsize": 4}}', "grpo.groupsize is not an option"),
        ('{"stepz": 4}', "stepz is not an option"),
        ('{"steps": "four"}', '--steps is "four"; a JSON int'),
        ('{"steps": true}', "--steps is true; a JSON int"),
        ('{"grpo": {"scale_rewards": "rank"}}', '--grpo.scale-rewards is "rank"; one of'),
        ('{"grpo": 4}', "grpo must be a JSON object"),
        ('{"lora": {"targets": "q_proj"}}', '--lora.targets is "q_proj"; a list'),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_key(tmp_path, text, needle):
    (tmp_path / "c.json").write_text(text)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        cli(["--config", str(tmp_path / "c.json"), "--out-dir", str(tmp_path / "b")])


def test_missing_config_and_flag_without_a_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        cli(["--config", str(tmp_path / "nope.json"), "--out-dir", str(tmp_path / "b")])
    with pytest.raises(ValueError, match="needs a file"):
        cli(["--config", "--out-dir", str(tmp_path / "b")])


def test_a_hand_written_partial_config_takes_the_defaults_and_trains(tmp_path):
    hand = {
        "steps": 1,
        "prompts_per_step": 2,
        "model": {"path": "tiny", "dtype": "float32"},
        "lora": {"r": 2, "alpha": 4, "targets": ["q_proj", "v_proj"]},
        "sampling": {"max_new_tokens": 6, "temperature": 0.5},
        "grpo": {"group_size": 2},
        "optim": {"lr": 1},  # an int where a float goes: taken as 1.0
    }
    (tmp_path / "hand.json").write_text(json.dumps(hand))
    cfg = cli(["--config", str(tmp_path / "hand.json"), "--out-dir", str(tmp_path / "run")])
    d = TrainConfig()
    want = replace(
        d,
        steps=1,
        prompts_per_step=2,
        out_dir=str(tmp_path / "run"),
        model=replace(d.model, path="tiny", dtype="float32"),
        lora=replace(d.lora, r=2, alpha=4, targets=("q_proj", "v_proj")),
        sampling=replace(d.sampling, max_new_tokens=6, temperature=0.5),
        grpo=replace(d.grpo, group_size=2),
        optim=replace(d.optim, lr=1.0),
    )
    assert cfg == want and isinstance(cfg.optim.lr, float) and cfg.data == d.data  # the rest: defaults
    main(replace(cfg, plots=False))
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1]


def test_environment_json_records_the_commit_and_resumes_keep_earlier_starts(tmp_path):
    run = tmp_path / "run"
    main(replace(TINY, out_dir=str(run), steps=1, save_every=1))
    first = json.loads((run / "environment.json").read_text())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout: the commit, and whether the tree differed from it
        assert first["git"]["commit"] == head.stdout.strip() and isinstance(first["git"]["dirty"], bool)
    main(replace(TINY, out_dir=str(run), steps=2, resume=True))
    second = json.loads((run / "environment.json").read_text())
    assert second["earlier"] == [first] and second["device"] == "cpu"


def test_git_state_is_none_outside_a_checkout(tmp_path):
    assert git_state(tmp_path) is None
