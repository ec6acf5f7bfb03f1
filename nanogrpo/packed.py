"""Sampling weights for the CPU: every linear layer's weight with its LoRA update folded in, packed once per
call to `generate` into oneDNN's blocked layout.

Why: on a CPU, a decode step is a few dozen small matmuls (M = the batch) per layer. A plain bf16
`F.linear` re-lays out the weight on every call; a pre-packed weight skips that (15-30% faster matmuls
on SmolLM2's shapes), and folding the LoRA update into the temporary copy removes the two low-rank
matmuls per projection. The copies live only for the duration of the `with` block; the trained
weights are untouched, so the sampler's model is the trained model up to bf16 rounding of W + BA.

The GPU path does not use this: there the copy would cost as much memory as the model, and cuBLAS needs
no packing. `packed_weights(model)` is a no-op unless the model is a bf16 model on a CPU with oneDNN.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn as nn

from .lora import LoraLinear


def packing_supported(weight: torch.Tensor) -> bool:
    """oneDNN bf16 packing: a bf16 weight on the CPU, a torch built with oneDNN, not switched off by
    NANOGRPO_PACKED=0."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and os.environ.get("NANOGRPO_PACKED", "1") != "0"
    )


class PackedLinear:
    """y = x @ W^T + b with W pre-packed for oneDNN; `batch_hint` is the expected number of rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int):
        self.out_features = weight.shape[0]
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)
        self.bias = None if bias is None else bias.to(weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # (..., in)
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, shape[-1]), self.weight, self.bias, "none", [], ""
        )
        return y.view(*shape[:-1], self.out_features)  # (..., out)


def effective_weight(m: nn.Module) -> torch.Tensor:
    """The weight the layer applies now: W, or W + (alpha / r) B A for an enabled, unmerged adapter."""
    if isinstance(m, LoraLinear):
        w = m.base_layer.weight
        if m.enabled and not m.merged:
            w = (w.float() + m.delta_weight()).to(w.dtype)  # (out, in) rounded once to the compute dtype
        return w
    return m.weight


@contextlib.contextmanager
def packed_weights(model: nn.Module, batch_hint: int) -> Iterator[PackedLinear | None]:
    """Inside the block, every nn.Linear / LoraLinear of `model` runs on a packed copy of its effective
    weight. Yields a PackedLinear for the LM head (None when packing does not apply: use the plain weight).
    """
    head = model.lm_head_weight
    if not packing_supported(head):
        yield None
        return
    patched: list[nn.Module] = []
    try:
        with torch.no_grad():
            for name, m in model.named_modules():
                inside_lora = any(name.endswith(s) for s in (".base_layer", ".lora_A", ".lora_B"))
                if name == "lm_head" or inside_lora or not isinstance(m, (nn.Linear, LoraLinear)):
                    continue
                # an instance attribute shadows the class's forward until it is deleted again
                m.forward = PackedLinear(effective_weight(m), m.bias, batch_hint)
                patched.append(m)
            lm_head = PackedLinear(head, None, batch_hint)
        yield lm_head
    finally:
        for m in patched:
            del m.forward
