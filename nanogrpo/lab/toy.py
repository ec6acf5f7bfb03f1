"""A tabular autoregressive policy small enough to enumerate: the exact laboratory for GRPO and KL questions.

V tokens, fixed length T, one vector of V logits per prefix (1 + V + ... + V^(T-1) prefixes). With V=3, T=4
there are 81 sequences and 40 prefixes (120 parameters), so every expectation over sequences is a sum of 81
terms: KL(pi || ref), entropy, expected reward and the EXPECTED gradient of any loss are exact, not sampled.

A sequence is named by its index 0..V^T-1 (base-V digits, first token most significant). Parameters are a
plain tensor `theta` (n_ctx, V) passed to every function, so callers choose what is differentiated.

The toy task (used by nanogrpo.lab.ablate): one prompt, reward = fraction of tokens that are not the last token
id (16 of 81 sequences score 1), plus Gaussian noise per sample, as a noisy judge would give.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from nanogrpo.config import GRPOConfig
from nanogrpo.grpo import compute_advantages, grpo_loss, kl_penalty


class TabularPolicy:
    """The index tables of the enumerable policy; the logits live outside, in `theta` (n_ctx, V)."""

    def __init__(self, V: int = 3, T: int = 4, dtype: torch.dtype = torch.float64):
        assert V >= 2 and T >= 1, "need at least 2 tokens and 1 position"
        self.V, self.T, self.dtype = V, T, dtype
        self.n_ctx = sum(V**t for t in range(T))
        self.seqs = torch.tensor(list(itertools.product(range(V), repeat=T)), dtype=torch.long)  # (V^T, T)
        self.n_seq = self.seqs.shape[0]
        # prefix y_<t gets row offset(t) + its base-V value: all prefixes of one length are contiguous
        ctx = torch.zeros(self.n_seq, T, dtype=torch.long)  # (V^T, T)
        offset, value = 0, torch.zeros(self.n_seq, dtype=torch.long)
        for t in range(T):
            ctx[:, t] = offset + value
            offset += V**t
            value = value * V + self.seqs[:, t]
        self.ctx = ctx

    def init(self, scale: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
        """Random logits (n_ctx, V) ~ N(0, scale^2); scale 0 is the uniform policy."""
        return scale * torch.randn(self.n_ctx, self.V, generator=generator, dtype=self.dtype)

    def token_logp(self, theta: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """log pi(y_t | y_<t) for the sequences `idx` (all when None): (N, T), differentiable in theta."""
        idx = torch.arange(self.n_seq) if idx is None else idx
        logq = torch.log_softmax(theta, -1)  # (n_ctx, V)
        return logq[self.ctx[idx], self.seqs[idx]]  # (N, T)

    def seq_logp(self, theta: torch.Tensor) -> torch.Tensor:
        """log pi(y) of every sequence: (V^T,)."""
        return self.token_logp(theta).sum(-1)

    def sample(self, theta: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """n i.i.d. sequence indices from pi (exactly autoregressive sampling, drawn from the joint)."""
        with torch.no_grad():
            p = torch.exp(self.seq_logp(theta))  # (V^T,)
        return torch.multinomial(p, n, replacement=True, generator=generator)

    def kl(self, theta_p: torch.Tensor, theta_q: torch.Tensor) -> torch.Tensor:
        """Exact sequence-level KL(p || q), differentiable in both."""
        lp, lq = self.seq_logp(theta_p), self.seq_logp(theta_q)
        return (torch.exp(lp) * (lp - lq)).sum()

    def entropy(self, theta: torch.Tensor) -> torch.Tensor:
        """Exact sequence-level entropy in nats."""
        lp = self.seq_logp(theta)
        return -(torch.exp(lp) * lp).sum()

    def ctx_kl(self, theta_p: torch.Tensor, theta_q: torch.Tensor) -> torch.Tensor:
        """KL(p(.|c) || q(.|c)) of the next-token distributions at every prefix c: (n_ctx,)."""
        lp, lq = torch.log_softmax(theta_p, -1), torch.log_softmax(theta_q, -1)
        return (torch.exp(lp) * (lp - lq)).sum(-1)

    def visits(self, theta: torch.Tensor) -> torch.Tensor:
        """Probability that a sequence from pi passes through each prefix: (n_ctx,), detached."""
        with torch.no_grad():
            p = torch.exp(self.seq_logp(theta))  # (V^T,)
            out = torch.zeros(self.n_ctx, dtype=p.dtype)
            for t in range(self.T):
                out.index_add_(0, self.ctx[:, t], p)
        return out


def optimal_policy_logp(
    policy: TabularPolicy, theta_ref: torch.Tensor, reward: torch.Tensor, beta: float
) -> torch.Tensor:
    """log pi*(y) of the KL-regularised optimum pi* = argmax E[r] - beta KL(pi || ref) ∝ ref(y) exp(r(y)/beta)."""
    z = policy.seq_logp(theta_ref).detach() + reward.to(policy.dtype) / beta  # (V^T,)
    return z - torch.logsumexp(z, 0)


# ----------------------------------------------------------------------------- the toy task


@dataclass(frozen=True)
class ToySettings:
    """The toy task: reward = fraction of tokens that are not the last token id, plus N(0, noise^2) per sample."""

    steps: int = 300
    lr: float = 0.05
    groups: int = 2  # prompts per step (all the same: the toy has one prompt)
    group_size: int = 8
    noise: float = 0.1
    mu: int = 4  # num_iterations of the off-policy runs
    ref_scale: float = 1.0  # logits of the reference ~ N(0, ref_scale^2)


def toy_reference(pol: TabularPolicy, s: ToySettings) -> torch.Tensor:
    """The reference (and initial) policy of every toy run: fixed logits ~ N(0, ref_scale^2)."""
    return pol.init(s.ref_scale, torch.Generator().manual_seed(1234))


def toy_reward(pol: TabularPolicy) -> torch.Tensor:
    """Expected reward of every sequence (V^T,): 16 of the 81 sequences (no token V-1) score 1."""
    return (pol.seqs != pol.V - 1).to(pol.dtype).mean(-1)


def toy_optimum(betas: list[float], s: ToySettings) -> dict[str, dict[str, float]]:
    """Where a KL-regularised run should end: KL(pi* || ref), H(pi*) / H(ref) and E_pi*[r] for each beta."""
    pol = TabularPolicy(V=3, T=4)
    theta_ref = toy_reference(pol, s)
    lref, r, out = pol.seq_logp(theta_ref), toy_reward(pol), {}
    h0 = pol.entropy(theta_ref)
    for b in betas:
        ls = optimal_policy_logp(pol, theta_ref, r, b)
        p = torch.exp(ls)
        out[f"{b:g}"] = {
            "kl": float((p * (ls - lref)).sum()),
            "entropy_frac": float(-(p * ls).sum() / h0),
            "reward": float((p * r).sum()),
        }
    return out


def train_toy(cfg: GRPOConfig, seed: int, s: ToySettings) -> dict[str, list[float]]:
    """Stochastic GRPO on the toy with grpo.py's own advantages and loss, as train.py runs it (the KL reward
    penalty from the sampler's log-probs, num_iterations passes over each batch); Adam on the logits.
    Returns exact curves: kl, entropy, reward, dist (KL(pi || pi*)) before each step and after the last;
    grad_norm (first pass) and zero_std (fraction of groups) per step."""
    pol = TabularPolicy(V=3, T=4)
    theta_ref = toy_reference(pol, s)
    gen = torch.Generator().manual_seed(seed)
    theta = theta_ref.clone().requires_grad_(True)  # GRPO starts at the reference
    opt = torch.optim.Adam([theta], lr=s.lr)
    assert cfg.group_size == s.group_size, "cfg.group_size must equal ToySettings.group_size"
    r_base = toy_reward(pol)  # (V^T,)
    logp_star = optimal_policy_logp(pol, theta_ref, r_base, cfg.beta)  # (V^T,)
    N, T = s.groups * s.group_size, pol.T
    mask = torch.ones(N, T, dtype=pol.dtype)
    curves: dict[str, list[float]] = {
        k: [] for k in ("kl", "entropy", "reward", "dist", "grad_norm", "zero_std")
    }

    def exact():
        with torch.no_grad():
            lp = pol.seq_logp(theta)  # (V^T,)
            curves["kl"].append(pol.kl(theta, theta_ref).item())
            curves["entropy"].append(pol.entropy(theta).item())
            curves["reward"].append((torch.exp(lp) * r_base).sum().item())
            curves["dist"].append((torch.exp(lp) * (lp - logp_star)).sum().item())  # KL(pi || pi*)

    for _ in range(s.steps):
        exact()
        idx = pol.sample(theta, N, gen)  # (N,)
        with torch.no_grad():
            old_logp = pol.token_logp(theta, idx)  # (N, T)
            ref_logp = pol.token_logp(theta_ref, idx)  # (N, T)
        rewards = r_base[idx] + s.noise * torch.randn(N, generator=gen, dtype=pol.dtype)  # (N,)
        if cfg.kl_placement == "reward":
            rewards = rewards - cfg.beta * kl_penalty(old_logp, ref_logp, mask, cfg)
        adv, zero_std = compute_advantages(rewards, cfg)
        for it in range(cfg.num_iterations):
            logp = pol.token_logp(theta, idx)  # (N, T)
            loss, _ = grpo_loss(
                logp, old_logp, ref_logp, adv, mask, cfg, num_seqs=N, num_tokens=N * T, max_len=T
            )
            opt.zero_grad()
            loss.backward()
            if it == 0:
                curves["grad_norm"].append(theta.grad.norm().item())
            opt.step()
        curves["zero_std"].append(zero_std.double().mean().item())
    exact()
    return curves
