"""A tabular autoregressive policy small enough to enumerate: the exact laboratory for GRPO and KL questions.

V tokens, fixed length T, one vector of V logits per prefix (1 + V + ... + V^(T-1) prefixes). With V=3, T=4
there are 81 sequences and 40 prefixes (120 parameters), so every expectation over sequences is a sum of 81
terms: KL(pi || ref), entropy, expected reward and the EXPECTED gradient of any loss are exact, not sampled.

A sequence is named by its index 0..V^T-1 (base-V digits, first token most significant). Parameters are a
plain tensor `theta` (n_ctx, V) passed to every function, so callers choose what is differentiated.
"""

from __future__ import annotations

import itertools

import torch


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
