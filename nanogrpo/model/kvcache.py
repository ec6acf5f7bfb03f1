"""Key/value caches: the sampler's preallocated caches, and the training forward's shared-prompt prefix.

Every cache offers the same two calls to the attention layer, which has one path whatever the cache:
`k, v = cache.update(layer, k, v)` (store this block's keys/values, and return the keys/values `attend` is
to be given) and `y = cache.attend(layer, q, k, v, mask)` (y (B, T, nh, D)): attention over those and over
whatever the cache keeps apart. For `NO_CACHE` (the forward without one), `KVCache` and `PrefixKV`, update
returns every key/value the block attends to and attend is plain attention; `GroupedKVCache`'s update
returns only the completions' own keys/values, and its attend adds each row's prompt keys, which it keeps
once per group.

- `KVCache`: one preallocated buffer for every layer, written in place as tokens are decoded (no autograd).
- `GroupedKVCache`: after the prefill, each prompt's keys/values once for its G completions, plus each
  completion's own; decode attention reads a prompt's keys once per group.
- `StaticGroupedKVCache`: the same with fixed shapes for every decode step: the step's index is a tensor,
  update writes at it and returns the whole buffer, attend masks the keys not yet written.
- `PrefixKV`: the keys/values of the prompts, kept as autograd tensors. The training forward runs each
  prompt once, expands its keys/values to the G completions of its group, then runs only the completion
  tokens against them; gradients from all G completions flow back into the one prompt pass.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from nanogrpo.model.attention import attention


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


class GroupedKVCache:
    """The sampler's cache after the prefill: each prompt's keys/values once, shared by its G completions,
    plus each completion's own keys/values.

    Decode attention then reads a prompt's keys once for the whole group (the query rows of its G
    completions stacked into one matmul) instead of G copies of them: less memory and less traffic for
    long prompts and large groups. The prompts' left padding is given once (`prompt_mask`) and kept as an
    additive bias, so decode steps need no attention mask. Rows may be dropped as completions end
    (`select`); `rows` maps each remaining row to its place among the P*G completions.
    """

    def __init__(
        self, prefix: KVCache, group_size: int, max_new: int, prompt_mask: torch.Tensor | None = None
    ):
        """prompt_mask: None (no padding) or (P, Lp), 1 on the prompts' real tokens, 0 on pads."""
        Lp = prefix.length
        self.pk, self.pv = prefix.k[:, :, :, :Lp], prefix.v[:, :, :, :Lp]  # (layers, P, n_kv, Lp, D)
        layers, P, nkv, _, D = self.pk.shape
        self.G, self.prefix_len, self.length = group_size, Lp, Lp
        # time-major: the keys written so far are one contiguous block of memory per layer, read as a stream
        # (a row-major (n, n_kv, max_new, D) buffer read up to t is half-filled strided blocks: ~2x slower
        # to read on a CPU once the cache no longer fits in its last-level cache)
        self.k = self.pk.new_zeros(layers, max_new, P * group_size, nkv, D)  # (layers, max_new, n, n_kv, D)
        self.v = torch.zeros_like(self.k)
        self.rows: torch.Tensor | None = None  # (n,) index among the P*G completions; None = all, in order
        # added to the scores of the prompts' keys: 0 on real tokens, -inf on pads
        bias = torch.zeros(P, 1, 1, Lp, dtype=self.pk.dtype, device=self.pk.device)  # (P, 1, 1, Lp)
        if prompt_mask is not None:
            assert prompt_mask.shape == (P, Lp), f"prompt_mask {tuple(prompt_mask.shape)} != {(P, Lp)}"
            bias.masked_fill_(~prompt_mask.bool()[:, None, None, :], float("-inf"))
        self.bias = bias.expand(P, nkv, 1, Lp).reshape(P * nkv, 1, Lp)  # (P*n_kv, 1, Lp)

    @property
    def batch(self) -> int:
        return self.k.shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the completions' new k/v (n, n_kv, T, D); return their own keys/values so far, as
        (n, n_kv, t, D) views of the time-major buffer."""
        start = self.length - self.prefix_len
        end = start + k.shape[2]
        assert end <= self.k.shape[1], f"KV cache full: {end} new tokens > {self.k.shape[1]}"
        self.k[layer, start:end] = k.permute(2, 0, 1, 3)
        self.v[layer, start:end] = v.permute(2, 0, 1, 3)
        return self.k[layer, :end].permute(1, 2, 0, 3), self.v[layer, :end].permute(1, 2, 0, 3)

    def select(self, keep: torch.Tensor) -> GroupedKVCache:
        """Only the given rows (e.g. the unfinished completions); the prompts' part is shared, not copied."""
        out = copy.copy(self)
        out.k, out.v = self.k[:, :, keep], self.v[:, :, keep]
        out.rows = keep if self.rows is None else self.rows[keep]
        return out

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """One query per row. q (n, nh, 1, D); k/v (n, n_kv, t, D) from update; mask None or bool
        (n, 1, 1, Lp + t) on top of the prompts' padding. Returns (n, 1, nh, D) in q's dtype: softmax over
        the prompt's keys and the row's own, computed in the cache's dtype."""
        assert q.shape[2] == 1, "a GroupedKVCache serves decode steps (one token per row); prefill a KVCache"
        mask = mask if isinstance(mask, torch.Tensor) else None
        dtype, q = q.dtype, q.to(k.dtype)
        n, nh, _, D = q.shape
        P, nkv, Lp, _ = self.pk.shape[1:]
        kp = self.pk[layer].reshape(P * nkv, Lp, D)  # (P*n_kv, Lp, D)
        vp = self.pv[layer].reshape(P * nkv, Lp, D)
        G, g, rows, t, scale = self.G, nh // nkv, self.rows, k.shape[2], D**-0.5
        # rows (P, G, n_kv, g) <-> groups (P, n_kv, G, g): a prompt's keys meet its G*g query rows at once
        to_groups = lambda x: x.reshape(P, G, nkv, g, -1).transpose(1, 2).reshape(P * nkv, G * g, -1)
        to_rows = lambda x: x.reshape(P, nkv, G, g, -1).transpose(1, 2).reshape(P * G, nkv, g, -1)
        qr = q.reshape(n, nkv, g, D)  # (n, n_kv, g, D)
        q_all = qr
        if rows is not None:  # ended rows were dropped: put the others back in place, zeros elsewhere
            q_all = qr.new_zeros(P * G, nkv, g, D).index_copy_(0, rows, qr)  # (P*G, n_kv, g, D)
        s_prompt = to_rows(torch.baddbmm(self.bias, to_groups(q_all), kp.transpose(1, 2), alpha=scale))
        if rows is not None:
            s_prompt = s_prompt[rows]  # (n, n_kv, g, Lp)
        k_own, v_own = k.reshape(n * nkv, t, D), v.reshape(n * nkv, t, D)  # views of the time-major cache
        s_own = torch.bmm(qr.reshape(n * nkv, g, D), k_own.transpose(1, 2)).view(n, nkv, g, t)
        s = torch.cat([s_prompt, s_own.mul_(scale)], dim=-1)  # (n, n_kv, g, Lp + t)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))  # mask broadcasts over the heads
        p = s.softmax(-1)
        p_prompt = p[..., :Lp]  # (n, n_kv, g, Lp)
        if rows is not None:
            p_prompt = p_prompt.new_zeros(P * G, nkv, g, Lp).index_copy_(0, rows, p_prompt)
        y = to_rows(torch.bmm(to_groups(p_prompt), vp))  # (P*G, n_kv, g, D)
        if rows is not None:
            y = y[rows]
        y = torch.baddbmm(y.reshape(n * nkv, g, D), p[..., Lp:].reshape(n * nkv, g, t), v_own)  # + own values
        return y.view(n, 1, nh, D).to(dtype)  # (n, 1, nh, D)


class StaticGroupedKVCache(GroupedKVCache):
    """A GroupedKVCache whose decode steps all have the same shapes (for a captured decode step).

    The step's index among the completion tokens is a tensor (`set_step`), not the Python length: update
    writes each layer's new keys/values at that index and returns the first `visible` slots of the buffer,
    (n, n_kv, visible, D), and attend masks the keys past the index (-inf scores) instead of slicing them
    off. Rows are never dropped (the caller masks ended rows), and `length` stays the prompt length, so
    nothing the forward reads changes between steps of the same `visible`. The caller raises `visible` in
    a few steps (static_decode.visible_keys: 64, 128, 256, ... slots), so a step reads at most twice the
    keys written, not the whole buffer; each value is one more compile or recording. The masked softmax and
    the longer products round differently from the sliced ones at float32's last bits
    (tests/test_sampling_static.py)."""

    def __init__(self, prefix: KVCache, group_size: int, max_new: int, prompt_mask=None, bucket: int = 1):
        """bucket > 1: the prompts' keys padded up to a multiple of `bucket` tokens (masked: -inf scores, so
        the softmax gives them exact zeros), so that prompts of other lengths give a step the same shapes
        (a compiled step then serves every GRPO step instead of compiling again for each prompt length)."""
        super().__init__(prefix, group_size, max_new, prompt_mask)
        Lp = self.prefix_len
        pad = -Lp % bucket
        if pad:
            self.pk = F.pad(self.pk, (0, 0, 0, pad))  # (layers, P, n_kv, Lb, D)
            self.pv = F.pad(self.pv, (0, 0, 0, pad))
            self.bias = F.pad(self.bias, (0, pad), value=float("-inf"))  # (P*n_kv, 1, Lb)
            self.prefix_len = Lp + pad
        # a buffer of its own per layer, each (max_new, n, n_kv, D): a compiled step writes each in place,
        # where slices of one (layers, ...) buffer are views of one graph input, whose writes inductor turns
        # into a copy of the whole buffer for every layer
        layers, shape = self.k.shape[0], self.k.shape[1:]
        self.k = self.v = None  # the one buffer, freed before the per-layer ones are made
        self.k = [self.pk.new_zeros(shape) for _ in range(layers)]
        self.v = [self.pk.new_zeros(shape) for _ in range(layers)]
        self.own = torch.arange(max_new, device=self.pk.device)  # (max_new,) each own key's step
        self.visible = max_new  # own key slots a step reads: the caller raises it as the steps go on
        self.set_step(torch.zeros(1, dtype=torch.long, device=self.pk.device))

    @property
    def batch(self) -> int:
        return self.k[0].shape[1]

    @property
    def length(self) -> int:
        return self.prefix_len

    @length.setter
    def length(self, value: int) -> None:
        pass  # the forward's bookkeeping: the step lives in the tensor `t`

    def set_step(self, t: torch.Tensor) -> None:
        """The completion token the next forward writes: t (1,) long, on the cache's device (t < visible)."""
        self.t = t  # (1,) the index_put_ index
        # added to the scores of the visible own keys: 0 up to step t, -inf on the ones not yet written
        own = self.own[: self.visible]  # (visible,)
        self.own_bias = torch.zeros_like(own, dtype=self.pk.dtype).masked_fill_(own > self.t, float("-inf"))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new k/v (n, n_kv, 1, D) at step t, in the cache's dtype (a bf16 model's CPU cache is
        float32); return the buffers' first `visible` slots (n, n_kv, visible, D)."""
        if k.dtype != self.pk.dtype:  # fixed for the call: no cast op when the dtypes agree
            k, v = k.to(self.pk.dtype), v.to(self.pk.dtype)
        # index_put_ on the layer's own buffer: written in place by a compiled step too
        self.k[layer].index_put_((self.t,), k.permute(2, 0, 1, 3))
        self.v[layer].index_put_((self.t,), v.permute(2, 0, 1, 3))
        E = self.visible
        return self.k[layer][:E].permute(1, 2, 0, 3), self.v[layer][:E].permute(1, 2, 0, 3)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """GroupedKVCache.attend for every row, the own keys past step t masked by `own_bias` (mask is
        ignored: the forward of a decode step passes none). q (n, nh, 1, D) -> (n, 1, nh, D)."""
        dtype, q = q.dtype, q.to(k.dtype)
        n, nh, _, D = q.shape
        P, nkv, Lp, _ = self.pk.shape[1:]
        kp = self.pk[layer].reshape(P * nkv, Lp, D)  # (P*n_kv, Lp, D)
        vp = self.pv[layer].reshape(P * nkv, Lp, D)
        G, g, T, scale = self.G, nh // nkv, k.shape[2], D**-0.5
        # rows (P, G, n_kv, g) <-> groups (P, n_kv, G, g): a prompt's keys meet its G*g query rows at once
        to_groups = lambda x: x.reshape(P, G, nkv, g, -1).transpose(1, 2).reshape(P * nkv, G * g, -1)
        to_rows = lambda x: x.reshape(P, nkv, G, g, -1).transpose(1, 2).reshape(P * G, nkv, g, -1)
        qr = q.reshape(n, nkv, g, D)  # (n, n_kv, g, D)
        s_prompt = to_rows(torch.baddbmm(self.bias, to_groups(qr), kp.transpose(1, 2), alpha=scale))
        k_own, v_own = k.reshape(n * nkv, T, D), v.reshape(n * nkv, T, D)  # views of the time-major cache
        s_own = torch.baddbmm(self.own_bias, qr.reshape(n * nkv, g, D), k_own.transpose(1, 2), alpha=scale)
        p = torch.cat([s_prompt, s_own.view(n, nkv, g, T)], dim=-1).softmax(-1)  # (n, n_kv, g, Lp + T)
        y = to_rows(torch.bmm(to_groups(p[..., :Lp]), vp))  # (n, n_kv, g, D)
        y = torch.baddbmm(y.reshape(n * nkv, g, D), p[..., Lp:].reshape(n * nkv, g, T), v_own)  # + own values
        return y.view(n, 1, nh, D).to(dtype)  # (n, 1, nh, D)

    def select(self, keep: torch.Tensor) -> GroupedKVCache:
        raise NotImplementedError("a static cache keeps every row: mask ended rows instead")
