"""KL to the reference: the k1/k2/k3 estimators and the two placements, in the reward or in the loss.

    rewards = rewards - beta * kl_penalty(old_logp, ref_logp, mask, cfg)    # placement 'reward': (N,)
    terms = kl_loss_terms(logp, old_logp, ref_logp, mask, cfg)              # placement 'loss': (N, T)

grpo.grpo_loss weights the in-loss terms like the policy terms. k1/k2/k3 act on l = logp - ref_logp, in the
reward (detached, summed over the sequence: the correct reverse-KL gradient) or in the loss. The GRPO paper's
choice (k3 per token in the loss) has the expected gradient of the FORWARD KL(ref || pi) with contexts
sampled from pi (see docs/KL.md, checked exactly by nanogrpo.lab.klcheck). `kl_reward_to_go` makes the
in-loss term sequence level; `kl_is_weight` multiplies it by the live ratio pi/pi_old (DeepSeek-V3.2), which
turns k1/k3 into unbiased reverse-KL gradients.
"""

from __future__ import annotations

import torch

from nanogrpo.config import GRPOConfig


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
