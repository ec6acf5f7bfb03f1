"""Supervised fine-tuning (--algo sft): the NLL of each row's target given its prompt.

The target is the row's `reference`, or --data.template rendered from its fields (data.sft_target),
cut to --data.max-len tokens; the loss covers the target tokens only, averaged over the step's tokens on
all ranks. `sft_update` is the micro-batched NLL step that CPT (cpt.py) shares.
"""

from __future__ import annotations

import time

import torch

from nanogrpo.config import TrainConfig
from nanogrpo.data import sft_target
from nanogrpo.infra import dist
from nanogrpo.model.logprobs import Batch, completion_logprobs, make_batch, pad_left
from nanogrpo.optim import Update, step_counts, update
from nanogrpo.policy import Policy
from nanogrpo.stages import Run


def step(run: Run, step: int, rows: list[dict], first: int) -> dict:
    """One SFT step: the NLL of each row's target given its prompt."""
    t1 = time.perf_counter()
    policy, tok, d = run.policy, run.policy.tokenizer, run.cfg.data
    comp = [
        tok(sft_target(r, d.template), add_special_tokens=False)["input_ids"] + policy.eos_ids[:1]
        for r in rows
    ]
    cut = sum(d.max_len > 0 and len(c) > d.max_len for c in comp)  # --data.max-len: targets cut to it
    comp = [c[: d.max_len] if d.max_len else c for c in comp]
    p_ids, p_mask = pad_left([r["_prompt_ids"] for r in rows], policy.pad_id)
    batch = make_batch(p_ids, p_mask, *pad_right(comp, policy.pad_id)).to(run.device)
    upd = sft_update(policy, run.opt, run.sched, batch, run.cfg)
    m = {"step": step + 1, "loss": dist.sum_floats({"l": upd.loss})["l"], "t_sample": 0.0, "t_score": 0.0}
    m.update(tokens=upd.tokens, len_mean=upd.tokens / run.cfg.prompts_per_step)
    m["truncated"] = dist.sum_floats({"cut": float(cut)})["cut"] / run.cfg.prompts_per_step
    m.update(grad_norm=upd.grad_norm, t_train=time.perf_counter() - t1)
    return m


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists into completion ids (N, Tc) and their float mask (N, Tc) (1 real, 0 pad)."""
    Tc = max(len(c) for c in seqs)
    ids = torch.tensor([c + [pad_id] * (Tc - len(c)) for c in seqs])  # (N, Tc)
    mask = torch.tensor([[1.0] * len(c) + [0.0] * (Tc - len(c)) for c in seqs])  # (N, Tc)
    return ids, mask


def sft_update(policy: Policy, opt, sched, batch: Batch, cfg: TrainConfig) -> Update:
    """The NLL of the completion tokens given the prompt, per token of the step (all ranks): one pass of
    optim.update, micro-batch by micro-batch, then the optimizer step."""
    counts = step_counts(batch)  # the loss is per token of the step, on all ranks

    def nll(it: int, sl: slice, mb: Batch) -> tuple[torch.Tensor, dict]:
        logp, _ = completion_logprobs(policy.model, mb, 1.0, policy.autocast)  # (n, Tc)
        return -(logp * mb.mask).sum() / counts["tokens"], {}

    return update(
        policy, opt, sched, batch, counts, nll, passes=1, micro=cfg.micro_batch, grad_clip=cfg.optim.grad_clip
    )
