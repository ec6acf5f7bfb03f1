"""GRPO as pure tensor functions: group advantages, the policy loss and its variants, the KL to the reference,
the entropy terms.

No model code lives here: the trainer hands in per-token log-probs and gets back a scalar loss.

    adv, zero_std = compute_advantages(rewards, cfg)                      # (B*G,), (B,)
    loss, stats = grpo_loss(logp, old_logp, ref_logp, adv, mask, cfg,
                            num_seqs=..., num_tokens=..., max_len=...)    # per micro-batch; sum = full batch
    rewards = rewards - beta * kl_penalty(old_logp, ref_logp, mask, cfg)  # KL placement 'reward': (N,)
    terms = kl_loss_terms(logp, old_logp, ref_logp, mask, cfg)            # KL placement 'loss': (N, T)

Where this departs from the GRPO paper (Shao et al. 2024) and why:
- The group std is the unbiased one (Bessel, as torch.std and TRL); a group whose rewards are all equal gets
  exactly 0 advantage and is flagged, instead of 0 / eps. A missing reward (NaN: no grader applied) is left
  out of its group's statistics instead of counting as 0. scale_rewards picks the std: the group's (the
  paper), the whole batch's (TRL's 'batch') or none (Dr. GRPO).
- pi_old is the trainer's own log-probs; the sampler's are another distribution mu (other kernels, bf16
  folding of LoRA), measured every step and, with is_correction, corrected by truncated or masked
  importance weights pi_old / mu (importance_weights).
- The loss is normalised by GLOBAL counts of the whole optimizer step (num_seqs, num_tokens, max_len) passed
  in by the caller, so summing grpo_loss over micro-batches or ranks gives exactly the full-batch loss and
  gradient. The paper's per-sequence 1/|o_i| is 'seq-mean-token-mean'; 'token-mean' is DAPO's;
  'seq-mean-token-sum-norm' (divide by max_len) is Dr. GRPO's.
- KL: the k1/k2/k3 estimators act on l = logp - ref_logp, in the reward (detached, summed over the sequence:
  the correct reverse-KL gradient) or in the loss, weighted like the policy terms. The paper's choice (k3 per
  token in the loss) has the expected gradient of the FORWARD KL(ref || pi) with contexts sampled from pi
  (docs/KL.md, checked exactly by nanogrpo.lab.klcheck). `kl_reward_to_go` makes the in-loss term sequence
  level; `kl_is_weight` multiplies it by the live ratio pi/pi_old (DeepSeek-V3.2), which turns k1/k3 into
  unbiased reverse-KL gradients.
- GSPO (ratio_level='sequence'): the ratio is exp(mean_t log(pi/pi_old)) of the whole sequence, broadcast to
  its tokens, so every token of a sequence is clipped together.
- Policy-loss variants (docs/STABILITY.md): CISPO (MiniMax-M1) clips a detached IS weight instead of the
  surrogate; dual-clip (Ye et al. 2020) bounds the loss of negative-advantage tokens; an entropy bonus; and
  the policy gradient on the step's high-entropy tokens only (Wang et al. 2025).
"""

from __future__ import annotations

import math

import torch

from nanogrpo.config import GRPOConfig, check_group_size

# ----------------------------------------------------------------------------- advantages


def compute_advantages(
    rewards: torch.Tensor, cfg: GRPOConfig, batch_moments: dict[str, float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-completion advantages from rewards laid out as B groups of G consecutive rows.

    A NaN reward (no grader applied: a None score) is not a reward: mean, std, the leave-one-out baseline
    and the zero-spread flag use the group's valid rows only, and the row itself gets advantage 0. Turning
    it into 0 instead would shift the group's mean and make every other advantage of the group one-sided.

    'grpo': r - mean(valid); 'rloo': r - mean of the other valid rewards (unbiased baseline). Then, by
    scale_rewards, divided by (std + adv_eps) with std the group's ('group'), the batch's ('batch'), or
    not at all ('none'); std: unbiased, as torch.std. The batch std is that of the valid rewards themselves
    (as TRL's), from `batch_moments` (reward_moments of the whole step, summed over ranks) or, without them,
    from these rewards.
    Returns (adv (B*G,), zero_std (B,) bool): groups with fewer than 2 valid rows or no spread among them get
    exactly 0 and are flagged.
    """
    G = cfg.group_size
    check_group_size(G)
    if rewards.dim() != 1 or rewards.numel() % G:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={G} entries, got {tuple(rewards.shape)}"
        )
    if cfg.adv_estimator not in ("grpo", "rloo"):
        raise ValueError(f"unknown adv_estimator {cfg.adv_estimator!r}: use 'grpo' or 'rloo'")
    if cfg.scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"unknown scale_rewards {cfg.scale_rewards!r}: use 'group', 'batch' or 'none'")
    r = rewards.view(-1, G)  # (B, G)
    ok = ~r.isnan()  # (B, G) rows that have a reward
    n = ok.sum(1, keepdim=True)  # (B, 1) valid rows per group
    r0 = torch.where(ok, r, 0.0)  # (B, G)
    mean = r0.sum(1, keepdim=True) / n.clamp(min=1)  # (B, 1)
    # exact equality among the valid rows: a tolerance would silently drop tiny KL spreads
    hi = torch.where(ok, r, -torch.inf).amax(1)  # (B,)
    lo = torch.where(ok, r, torch.inf).amin(1)  # (B,)
    zero_std = (n.squeeze(1) < 2) | (hi == lo)  # (B,)
    adv = r0 - mean  # (B, G)
    if cfg.adv_estimator == "rloo":
        adv = adv * (n / (n - 1).clamp(min=1))  # == r_i - mean_{j != i, valid} r_j
    if cfg.scale_rewards == "group":
        var = (torch.where(ok, r0 - mean, 0.0) ** 2).sum(1, keepdim=True) / (n - 1).clamp(min=1)  # (B, 1)
        adv = adv / (var.sqrt() + cfg.adv_eps)  # (B, G)
    elif cfg.scale_rewards == "batch":
        moments = reward_moments(rewards) if batch_moments is None else batch_moments
        adv = adv / (batch_std(moments) + cfg.adv_eps)  # (B, G)
    adv = torch.where(zero_std[:, None] | ~ok, 0.0, adv)  # exactly 0, not rounding noise
    return adv.reshape(-1), zero_std


def reward_moments(rewards: torch.Tensor) -> dict[str, float]:
    """Count, sum and sum of squares of the valid (non-NaN) rewards, in float64: a rank's share of the
    batch std (the trainer adds them up over ranks with dist.sum_floats, then batch_std)."""
    r = rewards[~rewards.isnan()].double()  # (n,)
    return {"n": float(r.numel()), "sum": float(r.sum()), "sumsq": float((r * r).sum())}


def batch_std(moments: dict[str, float]) -> float:
    """The unbiased std of the rewards whose reward_moments these are (0 for fewer than 2 rewards)."""
    n, s, ss = moments["n"], moments["sum"], moments["sumsq"]
    if n < 2:
        return 0.0
    return math.sqrt(max(ss - s * s / n, 0.0) / (n - 1))  # float64: rewards are O(1), cancellation is small


# ----------------------------------------------------------------------------- the sampler-trainer gap


def sampler_gap(
    old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """log w = log pi_old - log mu per token (N, T), 0 on padding: the gap between the trainer's pi_old and the
    sampler's distribution mu (its own kernels, shapes and bf16 folding of W + BA), measured every step.

    Also returns SUMS over the tokens for the log: |log pi_old - log mu|, the k3 estimate of KL(mu ||
    pi_old), the largest token ratio, and 'is_capped' (0 here; importance_weights counts the tokens its cap
    changes)."""
    on = mask > 0
    log_w = torch.where(on, old_logp.detach() - sampler_logp.to(old_logp.dtype), 0.0)  # (N, T)
    with torch.no_grad():
        stats = {
            "sampler_abs_diff": (log_w.abs() * mask).sum(),
            "sampler_kl": (kl_estimate(-log_w, "k3") * mask).sum(),  # l = log mu - log pi_old, y ~ mu
            "sampler_ratio_max": torch.where(on, log_w, -torch.inf).max().exp()
            if on.any()
            else mask.new_ones(()),
            "is_capped": mask.new_zeros(()),
        }
    return log_w, stats


def importance_weights(
    old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, cfg: GRPOConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weights (N, T) that correct the policy-gradient term for sampling from the sampler's distribution mu
    instead of the trainer's pi_old (--grpo.is-correction; grpo_loss calls it only when one is on).

    w = pi_old / mu per token, or the product over the sequence's tokens for is_level='sequence'. Then
    'none': 1; 'tis' (truncated): min(w, C); 'mis' (masked): w inside [1/C, C], else 0 (the token, or the
    whole sequence, is dropped). E_mu[w f] = E_pi_old[f] for any f, so uncapped weights remove the gap's bias
    exactly (sequence level) or to first order (token level, contexts still drawn from mu); the cap trades a
    little bias for bounded variance.

    Also returns sampler_gap's sums, with 'is_capped' the tokens whose weight the cap changed.
    """
    on = mask > 0
    log_w, stats = sampler_gap(old_logp, sampler_logp, mask)  # (N, T)
    if cfg.is_level == "sequence":
        log_w = (log_w * mask).sum(-1, keepdim=True).expand_as(log_w)  # (N, T) one weight per sequence
    elif cfg.is_level != "token":
        raise ValueError(f"unknown is_level {cfg.is_level!r}: use 'token' or 'sequence'")
    C = cfg.is_cap
    w = torch.exp(log_w)  # (N, T)
    if cfg.is_correction == "none":
        out = torch.ones_like(w)
    elif cfg.is_correction == "tis":
        out = w.clamp(max=C)
    elif cfg.is_correction == "mis":
        out = torch.where((w >= 1.0 / C) & (w <= C), w, 0.0)
    else:
        raise ValueError(f"unknown is_correction {cfg.is_correction!r}: use 'none', 'tis' or 'mis'")
    if cfg.is_correction != "none":
        stats["is_capped"] = ((out != w) & on).sum().to(mask.dtype)
    return torch.where(on, out, 0.0), stats


# ----------------------------------------------------------------------------- loss


def grpo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, adv: torch.Tensor, mask: torch.Tensor,
    cfg: GRPOConfig, *, num_seqs: float, num_tokens: float, max_len: int, sampler_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None, keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """Policy loss (+ beta * KL when kl_placement='loss', - entropy_coef * entropy) of N completions, T tokens.

    logp (N, T) differentiable; old_logp (N, T) pi_old: the trainer's own log-probs at the start of the step
    (the first pass's, detached, the same for every pass; the sampler's are `sampler_logp`); ref_logp (N, T)
    or None (needed for placement 'loss'); adv (N,) or (N, T); mask (N, T), 1 on completion tokens.
    num_seqs / num_tokens: completions / mask sum of the WHOLE optimizer step (all micro-batches and ranks);
    max_len: the step's max_new_tokens (Dr. GRPO's constant). Rows are independent, so the loss of a step is
    the sum of grpo_loss over any split of its rows.

    stats (detached 0-d tensors) are SUMS over this micro-batch, to add up across micro-batches and ranks:
    'tokens' (mask sum), 'clip_low' / 'clip_high' (tokens a clip acts on: see policy_terms), 'kl' (sum of k3
    over tokens: a non-negative estimate of the per-token KL(pi || ref), whatever the configured estimator),
    'pg_loss' / 'kl_loss' (this micro-batch's share of the loss), and 'ratio_max' (a max: combine with max).
    With their options on: 'clip_dual' (tokens the dual clip bounds), 'entropy_kept' (tokens that keep the
    policy gradient), 'entropy_bonus' (its share of the loss, subtracted). `finalize_stats` makes means.

    sampler_logp (N, T): the sampler's log-probs of the same tokens. Given, the stats hold the
    sampler-trainer gap ('sampler_*', 'is_capped': sampler_gap), and with cfg.is_correction the
    policy-gradient term is weighted by `importance_weights(old_logp, sampler_logp, ...)`. The KL term is not
    reweighted.
    entropy (N, T): the differentiable per-token entropy, needed when entropy_coef != 0. keep (N, T) bool:
    the tokens that keep the policy-gradient term (high_entropy_tokens), needed when top_entropy_quantile <
    1; the others contribute 0 with unchanged token weights, and the KL and entropy terms keep every token.
    """
    logp, old_logp, ref_logp, adv, mask = _masked_inputs(logp, old_logp, ref_logp, adv, mask, cfg)
    on = mask > 0
    ratio = _ratio(logp, old_logp, mask, cfg)  # (N, T)
    pg, extra = policy_terms(logp, ratio, adv, on, cfg)  # (N, T)
    gap: dict[str, torch.Tensor] = {}  # the sampler-trainer gap, logged every step
    if sampler_logp is not None and cfg.is_correction != "none":  # and corrected: pi_old / mu
        is_w, gap = importance_weights(old_logp, sampler_logp, mask, cfg)  # (N, T), detached
        pg = pg * is_w
    elif sampler_logp is not None:
        gap = sampler_gap(old_logp, sampler_logp, mask)[1]

    kl = torch.zeros_like(pg)
    if cfg.kl_placement == "loss" and cfg.beta != 0.0:
        kl = kl_loss_terms(logp, old_logp, ref_logp, mask, cfg)  # (N, T)
    elif cfg.kl_placement not in ("none", "loss", "reward"):
        raise ValueError(f"unknown kl_placement {cfg.kl_placement!r}: use 'none', 'loss' or 'reward'")

    w = _token_weights(
        mask, cfg.loss_agg, num_seqs=num_seqs, num_tokens=num_tokens, max_len=max_len
    )  # (N, T)
    pg, bonus = _entropy_terms(pg, entropy, keep, on, w, cfg, extra)  # (N, T), scalar or None
    pg_loss = (pg * w).sum()
    kl_loss = cfg.beta * (kl * w).sum()
    loss = pg_loss + kl_loss if bonus is None else pg_loss + kl_loss - bonus

    with torch.no_grad():
        k3 = kl_estimate(logp - ref_logp, "k3") if ref_logp is not None else torch.zeros_like(logp)
        stats = {
            "tokens": mask.sum(),
            "clip_low": extra.pop("clip_low"),
            "clip_high": extra.pop("clip_high"),
            "ratio_max": torch.where(on, ratio, 0.0).max() if on.any() else ratio.new_zeros(()),
            "kl": (k3 * mask).sum(),
            "pg_loss": pg_loss.detach(),
            "kl_loss": kl_loss.detach(),
            **gap,
            **extra,
        }
    return loss, stats


def _masked_inputs(logp, old_logp, ref_logp, adv, mask, cfg: GRPOConfig):
    """Checked inputs in logp's dtype, 0 on padding, adv broadcast to (N, T)."""
    if logp.shape != mask.shape or old_logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask must share (N, T)"
        )
    if cfg.kl_placement == "loss" and ref_logp is None:
        raise ValueError("kl_placement='loss' needs ref_logp (the reference model's log-probs)")
    mask = mask.to(logp.dtype)
    on = mask > 0
    # Padding may hold garbage (-inf, nan): zero it through where() so it gets exactly zero gradient.
    logp = torch.where(on, logp, 0.0)  # (N, T)
    old_logp = torch.where(on, old_logp.to(logp.dtype), 0.0)  # (N, T)
    if ref_logp is not None:
        ref_logp = torch.where(on, ref_logp.to(logp.dtype), 0.0)  # (N, T)
    adv = (adv[:, None] if adv.dim() == 1 else adv).to(logp.dtype).expand_as(logp)  # (N, T)
    return logp, old_logp, ref_logp, adv, mask


def _ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """pi / pi_old per token (N, T), or GSPO's geometric mean over the sequence broadcast to its tokens."""
    log_ratio = logp - old_logp  # (N, T)
    if cfg.ratio_level == "sequence":
        n_i = mask.sum(-1, keepdim=True).clamp(min=1)  # (N, 1)
        log_ratio = ((log_ratio * mask).sum(-1, keepdim=True) / n_i).expand_as(logp)  # (N, T) GSPO
    elif cfg.ratio_level != "token":
        raise ValueError(f"unknown ratio_level {cfg.ratio_level!r}: use 'token' or 'sequence'")
    return torch.exp(log_ratio)  # (N, T)


def policy_terms(
    logp: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, on: torch.Tensor, cfg: GRPOConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy-gradient loss (N, T) by cfg.policy_loss, and the counts of the tokens its clips act on.

    'clip' (PPO, GRPO): -min(ratio * adv, clip(ratio) * adv), clip(ratio) = clamp(ratio, 1-eps_low,
    1+eps_high). A token whose clipped branch is active has no gradient: clip_low counts ratio < 1-eps_low
    with adv < 0, clip_high ratio > 1+eps_high with adv > 0. With dual_clip C > 0 (Ye et al. 2020; verl's
    clip_ratio_c) a negative-advantage token's loss is also at most -C * adv: for adv < 0 the loss is
    min(max(-ratio * adv, -clip(ratio) * adv), -C * adv), so a token whose ratio has run past C (a stale
    sample now very likely) stops pushing; 'clip_dual' counts those tokens.
    'cispo' (MiniMax-M1): -sg(clip(ratio)) * adv * logp, REINFORCE with a clipped, detached importance weight:
    every token keeps a gradient, of size at most (1+eps_high) * |adv|. Its value is not the surrogate's
    (it carries logp), as in TRL and verl. clip_low / clip_high count the tokens whose weight is clipped,
    whatever the sign of adv.
    """
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    clipped = ratio.clamp(lo, hi)  # (N, T)
    if cfg.policy_loss == "cispo":
        pg = -clipped.detach() * adv * logp  # (N, T)
        low, high = (ratio < lo) & on, (ratio > hi) & on  # (N, T)
    elif cfg.policy_loss == "clip":
        pg = -torch.minimum(ratio * adv, clipped * adv)  # (N, T)
        low, high = (ratio < lo) & (adv < 0) & on, (ratio > hi) & (adv > 0) & on  # (N, T)
    else:
        raise ValueError(f"unknown policy_loss {cfg.policy_loss!r}: use 'clip' or 'cispo'")
    counts = {"clip_low": low.sum().to(ratio.dtype), "clip_high": high.sum().to(ratio.dtype)}
    if cfg.dual_clip > 0:
        if cfg.policy_loss != "clip":
            raise ValueError("dual_clip bounds the clipped surrogate: use it with policy_loss='clip'")
        bound = -cfg.dual_clip * adv  # (N, T), > 0 where adv < 0
        dual = (adv < 0) & (pg > bound)  # (N, T)
        pg = torch.where(dual, bound, pg)  # (N, T) the bound is a constant: no gradient
        counts["clip_dual"] = (dual & on).sum().to(ratio.dtype)
    return pg, counts


def _entropy_terms(
    pg, entropy, keep, on, w, cfg: GRPOConfig, stats: dict
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The high-entropy mask on the policy terms pg (N, T), and the entropy bonus (None when off), with their
    stats added to `stats`: the kept tokens, the bonus's value."""
    if cfg.top_entropy_quantile < 1:
        if keep is None:
            raise ValueError("top_entropy_quantile < 1 needs keep: the step's high_entropy_tokens")
        keep = keep & on  # (N, T)
        pg = torch.where(keep, pg, 0.0)  # (N, T) the token weights stay the step's
        stats["entropy_kept"] = keep.sum().to(pg.dtype)
    if cfg.entropy_coef == 0:
        return pg, None
    if entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy: completion_logprobs(..., entropy_grad=True)")
    bonus = cfg.entropy_coef * (torch.where(on, entropy.to(pg.dtype), 0.0) * w).sum()
    stats["entropy_bonus"] = bonus.detach()
    return pg, bonus


def _token_weights(
    mask: torch.Tensor, agg: str, *, num_seqs: float, num_tokens: float, max_len: int
) -> torch.Tensor:
    """Weight of each token in the loss (N, T); every token of one row gets the same weight."""
    if agg == "token-mean":
        return mask / num_tokens
    if agg == "seq-mean-token-mean":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1) * num_seqs)
    if agg == "seq-mean-token-sum-norm":
        return mask / (max_len * num_seqs)
    raise ValueError(
        f"unknown loss_agg {agg!r}: use token-mean, seq-mean-token-mean or seq-mean-token-sum-norm"
    )


# ----------------------------------------------------------------------------- KL to the reference


def kl_estimate(l: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1 = l, k2 = l^2/2, k3 = exp(-l) - 1 + l, elementwise on l = log pi - log pi_ref (Schulman 2020).

    Under y ~ pi, k1 and k3 are unbiased estimates of KL(pi || ref); k3 is also >= 0. Their GRADIENTS are a
    different story (module docstring, docs/KL.md).
    """
    if estimator == "k1":
        return l
    if estimator == "k2":
        return 0.5 * l * l
    if estimator == "k3":
        return torch.expm1(-l) + l  # expm1: no cancellation near l = 0
    raise ValueError(f"unknown kl_estimator {estimator!r}: use 'k1', 'k2' or 'k3'")


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, cfg: GRPOConfig
) -> torch.Tensor:
    """Placement 'reward': per-sequence sum_t k(l_t), detached. The trainer subtracts it before advantages:

        rewards = rewards - cfg.beta * kl_penalty(old_logp, ref_logp, mask, cfg)   # (B*G,)

    With k1 this is log pi(y)/pi_ref(y), whose score-function gradient is exactly grad KL(pi || ref).
    """
    l = torch.where(mask > 0, logp - ref_logp, 0.0).detach()  # (N, T)
    return (kl_estimate(l, cfg.kl_estimator) * mask).sum(-1)  # (N,)


def _rev_cumsum(x: torch.Tensor) -> torch.Tensor:
    return x.flip(-1).cumsum(-1).flip(-1)  # out[t] = sum_{s >= t} x[s]


def kl_loss_terms(
    logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, cfg: GRPOConfig
) -> torch.Tensor:
    """Per-token KL terms (N, T) for placement 'loss'; the aggregation weights them like the policy terms.

    Per token (default): k(l_t), times the live ratio pi_t/pi_old_t when kl_is_weight. pi_old is a constant,
    so d(rho k)/dtheta = rho (k + k') dlogp: with k1 or k3, k + k' = l + (1 or 0), whose expectation under
    pi_old is E_pi[l dlogp] = the reverse-KL gradient of that token's distribution (contexts as sampled).

    Sequence level (kl_reward_to_go): the gradient of k(L), L = sum_t l_t, of the whole sequence, written per
    token as c_t * dlogp_t with c_t detached and terms of zero expectation dropped (causality):
      k1: c_t = 1                                   (E = 0: k1 has no gradient at any level)
      k2: c_t = sum_{s>=t} l_s                      (E = grad KL(pi || ref), the KL reward-to-go)
      k3: c_t = 1 - exp(-sum_{s<=t} l_s)            (E = grad KL(ref || pi): E_pi[exp(-L_{>t}) | y_<=t] = 1)
    and with kl_is_weight the gradient of E_pi[k(L)] from pi_old samples, per-decision importance weights
    R_s = prod_{u<=s} pi_u/pi_old_u:
      k1, k3: c_t = sum_{s>=t} R_s l_s              (E = grad KL(pi || ref) exactly, off-policy too)
      k2:     c_t = R_T (L^2/2 + L)                 (E = grad E_pi[L^2/2]: k2 is not a KL estimate)
    The value of the term is k(l_t) (times rho_t) so the logged loss stays a KL-sized number.
    """
    l = logp - ref_logp  # (N, T), already 0 at masked tokens
    log_rho = logp - old_logp  # (N, T)
    k = kl_estimate(l, cfg.kl_estimator)  # (N, T)
    if not cfg.kl_reward_to_go:
        return k * torch.exp(log_rho) if cfg.kl_is_weight else k
    ld = l.detach() * mask  # (N, T)
    if cfg.kl_is_weight:
        R = torch.exp(log_rho.detach().cumsum(-1))  # (N, T) prod_{u<=s} rho_u (masked tokens have rho = 1)
        if cfg.kl_estimator == "k2":
            L = ld.sum(-1, keepdim=True)  # (N, 1)
            c = (R[:, -1:] * (0.5 * L * L + L)).expand_as(ld)  # (N, T)
        else:
            c = _rev_cumsum(R * ld)  # (N, T)
        value = (k * torch.exp(log_rho)).detach()
    else:
        if cfg.kl_estimator == "k1":
            c = torch.ones_like(ld)
        elif cfg.kl_estimator == "k2":
            c = _rev_cumsum(ld)
        else:
            c = -torch.expm1(-ld.cumsum(-1))
        value = k.detach()
    return value + c * (logp - logp.detach())  # value k, gradient c * dlogp


# ----------------------------------------------------------------------------- entropy


def entropy_threshold(entropy: torch.Tensor, q: float) -> float:
    """The (1 - q) quantile of the step's token entropies (1-D, any order; linear interpolation as
    torch.quantile's, without its input-size limit): tokens at or above it are the top-q fraction."""
    if entropy.numel() == 0:
        return 0.0
    s = entropy.double().sort().values  # (n,)
    pos = (1.0 - q) * (len(s) - 1)
    i = math.floor(pos)
    j = min(i + 1, len(s) - 1)
    return float(s[i] + (pos - i) * (s[j] - s[i]))


def high_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """keep (N, T) bool for grpo_loss: completion tokens whose (detached) entropy is at or above threshold,
    the entropy_threshold of the step's tokens (Wang et al. 2025, "Beyond the 80/20 rule": q = 0.2)."""
    return (entropy.detach() >= threshold) & (mask > 0)


# ----------------------------------------------------------------------------- stats


def finalize_stats(totals: dict[str, float]) -> dict[str, float]:
    """Summed stats of a step (micro-batches added, *_max maxed) -> the logged means and fractions."""
    n = max(float(totals["tokens"]), 1.0)
    out = {
        "clip_low": float(totals["clip_low"]) / n,
        "clip_high": float(totals["clip_high"]) / n,
        "ratio_max": float(totals["ratio_max"]),
        "kl": float(totals["kl"]) / n,
        "pg_loss": float(totals["pg_loss"]),
        "kl_loss": float(totals["kl_loss"]),
    }
    if "sampler_abs_diff" in totals:  # mean |log pi_old - log mu| and KL(mu || pi_old) per token
        out["sampler_abs_diff"] = float(totals["sampler_abs_diff"]) / n
        out["sampler_kl"] = float(totals["sampler_kl"]) / n
        out["sampler_ratio_max"] = float(totals["sampler_ratio_max"])
        out["is_capped"] = float(totals["is_capped"]) / n
    for k in ("clip_dual", "entropy_kept"):  # fractions of the tokens, with their options on
        if k in totals:
            out[k] = float(totals[k]) / n
    if "entropy_bonus" in totals:
        out["entropy_bonus"] = float(totals["entropy_bonus"])
    return out


OFF_POLICY = ("clip_low", "clip_high", "clip_dual", "ratio_max")  # what the passes after the first report


def later_pass_stats(totals: dict[str, float] | None) -> dict[str, float]:
    """The clip metrics of the passes after the first (--grpo.num-iterations or --ppo.epochs > 1), from
    their stats summed over micro-batches, passes and ranks: 'offpolicy/clip_low', '.../clip_high',
    '.../clip_dual' as fractions of those passes' tokens (the mean over passes), '.../ratio_max' their max.
    The first pass's ratio is exactly 1, so its clip_* read 0 whatever the clip; these are where clip-higher,
    the dual clip or CISPO's cap act. {} with one pass."""
    if totals is None:
        return {}
    fin = finalize_stats(totals)
    return {f"offpolicy/{k}": fin[k] for k in OFF_POLICY if k in fin}
