"""Atomic checkpoints and exact resume.

A checkpoint is a folder `ckpt/step_000012/` holding the trainable weights (a PEFT-layout adapter with
LoRA, else the full state dict), the optimizer and scheduler, every RNG state and the data position.
It is written into a temporary folder and renamed into place, and `ckpt/latest` names the newest one
only after the rename, so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_weights(tmp)
    torch.save(
        {
            "step": step,
            "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_state(),
            **extra,
        },
        tmp / "trainer_state.pt",
    )
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = ckpt_root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, ckpt_root / "latest")  # the pointer moves only once the folder is complete
    old = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for p in old[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    pointer = ckpt_root / "latest"
    if not pointer.exists():
        return None
    path = ckpt_root / pointer.read_text().strip()
    return path if path.exists() else None


def load_trainer_state(path: Path) -> dict[str, Any]:
    # our own file: optimizer state and RNG tuples need full unpickling
    return torch.load(path / "trainer_state.pt", weights_only=False)


def save_full_weights(model: torch.nn.Module, folder: Path) -> None:
    """Trainable tensors of a full fine-tune (the frozen ones can be reloaded from the base model)."""
    write_full_weights({n: p for n, p in model.named_parameters() if p.requires_grad}, folder)


def write_full_weights(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """model.safetensors under HF names (a tied LM head appears once, as the embedding)."""
    tensors = {n: t.detach().contiguous().cpu() for n, t in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def load_full_weights(model: torch.nn.Module, folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in tensors.items():
            params[n].copy_(t)
