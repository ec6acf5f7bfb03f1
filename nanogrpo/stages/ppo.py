"""PPO (--algo ppo): a value head, GAE over each completion's tokens, and the clipped surrogate with a
clipped value loss (Schulman et al. 2017), in the RLHF form of InstructGPT (Ouyang et al. 2022).

One step, on this rank's prompts:
  1. sample --ppo.samples-per-prompt completions of each prompt (classic PPO: 1) and score them
  2. one no-grad forward: log pi_old and V_old (the value head) at every completion token, and log pi_ref
     (the model with LoRA off, or the frozen copy) when --ppo.kl-coef > 0
  3. per-token rewards r_t = -kl_coef * (log pi_old - log pi_ref), the sequence's score added on its LAST
     token (InstructGPT): the reward is sparse, one number per completion
  4. GAE(gamma, lam) over each completion's tokens -> advantages and returns; advantages whitened over
     the step's tokens (all ranks)
  5. --ppo.epochs passes over the batch, each one optimizer step (micro-batched by --micro-batch): the
     clipped surrogate of grpo.grpo_loss + vf_coef * the clipped value loss

Where this departs from InstructGPT and from the PPO of Concept Overlap (section 3.5):
- The critic is a linear value head on the policy's own final hidden states, sharing the trunk and its
  LoRA adapters, not a separate value network initialised from a reward model. One forward gives the
  log-probs and the values; the value loss's gradient also reaches the adapters (vf_coef weighs it). The
  head starts at 0, so the first step's advantages are the (whitened) returns themselves.
- The reward is a grader (rewards/), not a learned reward model. A completion no grader scored (None) gets
  a sequence reward of 0 (PPO has no group to leave it out of, as GRPO does) and is counted in
  `reward_none`; the logged `reward` is the mean of the scored ones.
- The KL coefficient is fixed (no adaptive controller) and there is no pre-training loss mix (PPO-ptx).
- One optimizer step per epoch over the whole step's batch (TRL's num_mini_batches = 1). pi_old of the
  ratio is the first pass's own log-probs, as in GRPO's update (the same weights the samples came from);
  the sampler's log-probs come in as `sampler_logp` (--grpo.is-correction corrects the gap).
- The policy term is GRPO's (grpo.grpo_loss: --grpo.eps-low/-high, --grpo.loss-agg, --grpo.policy-loss,
  --grpo.dual-clip, --grpo.entropy-coef) on per-token advantages; the value term is a token mean. Both are
  normalised by the step's counts on all ranks, so any micro-batching gives the same gradient.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from nanogrpo import grpo
from nanogrpo.config import TrainConfig
from nanogrpo.infra import dist
from nanogrpo.model.logprobs import Batch, completion_logprobs
from nanogrpo.optim import in_slices, is_max_stat, micro_slices, step_counts, update
from nanogrpo.policy import Policy
from nanogrpo.rollout import rollout
from nanogrpo.stages import Run
from nanogrpo.summary import Totals, reduce_stats, reward_summary, sample_groups
from rewards import mean_metrics


def step(run: Run, step: int, rows: list[dict], first: int) -> dict:
    """One PPO step on this rank's prompts (`first`: the index of rows[0] in the step's global batch)."""
    cfg, policy, p = run.cfg, run.policy, run.cfg.ppo
    # 1. sample and score: samples_per_prompt completions per prompt, each its own episode
    roll = rollout(policy, rows, step, first, rollout_config(cfg), run.device)
    t1 = time.perf_counter()
    scores, parts = run.reward_fn(roll.samples)
    reward = torch.tensor([math.nan if x is None else float(x) for x in scores])  # (N,) NaN: no grader
    t_score = time.perf_counter() - t1
    run.reward_fn.empty_steps.update(dist.sum_floats({"n": float((~reward.isnan()).sum())})["n"])
    t2 = time.perf_counter()
    # 2. pi_old and V_old before any update; the reference for the KL reward
    batch, temp, mask = roll.batch, cfg.sampling.temperature, roll.batch.mask
    old_logp, old_values = old_logprobs_values(policy, batch, temp, cfg.micro_batch)  # (N, Tc), (N, Tc)
    ref_logp = None
    if p.kl_coef > 0:
        ref_logp = in_slices(lambda b: policy.reference_logprobs(b, temp), batch, cfg.micro_batch)  # (N, Tc)
    # 3-4. per-token rewards, GAE, whitening
    score = torch.nan_to_num(reward, nan=0.0).to(run.device)  # (N,) None scores 0
    tok_r = token_rewards(score, old_logp, ref_logp, mask, p.kl_coef)  # (N, Tc)
    adv, returns = gae(tok_r, old_values, mask, p.gamma, p.lam)  # (N, Tc), (N, Tc)
    adv = whiten(adv, mask)  # (N, Tc)
    # 5. epochs of clipped surrogate + clipped value loss
    upd = ppo_update(
        policy, run.opt, run.sched, batch, adv, returns, old_values, roll.sampler_logp, ref_logp, cfg
    )
    m = {"step": step + 1, **reward_summary(roll, reward, parts)}
    m.update(upd.metrics)
    m.update(value_summary(old_values, returns, mask))
    if ref_logp is not None:  # the mean per-completion sum of log pi_old - log pi_ref that the reward pays
        kl_seq = float((torch.where(mask > 0, old_logp - ref_logp, 0.0)).sum())
        m["kl_reward"] = dist.sum_floats({"k": kl_seq})["k"] / max(upd.seqs, 1.0)
    else:
        m["kl"] = None  # no reference, no KL: null in metrics.jsonl, not a measured 0
    m.update(t_sample=roll.seconds, t_score=t_score)
    m.update(mean_metrics(dist.sum_floats(run.reward_fn.metrics())))  # judge tokens, seconds, retries, ...
    m.update(grad_norm=upd.grad_norm, t_train=time.perf_counter() - t2)
    if dist.is_main() and cfg.log_samples_every and (step + 1) % cfg.log_samples_every == 0:
        n_tok = mask.sum(1).clamp(min=1)  # (N,)
        adv_seq = ((adv * mask).sum(1) / n_tok).cpu()  # (N,) a completion's mean token advantage
        run.logger.log_samples(step + 1, sample_groups(roll, reward, parts, adv_seq, run.reward_fn.details()))
    return m


def rollout_config(cfg: TrainConfig) -> TrainConfig:
    """The config rollout() samples with: --ppo.samples-per-prompt completions per prompt (rollout reads
    the count from grpo.group_size, which PPO does not otherwise use)."""
    return replace(cfg, grpo=replace(cfg.grpo, group_size=cfg.ppo.samples_per_prompt))


# ----------------------------------------------------------------------------- rewards, GAE, whitening


def token_rewards(
    score: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor | None, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """InstructGPT's per-token rewards (N, T): -kl_coef * (logp - ref_logp) at every completion token (the
    k1 KL, detached: its score-function gradient is the reverse KL's), plus the sequence's score (N,) on
    its last token. mask (N, T) is right-padded (1 on a completion's tokens, then 0); 0 on padding."""
    on = mask > 0
    r = torch.zeros_like(mask, dtype=torch.float32)  # (N, T)
    if ref_logp is not None and kl_coef:
        r = -kl_coef * torch.where(on, logp.detach().float() - ref_logp.float(), 0.0)  # (N, T)
    n = mask.sum(1).long()  # (N,) completion tokens
    last = (n - 1).clamp(min=0)  # (N,) the last token's index
    rows = torch.arange(len(r), device=r.device)
    r[rows, last] += torch.where(n > 0, score.float(), 0.0)  # a completion without tokens earns nothing
    return r


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's tokens (Schulman et al. 2016).

    rewards, values, mask: (N, T), mask right-padded (a row's tokens, then padding). values[t] is V(s_t),
    the state before token t; the state after the last token is terminal (V = 0), so padding never
    bootstraps:
        delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
        A_t     = delta_t + gamma * lam * A_{t+1}
    Returns (advantages, returns = A + V), both (N, T), 0 on padding. lam = gamma = 1: the returns are the
    reward-to-go sum_{s >= t} r_s, and A_t = return_t - V(s_t)."""
    m = mask.float()  # (N, T)
    r, v = rewards.float() * m, values.float() * m  # (N, T) padding holds nothing
    N, T = r.shape
    adv = torch.zeros_like(r)  # (N, T)
    next_adv = torch.zeros(N, dtype=r.dtype, device=r.device)  # (N,) A_{t+1}
    next_v = torch.zeros_like(next_adv)  # (N,) V(s_{t+1}), 0 past a row's end
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_v - v[:, t]  # (N,)
        next_adv = (delta + gamma * lam * next_adv) * m[:, t]  # (N,) reset to 0 on padding
        adv[:, t] = next_adv
        next_v = v[:, t]  # (N,) 0 on padding: the token after the end is terminal
    return adv, (adv + v) * m


def whiten(adv: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(adv - mean) / std over the step's completion tokens on all ranks (unbiased std); 0 on padding."""
    on = mask > 0
    x = adv[on].double()  # (n,)
    s = dist.sum_floats({"n": float(x.numel()), "s": float(x.sum()), "ss": float((x * x).sum())})
    if s["n"] < 2:
        return torch.where(on, adv, 0.0)
    mean = s["s"] / s["n"]
    var = max(s["ss"] - s["n"] * mean * mean, 0.0) / (s["n"] - 1)
    return torch.where(on, (adv - mean) / math.sqrt(var + eps), 0.0)  # (N, T)


# ----------------------------------------------------------------------------- the value loss


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    num_tokens: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO2's clipped value loss: 0.5 * max((V - R)^2, (V_clip - R)^2) per token, V_clip = V_old +
    clamp(V - V_old, -clip, clip) (clip 0: the plain squared error), summed with weight 1 / num_tokens
    (the step's tokens on all ranks: micro-batches and ranks add up to the token mean).

    values (N, T) differentiable; old_values, returns, mask (N, T). stats: this micro-batch's share of the
    loss ('vf_loss') and the tokens where the clipped branch is the larger ('vf_clipped')."""
    on = mask > 0
    err = (values - returns) ** 2  # (N, T)
    clipped = torch.zeros_like(on)
    if clip > 0:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)  # (N, T)
        err_clip = (v_clip - returns) ** 2  # (N, T)
        clipped = (err_clip > err) & on  # (N, T) the clip holds this token's value back
        err = torch.maximum(err, err_clip)
    loss = 0.5 * torch.where(on, err, 0.0).sum() / num_tokens
    return loss, {"vf_loss": loss.detach(), "vf_clipped": clipped.sum().float()}


# ----------------------------------------------------------------------------- the update


@dataclass
class PPOUpdate:
    """What one PPO update did; `metrics` are the step's, over all ranks."""

    seqs: float  # completions of the step, all ranks
    tokens: float  # completion tokens of the step, all ranks
    metrics: dict  # loss, pg_loss, vf_loss, clip_*, offpolicy/clip_*, vf_clip_frac, kl, entropy, ...
    vf_losses: list[float]  # the value loss of each epoch (all ranks): it falls as the head fits
    grad_norm: float  # before clipping, at the last optimizer step


@torch.no_grad()
def old_logprobs_values(
    policy: Policy, batch: Batch, temperature: float, micro: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi_old and V_old (N, Tc) on the trainer's path, no grad, dropout off, in micro-batches."""
    was_training = policy.model.training
    policy.model.eval()
    try:
        outs = [
            completion_logprobs(policy.model, batch.rows(sl), temperature, policy.autocast, values=True)
            for sl in micro_slices(len(batch), micro)
        ]
    finally:
        policy.model.train(was_training)
    return torch.cat([o[0] for o in outs]), torch.cat([o[2] for o in outs])


def ppo_update(
    policy: Policy,
    opt,
    sched,
    batch: Batch,
    adv: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    sampler_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    cfg: TrainConfig,
) -> PPOUpdate:
    """--ppo.epochs passes over the batch (optim.update: micro-batch by micro-batch, each pass ended by an
    optimizer step): grpo_loss's clipped surrogate on the per-token advantages (N, Tc) + vf_coef * value_loss.

    loss, pg_loss, vf_loss, kl, entropy, clip_low and clip_high describe the first (on-policy) pass, and
    offpolicy/clip_* and offpolicy/ratio_max the passes after it, as GRPO's do (grpo.later_pass_stats);
    vf_clip_frac is over all passes (the first pass's values are the old ones, so it never clips)."""
    g, p, temp = cfg.grpo, cfg.ppo, cfg.sampling.temperature
    counts = step_counts(batch)  # seqs, tokens of the step on all ranks
    n_tok = max(counts["tokens"], 1.0)
    old_logp = torch.zeros_like(sampler_logp)  # (N, Tc) the first pass's log-probs: pi_old of the ratio
    vf_pass = [0.0] * p.epochs  # each pass's value loss on this rank: it falls as the head fits

    def loss_fn(it: int, sl: slice, mb: Batch) -> tuple[torch.Tensor, dict]:
        logp, ent, v = completion_logprobs(
            policy.model, mb, temp, policy.autocast, entropy_grad=g.entropy_coef != 0, values=True
        )  # (n, Tc) x 3
        if it == 0:
            old_logp[sl] = logp.detach()
        pg, stats = grpo.grpo_loss(
            logp, old_logp[sl], None if ref_logp is None else ref_logp[sl], adv[sl], mb.mask, g,
            num_seqs=counts["seqs"], num_tokens=counts["tokens"], max_len=cfg.sampling.max_new_tokens,
            sampler_logp=sampler_logp[sl], entropy=ent,
        )  # fmt: skip
        vf, vf_stats = value_loss(v, old_values[sl], returns[sl], mb.mask, p.value_clip, n_tok)
        vf_pass[it] += float(vf_stats["vf_loss"])
        return pg + p.vf_coef * vf, {**stats, **vf_stats, "entropy": (ent.detach() * mb.mask).sum()}

    upd = update(
        policy, opt, sched, batch, counts, loss_fn,
        passes=p.epochs, micro=cfg.micro_batch, grad_clip=cfg.optim.grad_clip,
    )  # fmt: skip
    vf_losses = [dist.sum_floats({"v": v})["v"] for v in vf_pass]
    first, later = upd.stats, upd.later or {}
    vf_clip = first["vf_clipped"] + later.get("vf_clipped", 0.0)  # counts: exact in any order
    sums = Totals(
        {"loss": upd.loss, "vf_clip": vf_clip, **{k: v for k, v in first.items() if not is_max_stat(k)}},
        {k: v for k, v in first.items() if is_max_stat(k)},
    ).reduce()  # fmt: skip
    s, passes = sums.sums, n_tok * p.epochs
    fin = grpo.finalize_stats({**s, **sums.maxes})
    metrics = {
        "loss": s["loss"],
        "pg_loss": fin["pg_loss"],
        "vf_loss": s["vf_loss"],
        "clip_low": fin["clip_low"],
        "clip_high": fin["clip_high"],
        "vf_clip_frac": s["vf_clip"] / passes,
        "ratio_max": fin["ratio_max"],
        **grpo.later_pass_stats(reduce_stats(upd.later)),
        "kl": fin["kl"],  # k3 per token, pi_old against the reference (0 without one: replaced by None)
        "entropy": s["entropy"] / n_tok,
        "tokens": counts["tokens"],
    }
    for key in ("sampler_kl", "sampler_abs_diff", "entropy_bonus", "clip_dual"):
        if key in fin:
            metrics[key] = fin[key]
    return PPOUpdate(counts["seqs"], counts["tokens"], metrics, vf_losses, upd.grad_norm)


# ----------------------------------------------------------------------------- the step's numbers


def value_summary(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict:
    """value_mean, return_mean, and the explained variance 1 - Var[R - V] / Var[R] of the old values over
    the step's tokens (all ranks): 1 is a perfect critic, 0 one no better than the mean return, < 0 one
    that adds noise; None when the returns do not vary (e.g. every reward 0 and no KL yet)."""
    on = mask > 0
    v, r = values[on].double(), returns[on].double()  # (n,)
    d = r - v
    s = dist.sum_floats({
        "n": float(v.numel()), "v": float(v.sum()), "r": float(r.sum()), "rr": float((r * r).sum()),
        "d": float(d.sum()), "dd": float((d * d).sum()),
    })  # fmt: skip
    n = max(s["n"], 1.0)
    var_r = s["rr"] / n - (s["r"] / n) ** 2
    var_d = s["dd"] / n - (s["d"] / n) ** 2
    ev = 1.0 - var_d / var_r if var_r > 1e-12 else None
    return {"value_mean": s["v"] / n, "return_mean": s["r"] / n, "explained_variance": ev}
