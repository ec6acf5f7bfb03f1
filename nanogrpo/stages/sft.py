"""Supervised fine-tuning (--algo sft): the NLL of each row's target given its prompt.

The target is the row's `reference`, or --data.template rendered from its fields (data.sft_target), or a
transcript (the row's `completion`: assistant turns and the tool or user messages between them, the
conversational prompt-completion rows TRL's SFT reads), cut to --data.max-len tokens. The loss covers the
assistant's tokens only, averaged over the step's tokens on all ranks; a transcript's other messages sit
at mask 0, tokenized exactly as an episode appends an observation (envs/render.TurnFormat), so SFT on a
tool-use transcript trains the tokens a later GRPO episode samples. `sft_update` is the micro-batched NLL
step that CPT (cpt.py) shares.
"""

from __future__ import annotations

import functools
import time

import torch

from nanogrpo.config import TrainConfig
from nanogrpo.data import sft_target
from nanogrpo.envs.render import TurnFormat
from nanogrpo.infra import dist
from nanogrpo.model.logprobs import Batch, completion_logprobs
from nanogrpo.model.sampling import pad_left
from nanogrpo.optim import Update, step_counts, update
from nanogrpo.policy import Policy
from nanogrpo.rollout import make_batch
from nanogrpo.stages import Run


def step(run: Run, step: int, rows: list[dict], first: int) -> dict:
    """One SFT step: the NLL of each row's target given its prompt."""
    t1 = time.perf_counter()
    policy, tok, d = run.policy, run.policy.tokenizer, run.cfg.data
    eos, fmt = policy.eos_ids[:1], run.cfg.env.format
    comp = [target(r, tok, d.template, eos, fmt, d.system_prompt) for r in rows]  # (ids, mask) a row
    cut = sum(d.max_len > 0 and len(c) > d.max_len for c, _ in comp)  # --data.max-len: targets cut to it
    comp = [(c[: d.max_len], m[: d.max_len]) if d.max_len else (c, m) for c, m in comp]
    p_ids, p_mask = pad_left([r["_prompt_ids"] for r in rows], policy.pad_id)
    ids, pad = pad_right([c for c, _ in comp], policy.pad_id)  # (N, Tc)
    trained = pad_right([m for _, m in comp], 0)[0].float()  # (N, Tc) 1 on the assistant's tokens
    batch = make_batch(p_ids, p_mask, ids, pad * trained).to(run.device)
    upd = sft_update(policy, run.opt, run.sched, batch, run.cfg)
    m = {"step": step + 1, "loss": dist.sum_floats({"l": upd.loss})["l"], "t_sample": 0.0, "t_score": 0.0}
    m.update(tokens=upd.tokens, len_mean=upd.tokens / run.cfg.prompts_per_step)
    m["truncated"] = dist.sum_floats({"cut": float(cut)})["cut"] / run.cfg.prompts_per_step
    m.update(grad_norm=upd.grad_norm, t_train=time.perf_counter() - t1)
    return m


@functools.cache
def turn_format(tokenizer, role: str, fmt: str, system_prompt: str) -> TurnFormat:
    """The TurnFormat of a transcript's message role (checked as an episode's), made once a run."""
    return TurnFormat.of(tokenizer, role, fmt, system_prompt)


def target(
    row: dict, tok, template: str, eos: list[int], fmt: str = "auto", system_prompt: str = ""
) -> tuple[list[int], list[int]]:
    """The ids SFT trains on after a row's prompt, and their mask (1: trained). A template or a reference:
    its ids then EOS, all trained. A transcript: each assistant turn's ids trained, each message between
    them as an episode appends it (the turn's closing, the message, the next assistant header) at 0, and
    EOS after the last turn."""
    if template or not isinstance(row.get("completion"), list):
        ids = tok(sft_target(row, template), add_special_tokens=False)["input_ids"] + eos
        return ids, [1] * len(ids)
    ids: list[int] = []
    mask: list[int] = []
    last = len(row["completion"]) - 1
    for k, m in enumerate(row["completion"]):
        if m["role"] == "assistant":
            new = tok(m["content"], add_special_tokens=False)["input_ids"] + (eos if k == last else [])
        else:  # an observation: after a turn that ended on its stop string, not on EOS
            turns = turn_format(tok, m["role"], fmt, system_prompt)
            new = turns.observation_ids(tok, m["content"], ended_on_eos=False)
        ids += new
        mask += [int(m["role"] == "assistant")] * len(new)
    return ids, mask


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
