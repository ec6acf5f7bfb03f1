"""Key/value caches: the sampler's, and the training forward's shared-prompt prefix.

Every cache offers the same two calls to the attention layer, which has one path whatever the cache:
`k, v = cache.update(layer, k, v)` (store this block's keys/values, and return the keys/values `attend` is
to be given) and `y = cache.attend(layer, q, k, v, mask)` (y (B, T, nh, D)): attention over those and over
whatever the cache keeps apart.

- `RowKVCache`: the sampler's plain cache. Every row has its own keys/values and its own length, so rows of
  any length decode together, and a row takes more tokens later (an episode's next observation) without
  recomputing what it holds. The positions a forward writes and the keys each query sees follow from the
  lengths (`begin`); the tensors keep one shape from step to step, so the decode step can be compiled or
  recorded as a CUDA graph.
- `KVCache`: one preallocated buffer for every layer, rows left-padded to one length, written in place as
  tokens come (the grouped fast path's prefill, model/grouped.py, whose caches share a prompt's keys).
- `PrefixKV`: the keys/values of the prompts, kept as autograd tensors. The training forward runs each
  prompt once, expands its keys/values to the G completions of its group, then runs only the completion
  tokens against them; gradients from all G completions flow back into the one prompt pass.
"""

from __future__ import annotations

import torch

from nanogrpo.model.attention import attention

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


class NoCache:
    """A forward without a cache: nothing stored, plain attention over the block's own keys."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        return attention(q, k, v, mask)  # (B, T, nh, D)


NO_CACHE = NoCache()  # stateless: one instance serves every forward


class KVCache:
    """Preallocated keys and values for every layer, k/v (L, B, n_kv, max_len, D), and the filled length."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int = 0):
        self.k, self.v, self.length = k, v, length

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new k/v (B, n_kv, T, D) after the filled part; return all keys/values so far."""
        end = self.length + k.shape[2]
        assert end <= self.max_len, f"KV cache full: {end} > max_len {self.max_len}"
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, n_kv, S, D)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        return attention(q, k, v, mask)  # (B, T, nh, D)

    def select(self, rows: torch.Tensor) -> KVCache:
        """A new cache holding only the given batch rows (e.g. the unfinished sequences)."""
        return KVCache(self.k[:, rows], self.v[:, rows], self.length)


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


class RowKVCache:
    """Each row's own keys/values, per layer k/v (max_len + 1, B, n_kv, D), and its length (B,): the tokens it
    holds, at positions 0 .. length - 1 (the positions RoPE counts too). The last slot is scratch that no
    query sees: a forward of rows with fewer new tokens than others writes their pads there.

    Time-major: the keys the rows hold are one block of memory per layer, which a decode step reads as a
    stream (attention reads them through a (B, n_kv, S, D) view), and which `rows` copies in one pass. Each
    layer has a buffer of its own: a compiled step writes each in place (slices of one buffer would be views
    of one graph input, which inductor copies whole at every write)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], lengths: torch.Tensor):
        self.k, self.v, self.lengths = k, v, lengths  # per layer (max_len + 1, B, n_kv, D); (B,) long
        self.top = int(lengths.max())  # on the host: the longest row (an upper bound as rows decode)
        self.visible = self.top  # key slots the next forward reads: set before it (`begin` reads it)

    @classmethod
    def empty(cls, model, batch: int, max_len: int, dtype: torch.dtype | None = None) -> RowKVCache:
        c, w = model.config, model.lm_head_weight
        shape = (max_len + 1, batch, c.num_key_value_heads, c.head_dim)
        k = [torch.zeros(shape, dtype=dtype or w.dtype, device=w.device) for _ in range(c.num_hidden_layers)]
        v = [torch.zeros_like(x) for x in k]
        return cls(k, v, torch.zeros(batch, dtype=torch.long, device=w.device))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[0] - 1

    @property
    def length(self) -> int:
        return 0  # Transformer.forward's bookkeeping: rows keep their own lengths, and positions are given

    @length.setter
    def length(self, value: int) -> None:
        pass

    def begin(self, new: torch.Tensor, T: int) -> torch.Tensor:
        """Before a forward of T token columns, `new` (B,) of them real in each row (the rest pads): where they
        are written (after each row's own tokens; pads into the scratch slot), which keys each query sees (its
        row's, up to itself, among the first `visible`), the rows' new lengths. Returns the columns' positions
        (B, T). Nothing on the host changes: a compiled or recorded step calls it."""
        _, B, nkv, D = self.k[0].shape
        cols = torch.arange(T, device=self.lengths.device)  # (T,)
        pos = self.lengths[:, None] + cols  # (B, T)
        slot = torch.where(cols < new[:, None], pos, self.max_len)  # (B, T) pads into the scratch slot
        self.index = slot.T[:, :, None, None].expand(T, B, nkv, D)  # where update writes k/v
        keys = torch.arange(self.visible, device=pos.device)  # (S,)
        self.mask = (keys <= pos[:, :, None])[:, None]  # (B, 1, T, S)
        self.lengths.add_(new)
        return pos

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new k/v (B, n_kv, T, D) where `begin` said; return the first `visible` slots as
        (B, n_kv, S, D) views."""
        dtype = self.k[layer].dtype
        self.k[layer].scatter_(0, self.index, k.permute(2, 0, 1, 3).to(dtype))
        self.v[layer].scatter_(0, self.index, v.permute(2, 0, 1, 3).to(dtype))
        S = self.visible
        return self.k[layer][:S].permute(1, 2, 0, 3), self.v[layer][:S].permute(1, 2, 0, 3)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        return attention(q, k, v, self.mask)  # (B, T, nh, D); the forward's own mask is for other caches

    def begin_step(self, t: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """A decode step (sampling.decode_step): each row's next token after its own; an ended row's into the
        scratch slot, its length kept. Returns the positions (B, 1)."""
        return self.begin((~done).long(), 1)

    def keys_for(self, made: int, bucketed: bool = False) -> int:
        """The key slots the decode step after `made` sampled tokens reads: every row's own up to its newest
        (at most top + made); a compiled or recorded step reads a bucket of them (visible_keys), so that only
        a few shapes occur."""
        need = self.top + made
        return visible_keys(need, self.max_len) if bucketed else min(need, self.max_len)

    def rows(self, index: torch.Tensor, max_len: int = 0) -> RowKVCache:
        """A new cache whose row i is row index[i] of this one, with room for `max_len` tokens (0: as many as
        this one): a prompt's row repeated for its G samples, the rows of the episodes still running, more
        room for the next turn. One copy of the slots the rows hold; the others zero."""
        max_len, n = max_len or self.max_len, self.top

        def pick(x: torch.Tensor) -> torch.Tensor:
            y = x.new_empty(max_len + 1, len(index), *x.shape[2:])  # (max_len + 1, B', n_kv, D)
            torch.index_select(x[:n], 1, index, out=y[:n])
            y[n:].zero_()  # what no row holds yet: finite, since masked keys still meet a 0 weight
            return y

        return RowKVCache(
            [pick(x) for x in self.k], [pick(x) for x in self.v], self.lengths.index_select(0, index)
        )
