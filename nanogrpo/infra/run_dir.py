"""Run folders and resume: what a resumed run may change, and one run per folder (reading config.json back
is nanogrpo/infra/config_file.py).

`python train.py --out-dir RUN --resume` continues RUN as it was configured: RUN/config.json (the resolved
TrainConfig the run saved) is the default that the flags override, so flags name only what changes. A change
that would make the rest of the run differ from a straight run is refused rather than half-applied: the
checkpoint brings back the optimizer with its own learning rate and the scheduler with its own position, so
a new --optim.lr, say, would be silently ignored, and a new --sampling.temperature would train on samples the
first half never saw. A fresh run is refused in a folder that already holds a run, so two runs never mix in
one metrics.jsonl.

One process at a time: the process that writes (rank 0 under torchrun) holds `RUN/.lock` with `flock` for as
long as it lives, and a second one is refused, naming the first. The kernel drops the lock when its process
dies, kill -9 included, so a crashed run never blocks its own resume. A folder that cannot be created or
written is refused before the model loads, and so is one with a symbolic link among its entries (or ckpt/'s):
through it the run would write wherever the link points.

What a checkpoint was trained with is checked too, not only the flags: every start records the sha256 of the
config.json it writes and the size and sha256 of its data files (`run_record`), every checkpoint keeps that
record, and --resume compares it with the config.json and the data on disk (`check_run_record`). A
config.json edited by hand in a field outside SAFE, or a data file edited in place, is refused by name.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nanogrpo.config import TrainConfig
from nanogrpo.infra import checkpoint as ckpt
from nanogrpo.infra.config_file import flag, flat_config, from_dict, load_config, renamed_options
from nanogrpo.infra.metrics import link_refused, open_run_fd, replace_atomically, sha256_file

# Fields a resumed run may change, and why each leaves the trained weights exactly as a straight run's.
# Anything else is refused. `steps` is the one conditional field: see _unsafe_reason.
SAFE: dict[str, str] = {
    "resume": "the flag that asks for this",
    "out_dir": "where the run lives: a moved or renamed folder holds the same run",
    "save_every": "when checkpoints are written; writing one only reads the state",
    "log_samples_every": "what samples.jsonl shows; the samples are drawn and scored either way",
    "eval_prompts": "the held-out comparison after the last step; training never sees it",
    "eval_every": "when held-out evaluation runs: it restores the RNG and the model's mode, training is unchanged",
    "eval_samples": "how many sampled answers that evaluation scores, from generators of its own",
    "eval_pass_threshold": "the score that counts as a pass in that evaluation",
    "memory_check": "the start-up memory check: a resume keeps the saved --micro-batch whatever it says",
    "reward.allow_user_code": "permission to run the graders' own code: typed on each command line",
    "reward.style_allow_user_code": "permission to run the style checks' own code: typed on each command line",
    "data.eval": "the held-out rows of that comparison",
    "wandb": "where the metrics are also sent",
    "tensorboard": "where the metrics are also sent",
    # how a judge request is carried, not what it asks: the marks are the same
    "reward.judge.timeout_s": "how long a judge request may take before it is retried",
    "reward.judge.max_retries": "how often a failed judge request is retried",
    "reward.judge.backoff_s": "the wait before a judge retry",
    "reward.judge.max_backoff_s": "the longest wait before a judge retry",
    "reward.judge.concurrency": "how many judge requests are in flight at once",
}


def differences(saved: TrainConfig, given: TrainConfig) -> list[tuple[str, Any, Any]]:
    """(dotted field, saved value, given value) for every field that differs, in the config's order.
    Both sides go through JSON, so a tuple and the list it was saved as compare equal."""
    a, b = (flat_config(json.loads(json.dumps(asdict(c)))) for c in (saved, given))
    return [(k, a[k], b[k]) for k in a if a[k] != b[k]]


def _unsafe_reason(path: str, saved: TrainConfig) -> str | None:
    """None when changing `path` on resume keeps the run exact, else '' or a reason for the message."""
    if path in SAFE:
        return None
    if path == "steps":
        # a constant schedule (warmup included) never reads the total, so more steps only extend the loop;
        # cosine decays over steps * num_iterations (nanogrpo/optim.py): a new total changes every later lr
        if saved.optim.schedule == "constant":
            return None
        return f" (--optim.schedule {saved.optim.schedule} decays over --steps)"
    return ""


def unsafe_changes(saved: TrainConfig, given: TrainConfig, name=lambda k: k) -> list[str]:
    """'name: old -> new (why)' for each difference a resume may not make (`name`: how a field is named)."""
    return [
        f"{name(k)}: {json.dumps(a)} -> {json.dumps(b)}{why}"
        for k, a, b in differences(saved, given)
        if (why := _unsafe_reason(k, saved)) is not None
    ]


def check_resume(saved: TrainConfig, given: TrainConfig) -> None:
    """Refuse, naming each flag, any change that would make the resumed run differ from a straight one."""
    if bad := unsafe_changes(saved, given, flag):
        raise ValueError(
            f"--resume continues {given.out_dir} exactly as it was configured, and these flags change it: "
            f"{'; '.join(bad)}. Drop them to resume, or start a new run with another --out-dir"
        )


def check_writable(out: Path) -> None:
    """Create out (and its parents) and write and remove a probe file in it: ValueError if either fails, so
    a read-only or mistyped --out-dir is refused at start-up, not at the first step's log line."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"cannot create --out-dir {out}: {e.strerror} ({e.filename}); pick another --out-dir"
        ) from e
    probe = out / f".write_probe_{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"nanogrpo")
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as e:
        raise ValueError(
            f"--out-dir {out} is not writable ({e.strerror}): a run writes its logs and checkpoints there; "
            "pick another --out-dir or fix its permissions"
        ) from e


_HELD: dict[Path, int] = {}  # run folders this process holds: the descriptor of each one's .lock


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}: {' '.join(info['argv'])}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said who it is yet"


def lock_run_dir(out: Path) -> None:
    """Hold out/.lock until this process ends (or release_run_dir): ValueError, naming the holder, if
    another process holds it. Taking it again in the same process (main() called twice) is a no-op."""
    key = out.resolve()
    if key in _HELD:
        return
    path = out / ".lock"
    try:  # never through a link: open_run_fd refuses one by name, the lock's target untouched
        fd = open_run_fd(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)  # a new lock file, made by this process
    except FileExistsError:  # one an earlier run left: the flock, not the file, is the lock
        fd = open_run_fd(path, os.O_RDWR)  # no O_TRUNC: a holder's details stay for the message below
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ValueError(
            f"{out} is in use by another nanogrpo process ({holder}); two processes in one folder would "
            "interleave their logs and checkpoints: wait for it to end (or stop it), or pick another --out-dir"
        ) from None
    except OSError as e:  # a file system without flock (some network mounts): run, and say it is unguarded
        os.close(fd)
        print(f"note: {out / '.lock'} cannot be locked ({e.strerror}): nothing stops a second process there")
        return
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": started, "argv": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    _HELD[key] = fd


def release_run_dir(out: Path) -> None:
    """Let go of out/.lock (the end of main(); a process that dies lets go of it anyway)."""
    fd = _HELD.pop(Path(out).resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the flock


def refuse_links(out: Path) -> None:
    """ValueError naming the first symbolic link among out's entries and out/ckpt's, with the fix.

    Every file nanogrpo writes in a run folder (the lock, logs, config, plots, checkpoints, the judge cache,
    eval files, the run page) is one of these entries or lies in one of these folders, so a link there would
    send a write outside the run. The folder itself may be a link (a run kept on another disk)."""
    for folder in (out, out / "ckpt"):
        if folder.is_dir():
            for p in sorted(folder.iterdir()):
                if p.is_symlink():
                    raise link_refused(p)


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def data_fingerprint(spec: str, split: str) -> dict[str, Any]:
    """What the rows of --data.train / --data.eval `spec` are now: {"source", "size" (bytes), "sha256"}.

    A file is hashed in 1 MiB blocks, a folder (a datasets save_to_disk, CPT's .txt files) over every file
    in it with its relative path, 'recipe:NAME' as its embedded file, 'demo' as its rows (generated in code).
    NAME:SPLIT from the Hugging Face cache is {"source", "skipped": why}."""
    if spec == "demo":
        from nanogrpo.recipes.demo import demo_rows

        rows = json.dumps(demo_rows(split), sort_keys=True)
        return {"source": spec, "size": len(rows), "sha256": _sha256_text(rows)}
    path = Path(spec)
    if spec.startswith("recipe:"):
        from nanogrpo.recipes import recipe_path

        path = recipe_path(spec.removeprefix("recipe:"), split)
    if path.is_file():
        return {"source": spec, "size": path.stat().st_size, "sha256": sha256_file(path)}
    if path.is_dir():
        h, size = hashlib.sha256(), 0
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            size += f.stat().st_size
            h.update(f"{f.relative_to(path)}\0{f.stat().st_size}\0{sha256_file(f)}\n".encode())
        return {"source": spec, "size": size, "sha256": h.hexdigest()}
    why = "rows of the local Hugging Face cache, whose files datasets manages: not checked on resume"
    return {"source": spec, "skipped": why}


def run_record(cfg: TrainConfig, config_text: str) -> dict[str, Any]:
    """What this start trains with, kept in every checkpoint: the sha256 and fields of the config.json it
    writes (`config_text`), and the fingerprints of its data files."""
    data = {"train": data_fingerprint(cfg.data.train, "train")}
    data["eval"] = data_fingerprint(cfg.data.eval, "eval") if cfg.data.eval else None
    return {"config_sha256": _sha256_text(config_text), "config": json.loads(config_text), "data": data}


_RECORDS: dict[Path, dict] = {}  # the run record of each folder this process started (prepare_run_dir)


def started_record(out: Path) -> dict[str, Any] | None:
    """The run record prepare_run_dir made for out when this process started there (train.py saves it with
    every checkpoint); None if it did not."""
    return _RECORDS.get(Path(out).resolve())


def check_run_record(saved: Any, cfg: TrainConfig, where: Path) -> list[str]:
    """Refuse (ValueError, naming each field or file, with the fix) resuming checkpoint `where`, whose run
    record is `saved`, when config.json or the data on disk differ from what it was trained with; returns
    notes for what could not be checked.

    config.json is compared by its sha256 first; when that differs, field by field: a field in SAFE (or
    --steps, as on the command line) may differ, since changing it keeps the run exact; any other was edited
    by hand and is refused: the checkpoint would bring back its optimizer (its learning rate, ...) and its
    data position, so the run would not be what config.json says. A data file whose size or sha256 changed
    is refused; --data.eval only when it names the same file (a new --data.eval is a SAFE flag)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        return [f"{where} records no config or data fingerprints (an earlier nanogrpo saved it): not checked"]
    out = Path(cfg.out_dir)
    try:
        on_disk = hashlib.sha256((out / "config.json").read_bytes()).hexdigest()
    except OSError:
        on_disk = None
    if on_disk != saved.get("config_sha256"):
        hint = "it was saved by another nanogrpo: resume with that version"
        then = from_dict(TrainConfig, renamed_options(saved["config"], str(where)), f"{where}", hint=hint)
        if bad := unsafe_changes(then, cfg):
            raise ValueError(
                f"{out / 'config.json'} differs from the config {where.name} was trained with, in settings a "
                f"resume may not change: {'; '.join(bad)} (checkpoint -> config.json). The checkpoint brings "
                "back its optimizer and data position, so the run would not be what config.json says: put "
                f"these back in config.json, or start a new run from the edited file with --config "
                f"{out / 'config.json'} --out-dir NEW"
            )
    notes = []
    now = started_record(out) or run_record(cfg, json.dumps(asdict(cfg), indent=2))
    for key, fix in (
        ("train", ""),
        ("eval", "; to compare on the new rows, copy them to a new file and pass --data.eval NEW"),
    ):
        a, b = (saved.get("data") or {}).get(key), now["data"].get(key)
        if not (isinstance(a, dict) and isinstance(b, dict) and a.get("source") == b.get("source")):
            continue  # no record, or another --data.eval (SAFE): nothing to compare
        if "skipped" in b:
            notes.append(f"--data.{key} {b['source']} is {b['skipped']}")
        elif "sha256" in a and (a.get("size"), a["sha256"]) != (b["size"], b["sha256"]):
            what = (
                f"{a['size']} -> {b['size']} bytes" if a.get("size") != b["size"] else "same size, new sha256"
            )
            raise ValueError(
                f"--data.{key} {b['source']} changed since the run started ({what}): {where.name} was trained "
                "on its rows as they were, so the rest of the run would differ from a straight run. Put it "
                f"back as it was, or start a new run with another --out-dir{fix}"
            )
    return notes


def prepare_run_dir(cfg: TrainConfig, write: bool = True) -> None:
    """Check that cfg may run in cfg.out_dir, then (write=True, on the one rank that writes) take the
    folder's lock and save cfg as config.json.

    With --resume the folder's config.json must exist and cfg may differ from it only in SAFE ways, and the
    newest checkpoint's run record must agree with config.json and the data (check_run_record, before the
    model loads; train.py checks the checkpoint it resumes from again); the merged config then replaces
    config.json. Without --resume, a folder that holds a run's metrics or checkpoints is refused (its
    config.json alone, from a run that stopped before its first step, is overwritten). A symbolic link in
    the folder is refused either way."""
    out = Path(cfg.out_dir)
    text = json.dumps(asdict(cfg), indent=2)
    if cfg.resume:
        check_resume(load_config(out), cfg)
    if write:
        check_writable(out)
        refuse_links(out)
        lock_run_dir(out)  # before the checks below: another process may be starting in this folder now
    try:
        if not cfg.resume and ((out / "metrics.jsonl").exists() or (out / "ckpt").exists()):
            raise ValueError(
                f"{out} already holds a run (metrics.jsonl, ckpt/): pass --resume to continue it, "
                "or pick another --out-dir (or delete the folder) to start a new one"
            )
        _RECORDS[out.resolve()] = run_record(cfg, text)  # the data files are hashed once per start
        if cfg.resume and (newest := ckpt.newest_state(out / "ckpt")) is not None:
            check_run_record(newest[1].get("run"), cfg, newest[0])
    except ValueError:
        if write:
            release_run_dir(out)
        raise
    if write:
        # other ranks may be reading config.json: replace it whole
        replace_atomically(out / "config.json", text)
