"""What a run folder guarantees: one process at a time (a lock), an unwritable folder refused before the model
loads, resume past storage faults (torn log lines, a dangling ckpt/latest, a partial or corrupt checkpoint),
a trainer state that loads without pickle, and exact resume after SIGKILL at random moments."""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, metrics, run_train_here
from safetensors.torch import load_file

import train
from nanogrpo import startup
from nanogrpo.infra import checkpoint as ckpt
from nanogrpo.infra.metrics import JsonlWriter, read_jsonl
from nanogrpo.recipes.presets import PRESETS

TINY = PRESETS["tiny"][1]


def tiny(folder, **kw):
    return replace(TINY, out_dir=str(folder), eval_prompts=0, plots=False, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A straight 4-step run, and a 3-step run (checkpoints at steps 2 and 3) that each test copies, damages
    and resumes to 4 steps."""
    root = tmp_path_factory.mktemp("runs")
    train.main(tiny(root / "straight", steps=4, save_every=1))
    train.main(tiny(root / "three", steps=3, save_every=1))
    return root


def copy_run(runs, dest):
    shutil.copytree(runs / "three", dest)
    return dest


def resume4(run):
    return train.main(tiny(run, steps=4, save_every=1, resume=True))


def adapter(run):
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def assert_same_run(a, b):
    assert [m["step"] for m in metrics(b)] == [1, 2, 3, 4]
    assert metrics(a) == metrics(b)
    assert [s["step"] for s in read_jsonl(b / "samples.jsonl")] == [1, 2, 3, 4]
    wa, wb = adapter(a), adapter(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# ------------------------------------------------------------------------------------------------ the lock


def _wait_for(path: Path, proc, timeout=120):
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.05)


def test_a_second_process_on_the_same_out_dir_is_refused_and_a_killed_one_does_not_block(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "tiny", "--out-dir", str(run), "--steps", "1000"]
        + ["--save-every", "0", "--eval-prompts", "0", "--no-plots"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(run / "metrics.jsonl", first)  # it is training
        with pytest.raises(ValueError) as e:
            train.main(tiny(run, steps=1000, save_every=0, resume=True))
        msg = str(e.value)
        assert f"pid {first.pid}" in msg and socket.gethostname() in msg and "started" in msg, msg
        assert "\n" not in msg
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    before = (run / "metrics.jsonl").read_text()
    assert before  # the refused process wrote nothing: the first one's lines only
    # the kernel dropped the dead process's lock: resume runs (no checkpoint yet: again from step 0)
    train.main(tiny(run, steps=2, save_every=0, resume=True))
    assert [m["step"] for m in metrics(run)] == [1, 2]


# ---------------------------------------------------------------------------------- an unwritable out-dir


@pytest.fixture
def no_model(monkeypatch):
    """Start-up refusals must come before the model loads."""

    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(startup, "load_policy", refuse)


def test_an_out_dir_that_cannot_be_created_is_refused_before_the_model_loads(tmp_path, no_model):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match="cannot create --out-dir"):
        train.main(tiny(tmp_path / "file" / "run"))
    r = run_train_here("tiny", "--out-dir", str(tmp_path / "file" / "run"))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and lines[-1].startswith("error: cannot create --out-dir"), r.stderr[-2000:]


def test_a_read_only_out_dir_is_refused_before_the_model_loads(tmp_path, monkeypatch, no_model):
    import errno

    real_open = os.open

    def read_only(path, *a, **k):  # a read-only mount, as root sees one: the probe file cannot be created
        if Path(path).parent == tmp_path and Path(path).name.startswith(".write_probe"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ValueError, match="not writable.*Read-only file system"):
        train.main(tiny(tmp_path))
    assert not (tmp_path / "config.json").exists()


def test_a_folder_without_write_permission_is_refused(tmp_path, no_model):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o555)
    try:
        if os.access(run, os.W_OK):  # root ignores the mode (CI runs as root): the test above covers it
            pytest.skip("this user can write into a folder without write permission")
        with pytest.raises(ValueError, match="not writable"):
            train.main(tiny(run))
    finally:
        run.chmod(0o755)


# -------------------------------------------------------------------------------------- storage faults


def test_a_torn_last_log_line_is_dropped(runs, tmp_path):
    run = copy_run(runs, tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rew')  # the write in flight when the power went
    with (run / "samples.jsonl").open("a") as f:
        f.write('{"step": 4, "gro')
    resume4(run)
    assert_same_run(runs / "straight", run)


def test_a_torn_line_in_the_middle_is_an_error_naming_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl, line 2"):
        JsonlWriter(path).truncate_after(3)
    with pytest.raises(ValueError, match=r"metrics\.jsonl, line 2"):
        read_jsonl(path)
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "x')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]  # a torn last line is the step in flight


def test_the_log_rewrite_is_atomic(tmp_path):
    """The disk fills up in the middle of the rewrite: the log is left as it was."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": i, "pad": "x" * 200}) + "\n" for i in range(1, 11)]
    path.write_text("".join(lines))
    limit = len("".join(lines[:8])) // 2  # less than what the rewrite keeps
    code = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from nanogrpo.infra.metrics import JsonlWriter\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
        "try:\n"
        f"    JsonlWriter(Path({str(path)!r})).truncate_after(8)\n"
        "except OSError as e:\n"
        "    sys.exit(3)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 3  # the write failed...
    assert path.read_text() == "".join(lines)  # ...and the log is intact
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no half-written copy left behind
    JsonlWriter(path).truncate_after(8)
    assert path.read_text() == "".join(lines[:8])


def test_latest_pointing_at_nothing_resumes_from_the_newest_complete_checkpoint(runs, tmp_path, capsys):
    run = copy_run(runs, tmp_path / "run")
    (run / "ckpt" / "latest").write_text("step_000099")
    logged = (run / "metrics.jsonl").read_text()
    resume4(run)
    out = capsys.readouterr().out
    assert "step_000099" in out and "resumed from" in out and "step_000003" in out, out
    # steps 1-3 were not run again (their timings would differ): the run went on from step 3
    assert (run / "metrics.jsonl").read_text().startswith(logged)
    assert_same_run(runs / "straight", run)


@pytest.mark.parametrize("damage", ["partial folder", "truncated trainer state", "truncated weights"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(runs, tmp_path, capsys, damage):
    run = copy_run(runs, tmp_path / "run")
    if damage == "partial folder":  # ckpt/latest names a folder that never got its trainer state
        part = run / "ckpt" / "step_000004"
        part.mkdir()
        shutil.copy(run / "ckpt" / "step_000003" / "adapter_config.json", part)
        (run / "ckpt" / "latest").write_text("step_000004")
        with (run / "metrics.jsonl").open("a") as f:  # the step was logged before its save
            f.write(json.dumps({"step": 4}) + "\n")
    else:
        name = "trainer_state.pt" if damage == "truncated trainer state" else "adapter_model.safetensors"
        f = run / "ckpt" / "step_000003" / name
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    resume4(run)
    out = capsys.readouterr().out
    expected = "step_000003" if damage == "partial folder" else "step_000002"
    assert f"resumed from {run / 'ckpt' / expected}" in out, out
    assert "skipped" in out, out
    assert_same_run(runs / "straight", run)


def test_no_readable_checkpoint_is_refused_with_a_clear_message(runs, tmp_path):
    run = copy_run(runs, tmp_path / "run")
    for d in (run / "ckpt").glob("step_*"):
        (d / "trainer_state.pt").write_bytes(b"PK\x03\x04 not a whole file")
    with pytest.raises(ValueError, match="no complete checkpoint.*step_000003.*step_000002"):
        resume4(run)
    assert [m["step"] for m in metrics(run)] == [1, 2, 3]  # nothing trimmed


# ---------------------------------------------------------------------------- the trainer state, no pickle


class _Payload:
    """What a hostile trainer_state.pt would carry: unpickling it runs code (here: makes a folder)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_trainer_state_that_would_run_code_is_refused_and_the_code_does_not_run(runs, tmp_path):
    run = copy_run(runs, tmp_path / "run")
    marker = tmp_path / "code_ran"
    path = run / "ckpt" / "step_000003" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "data": _Payload(str(marker))}, path)
    with pytest.raises(ValueError, match="pickle"):
        resume4(run)
    assert not marker.exists()


def test_a_trainer_state_in_the_old_pickled_format_is_refused(runs, tmp_path):
    run = copy_run(runs, tmp_path / "run")
    path = run / "ckpt" / "step_000003" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    old_rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    old = {k: v for k, v in state.items() if k not in ("format", "files")}
    torch.save({**old, "rng": old_rng, "rng_all": [old_rng]}, path)  # what nanogrpo wrote before
    with pytest.raises(ValueError, match="older nanogrpo"):
        resume4(run)


def test_rng_states_round_trip_through_a_weights_only_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # a cached Gaussian is part of the state too
    torch.save({"rng": ckpt.rng_state()}, tmp_path / "s.pt")
    want = (random.random(), random.gauss(0, 1), np.random.standard_normal(), float(torch.rand(1)))
    ckpt.set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True)["rng"])
    assert (random.random(), random.gauss(0, 1), np.random.standard_normal(), float(torch.rand(1))) == want


# -------------------------------------------------------------------------------- SIGKILL at random moments


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def _kill_at(proc, run: Path, rng: random.Random, during_save: bool) -> bool:
    """SIGKILL proc at a random moment a step or two on (during_save: while a checkpoint is being written);
    False when the run ended first."""
    target = _lines(run / "metrics.jsonl") + rng.randint(1, 2)
    while proc.poll() is None and _lines(run / "metrics.jsonl") < target:
        time.sleep(0.002)
    if during_save:  # the step is logged, its checkpoint comes next
        while proc.poll() is None and not (
            (run / "ckpt").is_dir() and any(p.name.startswith(".tmp_step") for p in os.scandir(run / "ckpt"))
        ):
            time.sleep(0.0005)
        time.sleep(rng.uniform(0.0, 0.005))  # somewhere in the write, the fsyncs or the renames
    else:
        time.sleep(rng.uniform(0.0, 0.3))  # a step takes ~0.3 s: anywhere in the next one
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_equals_a_straight_run(tmp_path):
    steps = 8
    args = ["tiny", "--steps", str(steps), "--save-every", "1", "--eval-prompts", "0", "--no-plots"]
    r = run_train_here(*args, "--out-dir", str(tmp_path / "straight"))  # the reference, in this process
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "killed"
    rng = random.Random(0)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    kills, attempt = 0, 0
    while True:
        cmd = [sys.executable, str(ROOT / "train.py"), *args, "--out-dir", str(run)]
        if attempt:
            cmd.append("--resume")
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        if kills < 3 and _kill_at(proc, run, rng, during_save=kills != 1):
            kills += 1
        else:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            break
        attempt += 1
        assert attempt < 10
    assert kills == 3
    steps_logged = [m["step"] for m in metrics(run)]
    assert steps_logged == list(range(1, steps + 1))  # none twice, none missing
    assert metrics(run) == metrics(tmp_path / "straight")
    a, b = adapter(tmp_path / "straight"), adapter(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
