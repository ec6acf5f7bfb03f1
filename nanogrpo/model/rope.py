"""Rotary position embeddings (RoPE) and the scalings that HF configs name in `rope_scaling`.

`rope_inv_freq` gives the inverse frequencies for 'default', 'linear', 'dynamic' (NTK), 'llama3', 'yarn' and
'longrope' (Phi-3), following each method's paper and transformers' reading of the config fields;
the model applies them with transformer.py's `rope_tables` and `apply_rope`.
"""

from __future__ import annotations

import math

import torch

from nanogrpo.model.hf_config import ModelArgs

LENGTH_DEPENDENT = ("dynamic", "longrope")
"""The rope types whose tables depend on the sequence length: the forward reads it on the host every call."""


def rope_inv_freq(args: ModelArgs, seq_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (rot_dim/2,) float32 on the CPU and the cos/sin scale, for sequences of seq_len."""
    dim = int(args.head_dim * args.partial_rotary_factor)
    base, rs = args.rope_theta, args.rope_scaling
    kind = rs.get("rope_type", "default")
    expo = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # (dim/2,)
    if kind == "dynamic" and seq_len > args.max_position_embeddings:
        # NTK-aware: grow the base with the length so the lowest frequency still spans the sequence
        f = rs["factor"]
        base = base * ((f * seq_len / args.max_position_embeddings) - (f - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / base**expo
    scale = 1.0
    if kind == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif kind == "llama3":
        # Llama 3.1: divide low frequencies by factor, keep high ones, interpolate in between
        f, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / lo, inv_freq / f, inv_freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv_freq = torch.where(mid, (1 - smooth) * scaled / f + smooth * scaled, scaled)
    elif kind == "yarn":
        old = rs["original_max_position_embeddings"]
        f = rs.get("factor") or args.max_position_embeddings / old
        mscale = lambda s, m=1.0: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
        scale = rs.get("attention_factor")
        if scale is None:
            m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
            scale = mscale(f, m) / mscale(f, m_all) if (m and m_all) else mscale(f)
        # dims rotating more than beta_fast times over the old context extrapolate, under beta_slow interpolate
        corr = lambda rot: dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))
        low, high = corr(rs.get("beta_fast") or 32), corr(rs.get("beta_slow") or 1)
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
        inv_freq = inv_freq / f * ramp + inv_freq * (1 - ramp)
    elif kind == "longrope":
        old = rs["original_max_position_embeddings"]
        f = rs.get("factor") or args.max_position_embeddings / old
        scale = rs.get("attention_factor")
        if scale is None:
            scale = 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(old))
        ext = rs["long_factor"] if seq_len > old else rs["short_factor"]
        inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**expo)
    return inv_freq, float(scale)
