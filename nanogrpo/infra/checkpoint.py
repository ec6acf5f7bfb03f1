"""Atomic checkpoints, exact resume, and a trainer state that loads without pickle.

A checkpoint is a folder `ckpt/step_000012/` holding the trainable weights (a PEFT-layout adapter with
LoRA, else the full state dict), `trainer_state.pt` (the optimizer and scheduler, every RNG state, the data
position, the size of every other file in the folder, and what train.py adds: the run's record of its config
and data, nanogrpo/infra/run_dir.py, and the step's metrics.jsonl line), and `manifest.json`: the size and sha256 of
every other file, the trainer state included (it cannot hold its own hash). It is written into a temporary
folder, fsynced, and renamed into place; `ckpt/latest` names the newest one only after the rename. A crash
mid-write leaves the previous checkpoint intact, and a folder damaged anyway (a disk that lost writes, a
flipped byte that keeps the size) is recognised on resume and skipped for the one before it, by name
(`find_resume_point`).

The trainer state is loaded with `torch.load(weights_only=True)`: tensors, numbers, strings and plain
containers only, so resuming a folder someone else wrote cannot run code. RNG states are stored in that
vocabulary (Python's Mersenne state as a list of ints, numpy's as a tensor). A file that needs full
unpickling (one written by an older nanogrpo, or by anything else) is refused, not loaded.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from nanogrpo.infra.metrics import fsync_path, open_run_file, replace_atomically, sha256_file
from nanogrpo_base.files import save_tensors

FORMAT = "nanogrpo.trainer_state/2"  # 1 (unversioned) was a pickle of Python and numpy objects
STATE = "trainer_state.pt"
MANIFEST = "manifest.json"  # {"files": {name: {"size", "sha256"}}}; absent in checkpoints of earlier nanogrpo


def rng_state() -> dict[str, Any]:
    """Every RNG state, as tensors and plain values (weights_only-loadable)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "mt": list(mt), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["mt"]), py["gauss"]))
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    save_weights: Callable[[Path], None],
    optimizer_state: dict,
    scheduler,
    extra: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint `step` atomically; `save_weights(folder)` writes the model part.

    optimizer_state: `optimizer.state_dict()`, or with FSDP the full state gathered to rank 0."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}"
    for p in (tmp, final):
        if p.is_symlink():  # our names: a link there is removed, never written through (rmtree refuses it)
            p.unlink()
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()  # a new folder: every file in it is written by this save
    save_weights(tmp)
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    state = {
        "format": FORMAT,
        "step": step,
        "files": files,  # what a complete folder holds: a damaged one is told apart on resume
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng_state(),
        **extra,
    }
    torch.save(state, tmp / STATE)
    # the content of every file, the trainer state included: a same-size corruption is caught on resume
    manifest = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(tmp.iterdir())
        if p.is_file()
    }
    with open_run_file(tmp / MANIFEST, "x") as f:
        f.write(json.dumps({"files": manifest}, indent=2))
    for p in tmp.iterdir():
        fsync_path(p)
    fsync_path(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    replace_atomically(ckpt_root / "latest", final.name)  # the pointer moves only once the folder is complete
    old = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for p in old[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The folder `ckpt/latest` names, if it exists (find_resume_point checks that it is complete)."""
    pointer = ckpt_root / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = ckpt_root / name
    return path if name.startswith("step_") and path.is_dir() else None


def load_trainer_state(path: Path, mmap: bool = False) -> dict[str, Any]:
    """The trainer state of checkpoint folder `path`, loaded without unpickling code.

    mmap: map the tensors instead of reading them (to look at the small entries of a large state only).
    ValueError (with the fix) for a file that would need pickle; the error of torch.load for a damaged one."""
    file = path / STATE
    try:
        # onto the host: a state saved from cuda:0 would otherwise load onto cuda:0 on every rank; the
        # optimizer's load_state_dict moves its tensors to their parameters' device
        state = torch.load(file, weights_only=True, map_location="cpu", mmap=mmap)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{file} would need pickle to load (it is a trainer state written by an older nanogrpo, or not by "
            f"nanogrpo at all), and unpickling a file can run any code, so nanogrpo does not load it. "
            f"Resume it with the nanogrpo that wrote it, or start a new run (--lora.init-from {path} starts "
            f"from its adapter). ({str(e).splitlines()[0]})"
        ) from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(
            f"{file} is not a nanogrpo trainer state of this version ({FORMAT}): it was written by an older "
            "nanogrpo; resume it with that version, or start a new run"
        )
    return state


def _damage(path: Path, state: dict) -> str | None:
    """Why a checkpoint folder whose trainer state loaded is not complete, or None: a file missing, or
    of another size or (manifest.json) another content than at the save."""
    if state.get("step") != int(path.name.removeprefix("step_")):
        return f"its trainer state is for step {state.get('step')}"
    files = {name: {"size": size} for name, size in state["files"].items()}
    if (path / MANIFEST).is_file():
        try:
            files.update(json.loads((path / MANIFEST).read_text())["files"])
        except (ValueError, KeyError, TypeError) as e:
            return f"{MANIFEST} is unreadable ({e})"
    for name, rec in files.items():  # the sizes first: cheap, and most damage changes them
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != rec["size"]:
            return f"{name} has {f.stat().st_size} bytes, not {rec['size']}"
    for name, rec in files.items():
        if "sha256" in rec and sha256_file(path / name) != rec["sha256"]:
            return f"{name} does not match its sha256 in {MANIFEST} (its content changed on disk)"
    return None


@dataclass
class ResumePoint:
    """Where --resume continues: the newest complete checkpoint, and what was passed over to find it."""

    path: Path | None  # None: no checkpoint was ever completed, start from step 0
    state: dict[str, Any] | None
    notes: list[str]  # one line per checkpoint folder passed over (with the reason), or a stale pointer


def find_resume_point(ckpt_root: Path) -> ResumePoint:
    """The newest complete checkpoint under ckpt_root, whatever `latest` says.

    A folder without a trainer state (its save never finished) is passed over; so is one whose trainer
    state is unreadable or whose files are not the sizes and content (sha256) it recorded (damaged on disk);
    a folder saved before manifest.json existed has its sizes checked only, with a note. If only folders of
    the first kind exist, nothing was ever saved: start from step 0. If a saved checkpoint exists but none
    is readable, ValueError: starting again would throw those steps away, so the user decides. A trainer
    state that would need pickle is refused outright (ValueError from load_trainer_state)."""
    folders = sorted((p for p in ckpt_root.glob("step_*") if p.is_dir()), reverse=True)
    notes: list[str] = []
    latest = ckpt_root / "latest"
    if latest.is_file() and latest_checkpoint(ckpt_root) is None:
        notes.append(f"{latest} names {latest.read_text().strip()!r}, which does not exist")
    damaged = False
    for path in folders:
        if not (path / STATE).is_file():
            notes.append(f"{path} skipped: it has no {STATE} (its save did not finish)")
            continue
        try:
            state = load_trainer_state(path)
        except ValueError:
            raise
        except Exception as e:  # a truncated or garbled file: torch raises RuntimeError, EOFError, ...
            damaged = True
            notes.append(f"{path} skipped: {STATE} is unreadable ({str(e).splitlines()[0][:120]})")
            continue
        if (why := _damage(path, state)) is not None:
            damaged = True
            notes.append(f"{path} skipped: {why}")
            continue
        if not (path / MANIFEST).is_file():
            notes.append(
                f"{path} has no {MANIFEST} (an earlier nanogrpo saved it): its sizes are checked, not its content"
            )
        if (named := latest_checkpoint(ckpt_root)) is not None and named.name < path.name:
            notes.append(
                f"{latest} names {named.name}, but {path.name} is newer and complete (a crash came "
                "between the folder's rename and the pointer's)"
            )
        return ResumePoint(path, state, notes)
    if damaged:
        raise ValueError(
            f"--resume: no complete checkpoint in {ckpt_root}: {'; '.join(notes)}. Delete {ckpt_root} to "
            "start the run again from step 0 (its logs are then cut back to it), or start a new --out-dir"
        )
    return ResumePoint(None, None, notes)


def newest_state(ckpt_root: Path) -> tuple[Path, dict[str, Any]] | None:
    """(folder, trainer state, tensors mapped not read) of the newest checkpoint whose trainer state loads,
    unverified: a cheap first look (resume.py checks the config and data it records before the model
    loads); find_resume_point chooses, and verifies, the one the run resumes from."""
    for path in sorted((p for p in ckpt_root.glob("step_*") if p.is_dir()), reverse=True):
        try:
            return path, load_trainer_state(path, mmap=True)
        except Exception:  # unreadable or refused: find_resume_point names it
            continue
    return None


def save_full_weights(model: torch.nn.Module, folder: Path) -> None:
    """Trainable tensors of a full fine-tune (the frozen ones can be reloaded from the base model)."""
    write_full_weights({n: p for n, p in model.named_parameters() if p.requires_grad}, folder)


def write_full_weights(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """model.safetensors under HF names (a tied LM head appears once, as the embedding)."""
    tensors = {n: t.detach().contiguous().cpu() for n, t in tensors.items()}
    save_tensors(tensors, folder / "model.safetensors", metadata={"format": "pt"})  # the umask's mode


def load_full_weights(model: torch.nn.Module, folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in tensors.items():
            params[n].copy_(t)
