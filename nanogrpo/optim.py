"""Optimizers and the learning-rate schedule.

AdamW by default. `muon` (seed 000's ablation) uses torch.optim.Muon as its authors do: for the 2-D weight
matrices of the hidden layers (LoRA A and B included), with AdamW for the embeddings, the LM head, norms and
biases, stepped together as one optimizer object. Muon's update is scaled to AdamW's RMS (Moonlight's
learning-rate matching, `adjust_lr_fn="match_rms_adamw"`), so `--optim.name muon` keeps AdamW's
learning rate.
"""

from __future__ import annotations

import math

import torch

from nanogrpo.config import OptimConfig


class Combined(torch.optim.Optimizer):
    """Several optimizers stepped as one (for Muon + AdamW); state_dict round-trips for resume."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]  # the LR scheduler edits these
        self.defaults = {}
        self.state = {}

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state):
        for o, s in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(s)


def muon_groups(named: list[tuple[str, torch.nn.Parameter]]) -> tuple[list, list]:
    """(Muon's, AdamW's) parameters: the hidden layers' 2-D matrices go to Muon; embeddings and the LM head
    (2-D, but a lookup table and a classifier rather than a linear map between hidden states), norms and
    biases to AdamW. A tied LM head is the embedding table, named once."""
    table = ("embed_tokens", "lm_head")
    mats = [p for n, p in named if p.ndim == 2 and not any(t in n for t in table)]
    mat_ids = {id(p) for p in mats}
    return mats, [p for _, p in named if id(p) not in mat_ids]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer of `model`'s trainable parameters (the adapters under LoRA, every weight otherwise)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("no trainable parameters: set --lora.r > 0 or train the full model with --lora.r 0")
    adamw = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=1e-8)
    if cfg.name == "adamw":
        return torch.optim.AdamW([p for _, p in named], **adamw)
    if cfg.name == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise ValueError(
                "--optim.name muon needs torch >= 2.9 (torch.optim.Muon); use --optim.name adamw"
            )
        mats, rest = muon_groups(named)
        opts: list[torch.optim.Optimizer] = []
        if mats:
            opts.append(
                torch.optim.Muon(
                    mats, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw"
                )
            )
        if rest:
            opts.append(torch.optim.AdamW(rest, **adamw))
        return Combined(opts)
    raise ValueError(f"unknown optimizer {cfg.name!r}; use 'adamw' or 'muon'")


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """Multiplier of the peak LR at a step: linear warmup, then constant or cosine to lr_min_ratio."""

    def f(step: int) -> float:
        if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        span = max(1, total_steps - cfg.warmup_steps)
        t = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total_steps))
