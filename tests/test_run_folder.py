"""What a run folder refuses and what --resume checks: no write through a symbolic link (the lock, the logs,
a temp file), a config.json edited by hand, data files edited in place, a checkpoint whose content changed
at the same size, and the checkpoint step's log line restored when a crash tore it."""

import json
import shutil
from dataclasses import replace

import pytest

import train
from nanogrpo.infra import checkpoint as ckpt
from nanogrpo.infra.metrics import JsonlWriter, replace_atomically
from nanogrpo.infra.run_dir import data_fingerprint, lock_run_dir, release_run_dir
from nanogrpo.recipes.demo import demo_rows
from nanogrpo.recipes.presets import PRESETS

TINY = replace(PRESETS["tiny"][1], plots=False)  # no PNGs or run page: nothing here reads them


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A one-step run (its checkpoint at step 1) on data files of its own, copied by each test."""
    root = tmp_path_factory.mktemp("base")
    for split in ("train", "eval"):
        rows = [{"prompt": r["prompt"], "reference": r["reference"]} for r in demo_rows(split)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = replace(TINY.data, train=str(root / "train.jsonl"), eval=str(root / "eval.jsonl"))
    train.main(replace(TINY, out_dir=str(root / "run"), steps=1, eval_prompts=0, data=data))
    return root


@pytest.fixture
def run(base, tmp_path):
    return shutil.copytree(base / "run", tmp_path / "run", symlinks=True)


def resume(run, *flags):
    return train.main(train.cli(["--out-dir", str(run), "--resume", *flags]))


def steps(run):
    return [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------ A. no write through a link


def test_a_lock_that_is_a_link_is_refused_and_its_target_is_untouched(run, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / ".lock").unlink()
    (run / ".lock").symlink_to(victim)
    with pytest.raises(ValueError, match=r"\.lock is a symbolic link.*remove the link"):
        resume(run)
    assert victim.read_text() == "precious\n"


def test_the_lock_is_created_exclusively_and_never_through_a_link(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / ".lock").symlink_to(tmp_path / "made_by_the_lock")  # dangling: O_CREAT would create it
    with pytest.raises(ValueError, match=r"\.lock is a symbolic link"):
        lock_run_dir(folder)
    assert not (tmp_path / "made_by_the_lock").exists()
    (folder / ".lock").unlink()
    lock_run_dir(folder)  # a new lock file, and then the one an earlier run left (a stale lock is reused)
    try:
        assert json.loads((folder / ".lock").read_text())["pid"]
    finally:
        release_run_dir(folder)
    lock_run_dir(folder)
    release_run_dir(folder)


def test_a_metrics_log_that_is_a_link_is_refused_and_its_target_is_untouched(run, tmp_path):
    victim = tmp_path / "victim.jsonl"
    shutil.move(run / "metrics.jsonl", victim)
    (run / "metrics.jsonl").symlink_to(victim)
    before = victim.read_text()
    with pytest.raises(ValueError, match=r"metrics\.jsonl is a symbolic link.*remove the link"):
        resume(run, "--steps", "2")
    assert victim.read_text() == before


def test_appends_and_atomic_replaces_never_follow_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(ValueError, match="metrics.jsonl is a symbolic link"):
        JsonlWriter(tmp_path / "metrics.jsonl").write({"step": 1})
    (tmp_path / "config.json.tmp").symlink_to(victim)  # the temp file of an atomic replace
    replace_atomically(tmp_path / "config.json", "{}")
    assert (tmp_path / "config.json").read_text() == "{}" and not (tmp_path / "config.json").is_symlink()
    assert victim.read_text() == "precious\n"


# ------------------------------------------------------------------------------- B. what --resume checks


def test_a_config_json_edited_by_hand_is_refused_naming_the_field(run):
    cfg = json.loads((run / "config.json").read_text())
    cfg["optim"]["lr"] = 0.05  # the optimizer state would bring back 0.001: the run would train at that
    (run / "config.json").write_text(json.dumps(cfg, indent=2))
    with pytest.raises(ValueError, match=r"config\.json.*optim\.lr: 0\.001 -> 0\.05"):
        resume(run, "--steps", "2")
    assert steps(run) == [1]


def test_a_safe_field_edited_in_config_json_resumes(run):
    cfg = json.loads((run / "config.json").read_text())
    cfg["log_samples_every"] = 0  # what is written, not what is trained: as the flag would
    (run / "config.json").write_text(json.dumps(cfg))
    resume(run)
    assert steps(run) == [1]


@pytest.mark.parametrize("which", ["train", "eval"])
def test_a_data_file_edited_in_place_is_refused_naming_it(run, base, which):
    path = base / f"{which}.jsonl"
    before = path.read_bytes()
    try:
        i = before.index(b'"reference": "') + len(b'"reference": "')
        path.write_bytes(before[:i] + b"Z" + before[i + 1 :])  # the same size, another reference
        with pytest.raises(ValueError, match=rf"--data\.{which} {path} changed since the run started"):
            resume(run)
    finally:
        path.write_bytes(before)


def test_data_fingerprints_of_built_in_tasks_and_the_cache(tmp_path):
    assert data_fingerprint("demo", "train")["sha256"] != data_fingerprint("demo", "eval")["sha256"]
    assert data_fingerprint("recipe:semantic", "train")["size"] > 0
    assert "not checked" in data_fingerprint("someone/dataset:train", "train")["skipped"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("one")
    first = data_fingerprint(str(tmp_path / "d"), "train")
    (tmp_path / "d" / "a.txt").write_text("two")
    assert data_fingerprint(str(tmp_path / "d"), "train")["sha256"] != first["sha256"]


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "trainer_state.pt"])
def test_a_same_size_corruption_of_a_checkpoint_is_passed_over_by_name(run, name):
    f = run / "ckpt" / "step_000001" / name
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte in the middle of the tensors: the size and the format stay
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"no complete checkpoint.*step_000001 skipped: {name}.*sha256"):
        resume(run)
    with pytest.raises(ValueError, match=name):
        ckpt.find_resume_point(run / "ckpt")


def test_the_checkpoint_steps_torn_log_line_is_restored_from_the_checkpoint(run):
    line = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(line[: len(line) // 2])  # the step's line, cut by a crash
    resume(run)
    assert (run / "metrics.jsonl").read_text() == line


def test_a_torn_line_followed_only_by_lines_after_the_checkpoint_is_dropped_with_them(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n')
    assert JsonlWriter(path).truncate_after(2) == 2  # the torn line is step 2's or a later one
    assert path.read_text() == '{"step": 1}\n'
