"""The fast paths' key/value caches: the training forward's shared-prompt prefix, and the key slots a
fixed-shape decode step reads. (The model's own cache is transformer.KVCache; the row sampler's, a row a
sample, row_sampler.RowKVCache; the grouped sampler's, grouped.GroupedKVCache.)

A cache offers two calls to the attention layer: `k, v = cache.update(layer, k, v)` (store this block's
keys/values, and return the keys/values `attend` is to be given) and `y = cache.attend(layer, q, k, v, mask)`
(y (B, T, nh, D)): attention over those and over whatever the cache keeps apart.

- `PrefixKV`: the keys/values of the prompts, kept as autograd tensors. The training forward runs each
  prompt once, expands its keys/values to the G completions of its group, then runs only the completion
  tokens against them; gradients from all G completions flow back into the one prompt pass.
- `visible_keys`: how many key slots a fixed-shape (compiled or recorded) decode step reads.
"""

from __future__ import annotations

import torch

from nanogrpo.model.transformer import attention

MIN_VISIBLE = 64  # key slots a captured step reads at the least; then 128, 256, ... (visible_keys)


def visible_keys(made: int, limit: int) -> int:
    """The key slots a fixed-shape step reads when `made` may be written: MIN_VISIBLE, doubled until it holds
    them, at most `limit`. A step then reads at most about twice the keys written, not the whole buffer
    (which made a 256-token step slower than the eager loop's on a CPU), and the few values each cost one
    compile (--sampling.decode compiled) or recording (graph) per call."""
    visible = MIN_VISIBLE
    while visible < made:
        visible *= 2
    return min(visible, limit)


class PrefixKV:
    """Per-layer keys/values (B, n_kv, S, D) of a prefix, as autograd tensors (nothing written in place).

    Two modes. Recording (a fresh PrefixKV): a forward over the prefix stores each layer's k/v; a re-run of
    a layer under activation checkpointing stores its recomputed k/v again, which changes nothing. Frozen
    (from `expand`): a forward over the next tokens attends to the prefix + its own keys and stores nothing,
    so one prefix serves any number of such forwards.
    """

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0  # the prefix length once recorded (the model's forward sets it)
        self.frozen = False

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v (B, n_kv, T, D) of the current tokens -> all keys/values they attend to (B, n_kv, S, D)."""
        if self.frozen:
            return torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        return attention(q, k, v, mask)  # (B, T, nh, D)

    def expand(self, rows: torch.Tensor) -> PrefixKV:
        """A frozen prefix whose row i is row rows[i] of this one (prompt -> its completions); differentiable:
        the gradients of the rows that share a prompt add up in the prompt's keys/values."""
        assert all(k is not None for k in self.k), "record the prefix (run the model over it) before expand"
        out = PrefixKV(len(self.k))
        out.k = [k.index_select(0, rows) for k in self.k]  # each (n, n_kv, S, D)
        out.v = [v.index_select(0, rows) for v in self.v]
        out.length, out.frozen = self.length, True
        return out
