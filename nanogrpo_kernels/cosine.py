"""Batched cosine similarity, and Shaping Explanations' baseline-adjusted cosine, in one pass over the embeddings.

The semantic grader scores each completion by the cosine between its sentence embedding and the
reference's; Shaping Explanations subtracts the cosine to a baseline vector (the mean reference embedding), so that
generic on-topic text earns nothing, scales by c and clips:

    adjusted = clip(c * (cos(gen, ref) - cos(gen, baseline)), 0, 1)

`_cosine_fwd_kernel` reads each row of gen, ref and baseline once and accumulates the three dot products
and three squared norms in float32, so the adjusted score costs one pass instead of two normalisations
and two cosines. `cosine_torch` is the reference (the CPU path and the test oracle).

A zero vector has no direction: its cosine with anything is defined as 0 (as F.cosine_similarity gives),
so an empty completion embedded to zeros scores 0, never nan. There is no backward: these are rewards.
"""

import torch

from nanogrpo_kernels import tl, triton, use_triton


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [D] or [N, D] -> [N, D] (a broadcast view for a single vector)."""
    return x.expand(n, -1) if x.dim() == 1 else x


def _cos(dot: torch.Tensor, nx: torch.Tensor, ny: torch.Tensor) -> torch.Tensor:
    denom = (nx * ny).sqrt()
    return torch.where(denom > 0, dot / denom.clamp_min(torch.finfo(denom.dtype).tiny), 0.0)


def cosine_torch(
    gen: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor | None = None,
    scale: float = 1.0,
    clip: bool = False,
) -> torch.Tensor:
    """Reference: scale * (cos(gen, ref) - cos(gen, baseline)) per row (no baseline: scale * cos), float32."""
    g = gen.float()  # (N, D)
    r = _rows(ref.float(), g.shape[0])  # (N, D)
    gg = (g * g).sum(-1)  # (N,)
    out = _cos((g * r).sum(-1), gg, (r * r).sum(-1))  # (N,)
    if baseline is not None:
        b = _rows(baseline.float(), g.shape[0])  # (N, D)
        out = out - _cos((g * b).sum(-1), gg, (b * b).sum(-1))
    out = scale * out
    return out.clamp(0.0, 1.0) if clip else out


# One program per row, BLOCK_D = D rounded up to a power of two, at most MAX_BLOCK_D (longer rows loop);
# bench/kernels_aot.py compiles the largest block for sm_80/89/90.
MAX_BLOCK_D = 1024
NUM_WARPS = 4


@triton.jit
def _cosine_fwd_kernel(
    g_ptr, r_ptr, b_ptr, out_ptr,  # gen (N, D), ref (N, D) or stride 0, baseline likewise, out (N,)
    D, stride_g, stride_r, stride_b, scale,
    HAS_BASELINE: tl.constexpr, CLIP: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    gr = tl.zeros([BLOCK_D], dtype=tl.float32)
    gg = tl.zeros([BLOCK_D], dtype=tl.float32)
    rr = tl.zeros([BLOCK_D], dtype=tl.float32)
    gb = tl.zeros([BLOCK_D], dtype=tl.float32)
    bb = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        mask = d0 + offs < D
        g = tl.load(g_ptr + row * stride_g + d0 + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + d0 + offs, mask=mask, other=0.0).to(tl.float32)
        gr += g * r
        gg += g * g
        rr += r * r
        if HAS_BASELINE:
            b = tl.load(b_ptr + row * stride_b + d0 + offs, mask=mask, other=0.0).to(tl.float32)
            gb += g * b
            bb += b * b
    n_g = tl.sum(gg, axis=0)
    denom = tl.sqrt(n_g * tl.sum(rr, axis=0))
    cos = tl.where(denom > 0, tl.sum(gr, axis=0) / tl.maximum(denom, 1e-38), 0.0)
    if HAS_BASELINE:
        denom_b = tl.sqrt(n_g * tl.sum(bb, axis=0))
        cos -= tl.where(denom_b > 0, tl.sum(gb, axis=0) / tl.maximum(denom_b, 1e-38), 0.0)
    cos = cos * scale
    if CLIP:
        cos = tl.minimum(tl.maximum(cos, 0.0), 1.0)
    tl.store(out_ptr + row, cos)


def cosine_triton(
    gen: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor | None = None,
    scale: float = 1.0,
    clip: bool = False,
) -> torch.Tensor:
    """Triton version of `cosine_torch` (same arguments, same result)."""
    n, d = gen.shape
    out = torch.empty(n, dtype=torch.float32, device=gen.device)
    if n == 0:
        return out
    # a single vector is read by every row through stride 0; rows must be contiguous along D
    gen = gen.contiguous()
    ref = ref.contiguous()
    base = ref if baseline is None else baseline.contiguous()
    stride = lambda x: 0 if x.dim() == 1 else x.stride(0)
    block = min(MAX_BLOCK_D, max(16, triton.next_power_of_2(d)))
    _cosine_fwd_kernel[(n,)](
        gen, ref, base, out, d, gen.stride(0), stride(ref), stride(base), float(scale),
        HAS_BASELINE=baseline is not None, CLIP=clip, BLOCK_D=block, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def _check(gen, others) -> None:
    if gen.dim() != 2:
        raise ValueError(f"cosine wants embeddings [N, D]; got gen of shape {tuple(gen.shape)}")
    for x in others:
        if x is not None and (x.shape[-1] != gen.shape[1] or (x.dim() == 2 and x.shape[0] != gen.shape[0])):
            raise ValueError(
                f"shape {tuple(x.shape)} does not match gen {tuple(gen.shape)}: use [N, D] or [D]"
            )


def cosine(gen: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """cos(gen[k], ref[k]) for each row: gen [N, D], ref [N, D] or [D] -> [N] float32 (zero vectors: 0)."""
    _check(gen, [ref])
    fn = cosine_triton if use_triton(gen, ref) else cosine_torch
    return fn(gen, ref)


def adjusted_cosine(
    gen: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor, c: float = 4.0
) -> torch.Tensor:
    """clip(c * (cos(gen, ref) - cos(gen, baseline)), 0, 1) per row (Shaping Explanations; c = 4 there).

    gen [N, D]; ref and baseline [N, D] or [D] -> [N] float32.
    """
    _check(gen, [ref, baseline])
    fn = cosine_triton if use_triton(gen, ref, baseline) else cosine_torch
    return fn(gen, ref, baseline, scale=c, clip=True)
