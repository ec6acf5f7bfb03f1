"""Fused LM head + log-softmax gather + entropy: per-token log-probs without an [N, V] logits tensor.

GRPO needs log pi(y_t) for every completion token (policy, old policy, reference). The naive path
`log_softmax(hidden @ W.T).gather(targets)` materialises float32 logits [N, V] and a log-softmax of the
same size: 2 * 4 * N * V bytes, 40 GB for 32k tokens of a 151k vocabulary, plus the same again in the
backward. Here the logits are made and consumed a tile at a time:

- `logprobs_torch` (the CPU path and the test oracle) walks the tokens in chunks of C rows, so at most a
  few [C, V] float32 tiles live at once (C is chosen so that C * V stays under `chunk_elems`), and
  recomputes each chunk's logits in the backward instead of saving them. Peak extra memory: O(C * V)
  instead of O(N * V).
"""

from __future__ import annotations

import torch

# At most this many float32 logits per chunk in the reference path (2**24 elements = 64 MiB).
DEFAULT_CHUNK_ELEMS = 1 << 24


def _chunk_rows(n: int, v: int, chunk_elems: int) -> int:
    return max(1, min(n, chunk_elems // max(v, 1)))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 accumulation for bf16/fp16/fp32 inputs; float64 stays float64 (gradcheck in tests)
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    # The matmul runs in the input dtype (bf16 on AMX CPUs is ~8x float32); softmax math is float32.
    return (h @ weight.T).to(_acc_dtype(h.dtype)).div_(temperature)  # (C, V)


class LogprobsTorchFunction(torch.autograd.Function):
    """Chunked reference: forward saves only the per-token log-sum-exp, backward recomputes logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_elems):
        n, v = hidden.shape[0], weight.shape[0]
        acc = _acc_dtype(hidden.dtype)
        logp = torch.empty(n, dtype=acc, device=hidden.device)  # (N,)
        entropy = torch.empty(n, dtype=acc, device=hidden.device)  # (N,)
        lse = torch.empty(n, dtype=acc, device=hidden.device)  # (N,)
        c = _chunk_rows(n, v, chunk_elems)
        for s in range(0, n, c):
            z = _chunk_logits(hidden[s : s + c], weight, temperature)  # (C, V)
            lse_c = torch.logsumexp(z, dim=-1)  # (C,)
            logp[s : s + c] = z.gather(1, targets[s : s + c, None]).squeeze(1) - lse_c
            # H = lse - sum_v p_v z_v; computing p in place keeps one [C, V] tile alive.
            z_dot_p = (z.sub(lse_c[:, None]).exp_() * z).sum(-1)  # (C,)
            entropy[s : s + c] = lse_c - z_dot_p
            lse[s : s + c] = lse_c
            del z
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_elems = temperature, chunk_elems
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, v = hidden.shape[0], weight.shape[0]
        t = ctx.temperature
        grad_h = torch.empty_like(hidden) if need_h else None  # (N, H)
        # float32 accumulator for the weight gradient across chunks, cast once at the end
        acc = _acc_dtype(hidden.dtype)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        c = _chunk_rows(n, v, ctx.chunk_elems)
        for s in range(0, n, c):
            z = _chunk_logits(hidden[s : s + c], weight, t)  # (C, V)
            # d logp / d logits_raw = (onehot(y) - softmax) / T, scaled by the incoming gradient
            g = grad_logp[s : s + c].to(acc) / t  # (C,)
            dz = z.sub_(lse[s : s + c, None]).exp_().mul_(-g[:, None])  # (C, V)
            dz.scatter_add_(1, targets[s : s + c, None], g[:, None])
            if need_h:
                grad_h[s : s + c] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w += dz.T @ hidden[s : s + c].to(acc)
            del z, dz
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


def logprobs_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked PyTorch log-probs and entropies; same contract as `token_logprobs`."""
    _check_inputs(hidden, weight, targets, temperature)
    return LogprobsTorchFunction.apply(hidden, weight, targets, float(temperature), int(chunk_elems))


def _check_inputs(hidden, weight, targets, temperature) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            f"token_logprobs wants hidden [N, H], weight [V, H], targets [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)} (flatten batch and time first)"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets {tuple(targets.shape)}"
        )
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0 for log-probs (got {temperature}); use 1.0 for greedy runs"
        )


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[targets] and the entropy of that softmax.

    hidden [N, H], weight [V, H], targets [N] long -> (logp [N] float32, entropy [N] float32).
    Differentiable w.r.t. hidden and weight; entropy is detached (a metric).
    """
    return logprobs_torch(hidden, weight, targets.long(), temperature)
