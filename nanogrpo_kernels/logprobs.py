"""Fused LM head + log-softmax gather + entropy: per-token log-probs without an [N, V] logits tensor.

GRPO needs log pi(y_t) for every completion token (policy, old policy, reference) and the entropy of
pi(. | context) as a collapse alarm. The naive path `log_softmax(hidden @ W.T).gather(targets)` builds
float32 logits [N, V] and a log-softmax of the same size, 2 * 4 * N * V bytes (40 GB for 32k tokens of a
151k vocabulary), keeps one for the backward, and makes another [N, V] gradient there. Here:

- `_logprobs_fwd_kernel` (Triton) computes logits a [BLOCK_N, BLOCK_V] tile at a time (fp32 accumulation
  of bf16/fp16 inputs) and folds each tile into an online log-sum-exp, the entropy sum and the target's
  logit. The vocabulary is split across a few programs per token block (for occupancy); their partial
  sums meet in a tiny [SPLITS, N] combine. Extra memory: O(N * SPLITS) floats, no [N, V] at all.
- `_logprobs_bwd_kernel` recomputes the logits of a chunk of C tokens and writes the softmax gradient
  (onehot - p) / T for that chunk, [C, V] in the input dtype; two cuBLAS matmuls then give the chunk's
  grad for the hidden states and add its share of the grad for the weight. Peak extra memory: one
  [C, V] tile (C * V <= `chunk_elems`), never N x V.
- `logprobs_torch` (the CPU path and the test oracle) walks the tokens in chunks of C rows with the same
  contract: a few [C, V] float32 tiles at a time, logits recomputed in the backward, not saved; except
  that a batch whose whole log-softmax is small (N * V <= `keep_elems`, 128 MiB of float32: a CPU run's
  few hundred completion tokens) keeps it for the backward instead of recomputing it.

Both paths otherwise save only the per-token log-sum-exp for the backward (the recomputation costs one
more matmul, a small share of a CPU training pass that the kept log-softmax saves; docs/BENCHMARKS.md,
"Numbers behind the CPU paths").
Entropy is a metric, returned detached, unless `entropy_grad=True` (an entropy bonus): then its gradient
dH/dz_j = -(1/T) q_j (log q_j + H), q = softmax(z / T), joins the softmax gradient in the same backward
pass (saving the entropy too); without it the backward is unchanged.

Autocast (a full fine-tune: float32 weights, forward under `torch.autocast(..., torch.bfloat16)`): the
logits matmul is one autocast runs in bf16, but autocast is usually off by the time the backward runs, so
a backward that recomputes the logits would recompute float32 logits against the log-sum-exp of bf16 ones:
the gradient of some other function (1% off on the tests' shapes). So `token_logprobs` does explicitly
what autocast does to a linear layer: hidden and weight are cast to the autocast dtype by autograd-tracked
casts (the gradients flow back to the float32 tensors through them), and the autograd Function runs with
autocast off, forward and backward alike. Both paths then differentiate exactly what they computed: logits
of bf16 inputs (the reference rounds them to bf16, as a bf16 matmul does; the Triton kernels keep their
float32 accumulation).
"""

import contextlib

import torch

from nanogrpo_kernels import tl, triton, use_triton
from nanogrpo_kernels.logprobs_tiles import TRITON_CHUNK_ELEMS, launch_args

# Reference path: at most this many float32 logits per chunk (2**22 elements = 16 MiB: under glibc's
# largest mmap threshold, so a process that keeps its freed memory (nanogrpo/infra/heap.py) reuses the tiles
# instead of faulting fresh pages in for each; the sizes around it ran as fast otherwise: docs/BENCHMARKS.md),
# and the largest whole log-softmax kept for the backward instead of recomputed (2**25 elements = 128 MiB).
DEFAULT_CHUNK_ELEMS = 1 << 22
DEFAULT_KEEP_ELEMS = 1 << 25


def _chunk_rows(n: int, v: int, chunk_elems: int) -> int:
    return max(1, min(n, chunk_elems // max(v, 1)))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 accumulation for bf16/fp16/fp32 inputs; float64 stays float64 (gradcheck in tests)
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    # The matmul runs in the input dtype (bf16 on AMX CPUs is much faster than float32: docs/BENCHMARKS.md);
    # softmax math is float32.
    return (h @ weight.T).to(_acc_dtype(h.dtype)).div_(temperature)  # (C, V)


class LogprobsTorchFunction(torch.autograd.Function):
    """Chunked reference: forward saves the per-token log-sum-exp, backward recomputes the logits; or, for
    a batch of at most `keep_elems` logits that needs a gradient, forward keeps the log-softmax itself."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_elems, entropy_grad=False, keep_elems=0):
        n, v = hidden.shape[0], weight.shape[0]
        acc = _acc_dtype(hidden.dtype)
        logp = torch.empty(n, dtype=acc, device=hidden.device)  # (N,)
        entropy = torch.empty(n, dtype=acc, device=hidden.device)  # (N,)
        lse = torch.empty(n, dtype=acc, device=hidden.device)  # (N,)
        keep = any(ctx.needs_input_grad[:2]) and n * v <= keep_elems
        kept = torch.empty(n, v, dtype=acc, device=hidden.device) if keep else None  # (N, V) log-softmax
        c = _chunk_rows(n, v, chunk_elems)
        for s in range(0, n, c):
            z = _chunk_logits(hidden[s : s + c], weight, temperature)  # (C, V)
            lse_c = torch.logsumexp(z, dim=-1)  # (C,)
            logq = z.sub_(lse_c[:, None])  # (C, V) log-softmax, in place
            logp[s : s + c] = logq.gather(1, targets[s : s + c, None]).squeeze(1)
            # H = -sum p log p: a sum of non-negative terms (lse - sum p z would cancel in float32)
            entropy[s : s + c] = -(logq.exp() * logq).sum(-1)
            lse[s : s + c] = lse_c
            if kept is not None:
                kept[s : s + c] = logq
            del z, logq
        _save(ctx, hidden, weight, targets, lse, entropy, temperature, chunk_elems, entropy_grad)
        ctx.kept = kept  # not in save_for_backward: no autograd tensor, freed with the graph
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, v = hidden.shape[0], weight.shape[0]
        t = ctx.temperature
        grad_h = torch.empty_like(hidden) if need_h else None  # (N, H)
        # float32 accumulator for the weight gradient across chunks, cast once at the end
        acc = _acc_dtype(hidden.dtype)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        c = _chunk_rows(n, v, ctx.chunk_elems)
        # a backward called inside an autocast block would run under it: the logits must be the forward's
        kept = ctx.kept
        with _autocast_off(hidden):
            for s in range(0, n, c):
                if kept is None:  # recompute the log-softmax, into a tile this loop may overwrite
                    logq = _chunk_logits(hidden[s : s + c], weight, t).sub_(lse[s : s + c, None])  # (C, V)
                else:  # the forward's, read only (a second backward, with retain_graph, reads it again)
                    logq = kept[s : s + c]  # (C, V)
                # d logp / d logits_raw = (onehot(y) - softmax) / T, scaled by the incoming gradient
                g = grad_logp[s : s + c].to(acc) / t  # (C,)
                if entropy is None:
                    q = logq.exp_() if kept is None else logq.exp()  # (C, V)
                    dz = q.mul_(-g[:, None])  # (C, V)
                else:  # + g_H dH/dz: dz = -q (g + g_H (log q + H)) / T, and + g / T at the target below
                    q = logq.exp()  # (C, V)
                    g_h = grad_entropy[s : s + c].to(acc) / t  # (C,)
                    dz = logq.add(entropy[s : s + c, None]).mul_(g_h[:, None]).add_(g[:, None])  # (C, V)
                    dz = dz.mul_(q).neg_()
                dz.scatter_add_(1, targets[s : s + c, None], g[:, None])
                if need_h:
                    grad_h[s : s + c] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
                if need_w:
                    grad_w += dz.T @ hidden[s : s + c].to(acc)
                del logq, q, dz
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def _save(ctx, hidden, weight, targets, lse, entropy, temperature, chunk_elems, entropy_grad) -> None:
    """What both backwards read: the inputs, the log-sum-exp and, when it is differentiable, the entropy."""
    ctx.save_for_backward(hidden, weight, targets, lse, entropy if entropy_grad else None)
    ctx.temperature, ctx.chunk_elems = temperature, chunk_elems
    if not entropy_grad:
        ctx.mark_non_differentiable(entropy)


def logprobs_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    entropy_grad: bool = False,
    keep_elems: int = DEFAULT_KEEP_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked PyTorch log-probs and entropies; same contract as `token_logprobs` (autocast included).
    keep_elems: keep the log-softmax for the backward when it has at most this many entries (0: never)."""
    _check_inputs(hidden, weight, targets, temperature)
    hidden, weight = _autocast_inputs(hidden, weight)
    with _autocast_off(hidden):
        return LogprobsTorchFunction.apply(
            hidden,
            weight,
            targets,
            float(temperature),
            int(chunk_elems),
            bool(entropy_grad),
            _keep(keep_elems),
        )


def _keep(keep_elems: int) -> int:
    """The log-softmax is worth keeping only for a backward: none runs after a forward under no_grad (the
    old policy's and the reference's log-probs), where the Function still sees inputs that require grad."""
    return int(keep_elems) if torch.is_grad_enabled() else 0


def _autocast_inputs(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden and weight in the dtype of the matmul autocast would run (autograd-tracked casts, as autocast
    itself makes for a linear layer), or in one common dtype when autocast is off.

    Under autocast the Function must then run with autocast off: its forward and its backward (which
    runs after the autocast block has closed) compute the same logits, and the gradient is exact."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev) and weight.dtype != torch.float64:  # autocast leaves float64 alone
        dtype = torch.get_autocast_dtype(dev)
        return hidden.to(dtype), weight.to(dtype)
    return hidden.to(weight.dtype), weight  # one dtype for the matmul (the trainer already casts)


def _autocast_off(t: torch.Tensor) -> contextlib.AbstractContextManager:
    return torch.autocast(t.device.type, enabled=False)


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


# ----------------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _logits_tile(
    h_rows, w_cols, mask_n, mask_v, H,  # (BLOCK_N, 1) and (1, BLOCK_V) row pointers, their masks
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_F32: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """hidden[rows] @ weight[cols].T as a float32 [BLOCK_N, BLOCK_V] tile, in BLOCK_H steps over H."""
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        mask_h = (h0 + offs_h) < H
        a = tl.load(h_rows + (h0 + offs_h)[None, :], mask=mask_n[:, None] & mask_h[None, :], other=0.0)
        b = tl.load(w_cols + (h0 + offs_h)[:, None], mask=mask_h[:, None] & mask_v[None, :], other=0.0)
        if DOT_F32:  # the interpreter's bf16 dot is wrong
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:  # float32 inputs: true fp32 products, not TF32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _logprobs_fwd_kernel(
    h_ptr, w_ptr, tgt_ptr, part_ptr,  # hidden (N, H), weight (V, H), targets (N,), partials (4, SPLITS, N)
    N, V, H, stride_h, stride_w, inv_temp, tiles_per_split,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_F32: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    tgt = tl.load(tgt_ptr + offs_n, mask=mask_n, other=-1)
    h_rows = h_ptr + offs_n.to(tl.int64)[:, None] * stride_h  # (BLOCK_N, 1) pointers
    # online log-sum-exp over this program's slice of the vocabulary: running max m, s = sum exp(z - m),
    # t = sum exp(z - m) * (z - m) and the target's logit (found in exactly one tile). Entropy is then
    # log s - t / s, two non-negative terms: no cancellation in float32.
    m = tl.full([BLOCK_N], -1e30, dtype=tl.float32)  # finite, so that 0 * (m - m_new) stays 0
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    t = tl.zeros([BLOCK_N], dtype=tl.float32)
    zt = tl.zeros([BLOCK_N], dtype=tl.float32)
    v_start = pid_s * tiles_per_split * BLOCK_V
    v_stop = tl.minimum(v_start + tiles_per_split * BLOCK_V, V)
    for v0 in range(v_start, v_stop, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        w_cols = w_ptr + offs_v.to(tl.int64)[None, :] * stride_w  # (1, BLOCK_V) pointers
        acc = _logits_tile(h_rows, w_cols, mask_n, mask_v, H, BLOCK_N, BLOCK_V, BLOCK_H, DOT_F32, IEEE)
        z = tl.where(mask_v[None, :], acc * inv_temp, float("-inf"))  # (BLOCK_N, BLOCK_V); pads: p = 0
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new[:, None])
        # move t to the new max, then add this tile (where(): p * -inf would be nan)
        t = alpha * (t + s * (m - m_new))
        t += tl.sum(p * tl.where(mask_v[None, :], z - m_new[:, None], 0.0), axis=1)
        s = s * alpha + tl.sum(p, axis=1)
        zt += tl.sum(tl.where(offs_v[None, :] == tgt[:, None], z, 0.0), axis=1)
        m = m_new
    out = part_ptr + pid_s * N + offs_n
    stride_part = tl.num_programs(1) * N
    tl.store(out, m, mask=mask_n)
    tl.store(out + stride_part, s, mask=mask_n)
    tl.store(out + 2 * stride_part, t, mask=mask_n)
    tl.store(out + 3 * stride_part, zt, mask=mask_n)


@triton.jit
def _logprobs_bwd_kernel(
    h_ptr, w_ptr, tgt_ptr, lse_ptr, dz_ptr,  # one chunk: hidden (C, H), targets (C,), lse (C,), dz (C, V)
    ent_ptr, a_ptr, b_ptr,  # ENT_GRAD: entropy (C,), the row's weights of dlogp and dH (C,) (else unused)
    C, V, H, stride_h, stride_w, stride_dz, inv_temp,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_F32: tl.constexpr, IEEE: tl.constexpr, ENT_GRAD: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_n = offs_n < C
    mask_v = offs_v < V
    h_rows = h_ptr + offs_n.to(tl.int64)[:, None] * stride_h  # (BLOCK_N, 1) pointers
    w_cols = w_ptr + offs_v.to(tl.int64)[None, :] * stride_w  # (1, BLOCK_V) pointers
    acc = _logits_tile(h_rows, w_cols, mask_n, mask_v, H, BLOCK_N, BLOCK_V, BLOCK_H, DOT_F32, IEEE)
    tgt = tl.load(tgt_ptr + offs_n, mask=mask_n, other=-1)
    lse = tl.load(lse_ptr + offs_n, mask=mask_n, other=0.0)
    logq = acc * inv_temp - lse[:, None]
    p = tl.exp(logq)  # softmax, from the saved log-sum-exp
    onehot = tl.where(offs_v[None, :] == tgt[:, None], 1.0, 0.0)
    # d logp / d (h @ W.T) = (onehot(y) - p) / T. The incoming gradient is applied outside, per row, so
    # that fp16 tiles never hold tiny products.
    if ENT_GRAD:  # a * dlogp + b * dH, dH = -p (log p + H) / T; a, b: the row's gradients over their max
        a = tl.load(a_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
        b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
        ent = tl.load(ent_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
        dz = (a * onehot - p * (a + b * (logq + ent))) * inv_temp
    else:
        dz = (onehot - p) * inv_temp
    ptrs = dz_ptr + offs_n.to(tl.int64)[:, None] * stride_dz + offs_v[None, :]
    tl.store(ptrs, dz.to(dz_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_v[None, :])


def _logprobs_fwd_triton(hidden, weight, targets, temperature, splits=None):
    """Triton forward -> (logp, entropy, lse), each [N] float32."""
    n, hdim = hidden.shape
    v = weight.shape[0]
    cfg = launch_args(hidden, "fwd")
    n_blocks = triton.cdiv(n, cfg["BLOCK_N"])
    n_tiles = triton.cdiv(v, cfg["BLOCK_V"])
    if splits is None:  # enough programs to fill the GPU about 4 times over
        sms = torch.cuda.get_device_properties(hidden.device).multi_processor_count if hidden.is_cuda else 1
        splits = triton.cdiv(4 * sms, n_blocks)
    tiles_per_split = triton.cdiv(n_tiles, max(1, min(splits, n_tiles)))
    splits = triton.cdiv(n_tiles, tiles_per_split)  # no split is left empty
    part = torch.empty(4, splits, n, dtype=torch.float32, device=hidden.device)  # (4, SPLITS, N)
    _logprobs_fwd_kernel[(n_blocks, splits)](
        hidden, weight, targets, part, n, v, hdim, hidden.stride(0), weight.stride(0),
        1.0 / temperature, tiles_per_split, **cfg,
    )  # fmt: skip
    m, s, t, zt = part  # each (SPLITS, N)
    m_all = m.amax(0)  # (N,)
    scale = torch.exp(m - m_all)  # (SPLITS, N)
    s_all = (s * scale).sum(0)  # (N,)
    lse = m_all + torch.log(s_all)  # (N,)
    t_all = (scale * (t + s * (m - m_all))).sum(0)  # (N,) sum p~ * (z - m_all)
    entropy = torch.log(s_all) - t_all / s_all  # (N,)
    logp = zt.sum(0) - lse  # (N,)
    return logp, entropy, lse


def _logprobs_bwd_triton(
    hidden, weight, targets, lse, grad_logp, temperature, need_h, need_w, chunk_elems, entropy=None, grad_ent=None,
):  # fmt: skip
    """Triton backward -> (grad_hidden or None, grad_weight or None); given entropy, of logp and entropy."""
    n, hdim = hidden.shape
    v = weight.shape[0]
    cfg = launch_args(hidden, "bwd")
    c = max(cfg["BLOCK_N"], (chunk_elems // v) // cfg["BLOCK_N"] * cfg["BLOCK_N"])
    c = min(c, n)
    dz = torch.empty(c, v, dtype=hidden.dtype, device=hidden.device)  # (C, V): the only vocab-sized tensor
    grad_h = torch.empty_like(hidden) if need_h else None  # (N, H)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    g = grad_logp.float()  # (N,)
    a = b = None
    if entropy is not None:  # the tile: a * dlogp + b * dH with |a|, |b| <= 1, their scale g applied outside
        g_ent = grad_ent.float()  # (N,)
        g = torch.maximum(g.abs(), g_ent.abs()).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
        a, b = grad_logp.float() / g, g_ent / g  # (N,), (N,)
    for s in range(0, n, c):
        rows = min(c, n - s)
        h_c = hidden[s : s + rows]  # (C, H)
        grid = (triton.cdiv(rows, cfg["BLOCK_N"]), triton.cdiv(v, cfg["BLOCK_V"]))
        ent_args = (lse, lse, lse) if a is None else (entropy[s : s + rows], a[s : s + rows], b[s : s + rows])
        _logprobs_bwd_kernel[grid](
            h_c, weight, targets[s : s + rows], lse[s : s + rows], dz, *ent_args, rows, v, hdim,
            hidden.stride(0), weight.stride(0), dz.stride(0), 1.0 / temperature, **cfg, ENT_GRAD=a is not None,
        )  # fmt: skip
        d = dz[:rows]  # (C, V)
        g_c = g[s : s + rows, None]  # (C, 1)
        if need_h:
            grad_h[s : s + rows] = ((d @ weight).float() * g_c).to(hidden.dtype)
        if need_w:
            grad_w += (d.T @ (h_c.float() * g_c).to(hidden.dtype)).float()
    return grad_h, (grad_w.to(weight.dtype) if need_w else None)


class LogprobsFunction(torch.autograd.Function):
    """Triton forward and backward; saves hidden, weight, targets and the per-token log-sum-exp."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_elems, entropy_grad=False):
        logp, entropy, lse = _logprobs_fwd_triton(hidden, weight, targets, temperature)
        _save(ctx, hidden, weight, targets, lse, entropy, temperature, chunk_elems, entropy_grad)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with _autocast_off(hidden):
            grad_h, grad_w = _logprobs_bwd_triton(
                hidden, weight, targets, lse, grad_logp, ctx.temperature, need_h, need_w, ctx.chunk_elems,
                entropy, None if entropy is None else grad_entropy,
            )  # fmt: skip
        return grad_h, grad_w, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[targets] and the entropy of that softmax.

    hidden [N, H], weight [V, H], targets [N] (ids in [0, V)) -> (logp [N] float32, entropy [N] float32).
    Differentiable w.r.t. hidden and weight; entropy is detached (a metric) unless entropy_grad (an entropy
    bonus in the loss), which costs one more [C, V] tile in the reference's backward. CUDA tensors run the
    Triton kernels, CPU tensors the chunked PyTorch reference (see `nanogrpo_kernels.set_backend`). Under
    autocast the logits are those of hidden and weight cast to the autocast dtype, and the gradient is theirs
    (through the casts), on both paths.
    """
    _check_inputs(hidden, weight, targets, temperature)
    targets = targets.long()
    hidden, weight = _autocast_inputs(hidden, weight)
    with _autocast_off(hidden):
        if use_triton(hidden, weight) and hidden.dtype != torch.float64 and hidden.shape[0] > 0:
            hidden, weight = hidden.contiguous(), weight.contiguous()
            args = (float(temperature), TRITON_CHUNK_ELEMS, bool(entropy_grad))
            return LogprobsFunction.apply(hidden, weight, targets.contiguous(), *args)
        args = (float(temperature), DEFAULT_CHUNK_ELEMS, bool(entropy_grad), _keep(DEFAULT_KEEP_ELEMS))
        return LogprobsTorchFunction.apply(hidden, weight, targets, *args)
