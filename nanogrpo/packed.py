"""Sampling weights for the CPU: every linear layer's weight with its LoRA update folded in, packed once per
call to `generate` into oneDNN's blocked layout, q|k|v and gate|up fused.

Why: on a CPU, a decode step is a few dozen small matmuls (M = the batch) per layer. A plain bf16
`F.linear` re-lays out the weight on every call; a pre-packed weight skips that (15-30% faster matmuls
on SmolLM2's shapes), folding the LoRA update into the temporary copy removes the two low-rank matmuls
per projection, and fusing the projections that read the same input saves a few percent more. The packed
modules are swapped in for the model's own and put back on the way out; the copies live only for the
duration of the `with` block, except the LM head's, which is kept while its weight is
unchanged (frozen under LoRA); the trained weights are untouched, so the sampler's model is the trained
model up to bf16 rounding of W + BA.

The GPU path does not use this: there the copy would cost as much memory as the model, and cuBLAS needs
no packing. `packed_weights(model)` is a no-op unless the model is a bf16 model on a CPU where oneDNN's
bf16 path runs: `nanogrpo.cpu` tries it once per process, because the CPU flags do not tell (on an AVX2-only
CPU oneDNN's bf16 reorder raises), and elsewhere the model samples on its plain weights. NANOGRPO_PACKED=0
turns packing off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn as nn

from .cpu import cpu_capability
from .lora import LoraLinear


def packing_supported(weight: torch.Tensor) -> bool:
    """oneDNN bf16 packing: a bf16 weight on the CPU, not switched off by NANOGRPO_PACKED=0, on a CPU where
    oneDNN's bf16 reorder and linear run (`cpu_capability().onednn_bf16`: tried once, not read from flags)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and os.environ.get("NANOGRPO_PACKED", "1") != "0"
        and cpu_capability().onednn_bf16
    )


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W pre-packed for oneDNN; `batch_hint` is the expected number of rows.

    A module without parameters (the packed copy is a plain attribute): swapped in for a projection while
    the sampler runs, it adds nothing to the state dict or the optimizer."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int):
        super().__init__()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)
        self.packed_bias = None if bias is None else bias.to(weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # (..., in)
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, shape[-1]), self.packed, self.packed_bias, "none", [], ""
        )
        return y.view(*shape[:-1], self.out_features)  # (..., out)


def effective_weight(m: nn.Module) -> torch.Tensor:
    """The weight the layer applies now: W, or W + (alpha / r) B A for an enabled, unmerged adapter."""
    if isinstance(m, LoraLinear):
        return m.merged_weight() if m.enabled and not m.merged else m.base_layer.weight
    return m.weight


def _fused(mods: list[nn.Module], batch_hint: int) -> PackedLinear:
    """One packed matmul for projections that read the same input (q|k|v, gate|up)."""
    weight = torch.cat([effective_weight(m) for m in mods])  # (sum of outs, in)
    biases = [m.bias for m in mods]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([weight.new_zeros(m.out_features) if b is None else b for m, b in zip(mods, biases)])
    return PackedLinear(weight, bias, batch_hint)


def _packed_head(model: nn.Module, head: torch.Tensor, batch_hint: int) -> PackedLinear:
    """The LM head, packed once and kept on the model while its weight is the same tensor with the same
    version counter (which every in-place update bumps, optimizer steps included). Under LoRA the head is
    frozen, so a training run packs it once instead of at every step (~35 ms for SmolLM2's 49152 x 576 on
    one core)."""
    try:
        version = head._version
    except RuntimeError:  # an inference tensor has no version counter: pack it for this call only
        return PackedLinear(head, None, batch_hint)
    cached = getattr(model, "_packed_lm_head", None)
    if cached is None or cached[0] is not head or cached[1] != version:
        # the weight itself is kept in the key: a new tensor is never taken for the old one
        cached = (head, version, PackedLinear(head, None, batch_hint))
        model._packed_lm_head = cached  # a plain attribute: not a parameter, not in the state dict
    return cached[2]


@contextlib.contextmanager
def packed_weights(model: nn.Module, batch_hint: int) -> Iterator[PackedLinear | None]:
    """Inside the block the model's projections are swapped for packed copies of their effective weights
    (o_proj and down_proj by a PackedLinear each; q|k|v and gate|up fused into one, in the layers'
    `packed_qkv` / `packed_gate_up` slots); on the way out the original modules are put back. Yields a
    PackedLinear for the LM head (None when packing does not apply: then nothing changes).
    """
    head = model.lm_head_weight
    if not packing_supported(head):
        yield None
        return
    swapped: list[tuple[nn.Module, str, nn.Module | None]] = []  # (parent, name, original)

    def swap(parent: nn.Module, name: str, new: nn.Module) -> None:
        swapped.append((parent, name, getattr(parent, name)))
        setattr(parent, name, new)

    try:
        with torch.no_grad():
            for layer in model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                swap(attn, "packed_qkv", _fused([attn.q_proj, attn.k_proj, attn.v_proj], batch_hint))
                swap(mlp, "packed_gate_up", _fused([mlp.gate_proj, mlp.up_proj], batch_hint))
                for parent, name in ((attn, "o_proj"), (mlp, "down_proj")):
                    m = getattr(parent, name)
                    swap(parent, name, PackedLinear(effective_weight(m), m.bias, batch_hint))
            lm_head = _packed_head(model, head, batch_hint)
        yield lm_head
    finally:
        for parent, name, original in reversed(swapped):
            setattr(parent, name, original)
