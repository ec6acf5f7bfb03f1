"""Two RoPE tables, for the families whose sliding-window ('local') layers rotate with a base of their own
(Gemma 3: gemma3.py, OLMo 3: olmo3.py): the global table (transformer.Transformer._rope: the full-attention
layers' base and scaling) and the local one (`rope_local_theta`, no scaling), stacked (2, B, T, 1, rot); a
block takes its own, `tables[int(block.local)]`."""

from __future__ import annotations

from dataclasses import replace

import torch

from nanogrpo.model.rope import rope_inv_freq
from nanogrpo.model.transformer import Transformer, rope_tables


class LocalRope(Transformer):
    """transformer.Transformer whose `_rope` gives the global and the local table, stacked."""

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super()._rope(position_ids, dtype)  # each (B, T, 1, rot)
        key = ("local", position_ids.device)
        if key not in self._rope_cache:  # plain RoPE at the local base (rope.py)
            local = replace(self.config, rope_theta=self.config.rope_local_theta, rope_scaling={})
            inv_freq, scale = rope_inv_freq(local, 0)  # (rot/2,), 1.0
            self._rope_cache[key] = (inv_freq.to(position_ids.device), scale)
        local_cos, local_sin = rope_tables(position_ids, *self._rope_cache[key], dtype)
        return torch.stack([cos, local_cos]), torch.stack([sin, local_sin])
