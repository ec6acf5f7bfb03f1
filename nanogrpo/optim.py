"""Optimizers, the learning-rate schedule, and the update every stage's step runs.

    upd = update(policy, opt, sched, batch, counts, loss_fn, passes=..., micro=..., grad_clip=...)

`update` is the part of a step that does not depend on the loss: passes over the batch, micro-batch by
micro-batch (DDP all-reduces once a pass), backward, clip, optimizer and scheduler step, the first pass's
stats apart from the later ones. GRPO (train.py), PPO, SFT, CPT and DPO (nanogrpo/stages/) each hand it the
loss of one micro-batch.

AdamW by default. `muon` (Shaping Explanations' ablation) uses torch.optim.Muon as its authors do: for the 2-D weight
matrices of the hidden layers (LoRA A and B included), with AdamW for the embeddings, the LM head, norms and
biases, stepped together as one optimizer object. Muon's update is scaled to AdamW's RMS (Moonlight's
learning-rate matching, `adjust_lr_fn="match_rms_adamw"`), so `--optim.name muon` keeps AdamW's
learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanogrpo.config import OptimConfig
from nanogrpo.infra import dist
from nanogrpo.model.logprobs import Batch

if TYPE_CHECKING:  # for the hint only: the update calls the policy, it needs none of its module
    from nanogrpo.policy import Policy


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
        return build_muon(named, cfg, adamw)
    raise ValueError(f"unknown optimizer {cfg.name!r}; use 'adamw' or 'muon'")


def build_muon(named: list[tuple[str, torch.nn.Parameter]], cfg: OptimConfig, adamw: dict) -> Combined:
    """--optim.name muon: Muon for the hidden layers' matrices, AdamW (`adamw`: its settings) for the rest."""
    if not hasattr(torch.optim, "Muon"):
        raise ValueError("--optim.name muon needs torch >= 2.9 (torch.optim.Muon); use --optim.name adamw")
    mats, rest = muon_groups(named)
    opts: list[torch.optim.Optimizer] = []
    if mats:
        opts.append(
            torch.optim.Muon(mats, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
        )
    if rest:
        opts.append(torch.optim.AdamW(rest, **adamw))
    return Combined(opts)


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


def optimizer_and_schedule(model: torch.nn.Module, cfg: OptimConfig, total_steps: int):
    """(the optimizer, its LR schedule over `total_steps` optimizer steps) of a run."""
    opt = build_optimizer(model, cfg)
    return opt, build_scheduler(opt, cfg, total_steps)


# ----------------------------------------------------------------------------- the update skeleton


@dataclass
class Update:
    """What an update did on this rank."""

    seqs: float  # rows of the step, summed over ranks
    tokens: float  # completion tokens of the step, summed over ranks
    stats: dict[str, float]  # loss_fn's stats of the first pass, summed over micro-batches (*_max maxed);
    # 'entropy': the sum of its token entropies on this rank (GRPO's and PPO's)
    later: dict[str, float] | None  # the same over the passes after it (None with one pass): off-policy
    loss: float  # this rank's share of the first pass's loss
    grad_norm: float  # before clipping, at the last optimizer step


def step_counts(batch: Batch) -> dict[str, float]:
    """{'seqs', 'tokens'}: the step's rows and completion tokens on all ranks, what a loss is normalised by
    so that its micro-batches and ranks add up to the whole batch's."""
    return dist.sum_floats({"seqs": float(len(batch)), "tokens": float(batch.mask.sum())})


def micro_slices(n: int, micro: int) -> list[slice]:
    """Row slices of at most `micro` rows (0 = one slice with everything)."""
    micro = n if micro <= 0 else micro
    return [slice(i, min(i + micro, n)) for i in range(0, n, micro)]


def update(
    policy: Policy,
    opt,
    sched,
    batch: Batch,
    counts: dict[str, float],
    loss_fn: Callable[[int, slice, Batch], tuple[torch.Tensor, dict]],
    *,
    passes: int,
    micro: int,
    grad_clip: float,
) -> Update:
    """`passes` optimizer steps over the batch (GRPO's --grpo.num-iterations, PPO's --ppo.epochs; 1 for SFT,
    CPT and DPO), each on the gradient summed over the batch's micro-batches of `micro` rows (0: all at once).

    loss_fn(it, sl, mb) -> (loss, stats): the loss of micro-batch mb = batch.rows(sl) in pass `it`, normalised
    by the step's `counts` on all ranks, so the micro-batches add up to the batch's loss with no scaling
    here; stats: detached sums over mb (*_max ones: maxes), added up over micro-batches, the first pass apart
    from the later, off-policy ones."""
    slices = micro_slices(len(batch), micro)
    policy.model.train()
    first: dict[str, float] | None = None
    later: dict[str, float] | None = None  # passes >= 2: where clip-higher, dual-clip and CISPO act
    loss_sum = grad_norm = 0.0
    for it in range(passes):
        for k, sl in enumerate(slices):
            with policy.no_sync(last=k == len(slices) - 1):  # DDP: one all-reduce per pass
                loss, stats = loss_fn(it, sl, batch.rows(sl))
                policy.backward(loss)  # x world: the gradient is the sum over ranks, DDP and FSDP average
            if it == 0:  # the metrics describe the on-policy pass; the later passes' apart
                first = accumulate_stats(first, stats)
                loss_sum += float(loss.detach())
            else:
                later = accumulate_stats(later, stats)
        grad_norm = policy.step(opt, sched, grad_clip)
    assert first is not None
    return Update(counts["seqs"], counts["tokens"], first, later, loss_sum, grad_norm)


def is_max_stat(key: str) -> bool:
    """Stats combined by max over micro-batches and ranks (the rest are sums)."""
    return key.endswith("_max")


def accumulate_stats(totals: dict[str, float] | None, stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Add one micro-batch's stats to the running totals (the *_max ones by max)."""
    if totals is None:
        return {k: float(v) for k, v in stats.items()}
    return {k: max(totals[k], float(v)) if is_max_stat(k) else totals[k] + float(v) for k, v in stats.items()}


def in_slices(fn: Callable[[Batch], torch.Tensor], batch: Batch, micro: int) -> torch.Tensor:
    """fn over the batch's rows in micro-batches of `micro` (0 = all at once), concatenated: (N, Tc). For the
    no-grad forwards before an update (the reference, pi_old), in the slices the update runs."""
    return torch.cat([fn(batch.rows(sl)) for sl in micro_slices(len(batch), micro)])
