"""The local judge's model, from nanogrpo: rewards/ imports nothing of nanogrpo, so whoever builds
rewards here calls `register()` first (eval.py through nanogrpo.eval.evaluate, train.py before build_reward).

Local judges (`--reward.judge.backend local`, `eval.py elo --judge local:PATH`) then load their model
with nanogrpo.model.transformer, decode with nanogrpo.model.fast.sampler.generate, and accept nanogrpo.model.zoo's names
('tiny', 'smollm2', 'random:SHAPE') besides folders; so do the rubric probes' frozen LMs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rewards.local_client import LocalBackend, set_backend


def resolve(name: str) -> Path:
    from nanogrpo.model.zoo import resolve_model

    return resolve_model(name)


def load(path: Path, dtype: Any, device: str) -> Any:
    from nanogrpo.model.transformer import Transformer

    return Transformer.from_pretrained(path, dtype=dtype, device=device)


def generate(*args: Any, **kwargs: Any) -> Any:
    from nanogrpo.model.fast.sampler import generate

    return generate(*args, **kwargs)


BACKEND = LocalBackend(resolve=resolve, load=load, generate=generate)


def register() -> None:
    """Make nanogrpo the local judges' backend (idempotent)."""
    set_backend(BACKEND)
