"""The attention kernels beside SDPA that the model's one attention call (transformer.attention) takes
(`kernel_attention` picks one), and why.

    y = attention(q, k, v, mask)     # transformer.py: q (B, nh, T, D), k/v (B, n_kv, S, D) -> y (B, T, nh, D)

Where the call departs from a plain SDPA call, for speed on the CPU (same results to float32 rounding):
- bf16 queries and keys are cast to float32 first: there the float32 attention kernels are several times
  faster than the bf16 ones, forward and backward (the sampler keeps a float32 cache for this reason);
- a single query per row runs as two batched matmuls with the query heads of a KV head stacked as rows
  (`decode_attention`: no repeated keys), faster per call than SDPA's kernel on SmolLM2's shapes.

On a GPU, grouped-query attention (n_kv < nh, as in Qwen2.5, Llama 3, SmolLM2) with a padding mask would
reach SDPA's math kernel: flash rejects any attn_mask, and the memory-efficient kernel of torch <= 2.11
rejects unequal head counts, so PyTorch would materialise the B * nh * T * S scores (several times, forward
and backward). `gqa_sdpa` asks torch's own checks whether a fused kernel takes the call as it is; when none
does, it repeats each KV head for its nh / n_kv query heads (`repeat_kv`) and the memory-efficient kernel
takes the boolean mask. The copy is 2 * B * nh * S * D elements per layer, kept for the backward; the math
path made that same copy itself (it runs enable_gqa as a repeat_interleave) and the scores on top, so the
fused call holds strictly less. Same results to rounding: the kernels differ, the arithmetic does not.

flash-attn (`--model.attn flash`) runs fp16/bf16 only: under autocast the call is cast to autocast's dtype
first (as SDPA's autocast does), and a call that is still float32 (float32 weights without autocast, as
only direct use of the model makes) runs SDPA instead. Left-padded rows run its varlen kernel on the real
tokens only (`Varlen`, built once per forward); pad positions then get zeros instead of their own value,
which nothing reads (their logits are never used, and no real token attends to them). `check_flash` refuses
at start-up what could never run it: no flash-attn, a CPU run, float32 compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class Varlen:
    """A left-padded batch as flash-attn's varlen kernel takes it: the real tokens of all rows, packed.

    `mask` is the same call as a boolean mask, for calls that run SDPA instead (float32 tensors)."""

    mask: torch.Tensor  # (B, 1, T, S) bool
    q_idx: torch.Tensor  # (nq,) real queries, as indices into the B * T positions
    k_idx: torch.Tensor  # (nk,) real keys, as indices into the B * S positions
    cu_q: torch.Tensor  # (B + 1,) int32: row b's queries are q_idx[cu_q[b]:cu_q[b + 1]]
    cu_k: torch.Tensor  # (B + 1,) int32
    max_q: int
    max_k: int


def varlen(attention_mask: torch.Tensor, T: int, mask: torch.Tensor) -> Varlen:
    """attention_mask (B, S), 1 = real token, 0 = left padding; the queries are the last T positions; mask
    (B, 1, T, S) the same call as a boolean mask. One host sync (the longest row), once per forward."""
    real_k = attention_mask.bool()  # (B, S)
    real_q = real_k[:, real_k.shape[1] - T :]  # (B, T)
    n_q, n_k = real_q.sum(1), real_k.sum(1)  # (B,)
    max_q, max_k = torch.stack([n_q.max(), n_k.max()]).tolist()
    cu = lambda n: F.pad(n.cumsum(0), (1, 0)).to(torch.int32)  # (B + 1,)
    return Varlen(
        mask, real_q.flatten().nonzero().squeeze(1), real_k.flatten().nonzero().squeeze(1),
        cu(n_q), cu(n_k), int(max_q), int(max_k),
    )  # fmt: skip


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor | None:
    """transformer.attention's call through this file's kernels where one is faster (module docstring) ->
    (B, T, nh, D), or None where SDPA as it is is the faster call: a float32 CPU call of several queries, a
    GPU call whose head counts match and whose mask is not flash-attn's. A --plain run never calls it."""
    T, S, cpu = q.shape[2], k.shape[2], q.device.type == "cpu"
    flash_call = isinstance(mask, Varlen) or (isinstance(mask, str) and mask == "flash")
    to_float32 = cpu and (q.dtype != torch.float32 or k.dtype != torch.float32)
    if not (flash_call or to_float32 or (cpu and T == 1) or (not cpu and k.shape[1] != q.shape[1])):
        return None
    if flash_call:
        q, k, v = autocast_inputs(q, k, v)
        if q.dtype in FLASH_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype:
            return flash(q, k, v, mask)  # (B, T, nh, D)
        # flash-attn has no float32 kernel: the same call through SDPA
        mask = mask.mask if isinstance(mask, Varlen) else causal_mask(T, S, q.device)
    causal, mask = isinstance(mask, str), mask if isinstance(mask, torch.Tensor) else None
    dtype = q.dtype
    if cpu and (dtype != torch.float32 or k.dtype != torch.float32):
        q, k, v = q.float(), k.float(), v.float()
    if T == 1 and cpu:
        y = decode_attention(q, k, v, mask)  # (B, nh, 1, D)
    elif cpu or k.shape[1] == q.shape[1]:
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
        )  # (B, nh, T, D)
    else:
        y = gqa_sdpa(q, k, v, mask, causal)  # (B, nh, T, D)
    return y.transpose(1, 2).to(dtype)  # (B, T, nh, D)


def gqa_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """SDPA for grouped-query attention, q (B, nh, T, D), k/v (B, n_kv, S, D), n_kv < nh -> (B, nh, T, D),
    on a fused kernel whenever one exists (the GPU path; the module docstring says why and what it costs).

    The call as it is (enable_gqa) when torch's flash or memory-efficient checks accept it (no mask, or a
    torch whose memory-efficient kernel takes GQA); else with k/v repeated to nh heads. Elsewhere than on
    CUDA the checks accept nothing, so this always repeats there (what the CPU tests compare)."""
    q, k, v = autocast_inputs(q, k, v)  # decide on the dtype SDPA will see
    if not fused_takes(q, k, v, mask, causal):
        g = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, g), repeat_kv(v, g)  # (B, nh, S, D)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
    )  # (B, nh, T, D)


def fused_takes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> bool:
    """Whether SDPA's flash or memory-efficient kernel accepts this enable_gqa call: torch's own rules
    (device, dtype, head dim, alignment, mask, head counts), checked in C++ without running anything.
    False on builds without CUDA kernels, for any input."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    params = SDPAParams(q, k, v, mask, 0.0, causal, True)
    return can_use_flash_attention(params) or can_use_efficient_attention(params)


def repeat_kv(x: torch.Tensor, g: int) -> torch.Tensor:
    """x (B, n_kv, S, D) -> (B, n_kv * g, S, D), KV head j as heads j*g .. j*g+g-1 (enable_gqa's pairing)."""
    B, nkv, S, D = x.shape
    return x[:, :, None].expand(B, nkv, g, S, D).reshape(B, nkv * g, S, D)  # (B, nh, S, D) one copy


def autocast_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v in autocast's dtype when autocast is on (SDPA's autocast would cast them; under a full
    fine-tune RoPE's float32 tables leave q and k in float32), else as they are."""
    dev = q.device.type
    if not torch.is_autocast_enabled(dev):
        return q, k, v
    dt = torch.get_autocast_dtype(dev)
    return q.to(dt), k.to(dt), v.to(dt)


def causal_mask(T: int, S: int, device: torch.device):
    """The "flash" mask (causal, aligned bottom-right: query i is position S - T + i) in SDPA's terms."""
    if T == S:
        return "causal"
    if T == 1:
        return None  # the one new token sees every key
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)[None, None]  # (1, 1, T, S)


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """flash-attn on fp16/bf16 q (B, nh, T, D), k/v (B, n_kv, S, D) -> (B, T, nh, D); mask "flash" (every
    key real, causal bottom-right) or a Varlen (left padding: the real tokens only, packed)."""
    import flash_attn

    B, nh, T, D = q.shape
    S, nkv = k.shape[2], k.shape[1]
    if not isinstance(mask, Varlen):
        return flash_attn.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=T > 1
        )
    qp = q.transpose(1, 2).reshape(B * T, nh, D).index_select(0, mask.q_idx)  # (nq, nh, D)
    kp = k.transpose(1, 2).reshape(B * S, nkv, D).index_select(0, mask.k_idx)  # (nk, n_kv, D)
    vp = v.transpose(1, 2).reshape(B * S, nkv, D).index_select(0, mask.k_idx)  # (nk, n_kv, D)
    y = flash_attn.flash_attn_varlen_func(
        qp, kp, vp, mask.cu_q, mask.cu_k, mask.max_q, mask.max_k, causal=True
    )  # (nq, nh, D); causal bottom-right per row: its queries are the last of its keys
    out = y.new_zeros(B * T, nh, D).index_copy(0, mask.q_idx, y)  # (B*T, nh, D) zeros on the pads
    return out.view(B, T, nh, D)


def check_flash(device: str, dtype: str) -> None:
    """Refuse `--model.attn flash` before any model loads where it could not run: `device` and `dtype` are
    --model.device and --model.dtype as given ('auto' included)."""
    sdpa = "or use --model.attn sdpa (padded GQA calls reach a fused kernel there too: docs/SCALING.md)"
    try:
        import flash_attn  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: a wheel built against another torch or CUDA
        raise ValueError(
            f"--model.attn flash needs flash-attn, which does not import here ({e}): on a CUDA machine "
            f"pip install 'nanogrpo[gpu]' (flash-attn builds against the installed torch), {sdpa}"
        ) from e
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu:
        raise ValueError(
            f"--model.attn flash: flash-attn runs on CUDA GPUs only, and this run is on the CPU; {sdpa}"
        )
    if dtype == "float32":
        raise ValueError(
            "--model.attn flash with --model.dtype float32: flash-attn computes in fp16/bf16 only, so every "
            f"call would run SDPA; use --model.dtype bfloat16 (or auto), {sdpa}"
        )


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """One query per row: q (B, nh, 1, D) against k, v (B, n_kv, S, D); mask None or bool (B, 1, 1, S).

    Same result as SDPA, as two batched matmuls with the g = nh / n_kv query heads of a KV head as rows.
    """
    B, nh, _, D = q.shape
    nkv = k.shape[1]
    s = q.view(B, nkv, nh // nkv, D) @ k.transpose(-1, -2)  # (B, n_kv, g, S)
    s = s * D**-0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))  # mask broadcasts over the heads
    return (s.softmax(-1) @ v).view(B, nh, 1, D)  # (B, nh, 1, D)
