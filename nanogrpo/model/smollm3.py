"""SmolLM3 in nanogrpo's model: a Llama (transformer.py's blocks, Hugging Face's names) whose layers listed 0 in
config.json's `no_rope_layers` (every fourth, by default) use no position encoding at all (NoPE).

`SmolLM3Transformer._rope` stacks the RoPE table and the identity (cos 1, sin 0), and a block takes its own:
x * 1 + rotate(x) * 0 is x, exactly, so a NoPE layer computes what transformers' skipped rotation does.

Departure from transformers: with `use_sliding_window` (off in the released configs) the window is not
applied, which is exact while a sequence is no longer than it, so such a run's context is the window
(policy.model_positions), as Gemma 3's is.
"""

from __future__ import annotations

import torch
from torch import nn

from nanogrpo.model.hf_config import ModelArgs
from nanogrpo.model.transformer import Block, Transformer


class SmolLM3Block(Block):
    """A Llama block that rotates with the RoPE table (index 0 of the stacked tables), or, a NoPE layer,
    with the identity (index 1)."""

    def __init__(self, a: ModelArgs, layer: int):
        super().__init__(a)
        self.nope = not a.rope_layers[layer]

    def forward(self, x, cos, sin, mask, kv_cache=None, layer=0) -> torch.Tensor:
        return super().forward(x, cos[int(self.nope)], sin[int(self.nope)], mask, kv_cache, layer)


class SmolLM3Transformer(Transformer):
    """transformer.Transformer with SmolLM3's NoPE layers."""

    def __init__(self, config: ModelArgs, attn: str = "sdpa"):
        super().__init__(config, attn)
        self.model.layers = nn.ModuleList(SmolLM3Block(config, i) for i in range(config.num_hidden_layers))

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE table and the identity, stacked: each (2, B, T, 1, rot)."""
        cos, sin = super()._rope(position_ids, dtype)
        return torch.stack([cos, torch.ones_like(cos)]), torch.stack([sin, torch.zeros_like(sin)])
