"""The sampler's fast path for G completions of each prompt, the single-turn default: a prompt's keys and values
once for its whole group, and ended completions dropped from the batch.

The plain loop (sampling.generate) gives each completion a cache row of its own, holding a copy of its
prompt's keys. Here the G completions of a prompt share them (GroupedKVCache): a decode step reads a
prompt's keys once for its whole group, the query rows of its G completions stacked into one matmul, which
saves memory and memory traffic for long prompts and large groups. The prompts are left-padded into one batch (an attention mask
hides the pads; positions count real tokens only) and prefilled once (`prefill_grouped`).

- `generate_grouped` (--sampling.decode eager): the eager loop over a GroupedKVCache. A row that has hit an
  EOS id or a stop string rides along until a quarter of the batch has ended; then the ended rows are dropped
  from the batch and the cache, so long completions do not pay for finished ones.
- `StaticGroupedKVCache` (static, compiled, graph): the same cache on fixed shapes, for row_sampler.py's one
  decode step, uncompiled, compiled or recorded as a CUDA graph (static_decode.py).
- `generate_fast`: what fast.sampler.generate calls for every --sampling.decode but 'plain'.

What they compute is what the plain loop computes, to float32 rounding (tests/test_sampling.py: the same
tokens from the same generators). They cannot continue a row: a prompt's keys are shared by its G rows, and
an episode's rows part after their first turn, so episodes sample with the row sampler (row_sampler.py).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from nanogrpo.model.fast.kvcache import visible_keys
from nanogrpo.model.fast.row_sampler import DecodeState, cache_dtype, decode_loop
from nanogrpo.model.sampling import Generation, StopCheck, finish, sample_tokens
from nanogrpo.model.transformer import KVCache


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
    a few steps (kvcache.visible_keys: 64, 128, 256, ... slots), so a step reads at most twice the
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

    def keys_for(self, made: int, bucketed: bool = True) -> int:
        """The own key slots the step after `made` sampled tokens reads (visible_keys: always a bucket)."""
        return visible_keys(made, self.own.shape[0])

    def begin_step(self, t: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """The row sampler's decode step (row_sampler.decode_step): token t of every row, ended or not,
        written at own slot t; returns its positions (N, 1): each row's prompt length (`next_pos`, set after the prefill)
        + t."""
        self.set_step(t)
        return self.next_pos + t


def prefill_grouped(model, lm_head, prompts, G: int, max_new: int, pad_id: int, amp=None, cache_cls=None):
    """Run the P prompts once, left-padded into one batch, and expand them to their groups.

    Returns the logits of each row's first new token (N, V) float32, a GroupedKVCache (the prompts' keys
    and values once, shared by their G completions, their padding kept, so decode steps pass no attention
    mask) and each row's position of the first new token (N, 1). `amp`: the autocast dtype, the cache's;
    `cache_cls`: GroupedKVCache (None), or StaticGroupedKVCache for the row sampler's fixed-shape decode
    steps (row_sampler.decode_step).
    """
    cache_cls = cache_cls or GroupedKVCache
    dev = model.lm_head_weight.device
    P = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=dev)  # (P,)
    L = int(lens.max())
    # left padding: real tokens end at column L-1 for every row, so each decode step appends one column
    ids = torch.full((P, L), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = torch.tensor(p, dtype=torch.long)
    ids = ids.to(dev)  # (P, L)
    attn = None
    if bool((lens < L).any()):
        attn = (torch.arange(L, device=dev)[None, :] >= (L - lens)[:, None]).long()  # (P, L) 0 on pads
        pos = (attn.cumsum(-1) - 1).clamp_(min=0)  # (P, L) real tokens count from 0
    else:
        pos = torch.arange(L, device=dev).expand(P, L)
    cache = model.new_kv_cache(P, L, dtype=cache_dtype(model, amp))
    h = model(ids, position_ids=pos, attention_mask=attn, kv_cache=cache, return_hidden=True)  # (P, L, H)
    logits = lm_head(h[:, -1]).float()  # (P, V) only the last position needs the LM head
    grouped = cache_cls(cache, G, max_new, prompt_mask=attn)
    return logits.repeat_interleave(G, 0), grouped, lens.repeat_interleave(G)[:, None]


def generate_grouped(
    model, packed, prompts, G, max_new, temperature, top_p, top_k, eos_ids, stop_strings, tokenizer, generator, pad_id,
    amp=None,
) -> Generation:  # fmt: skip
    """fast.sampler.generate with decode='eager': the grouped cache, ended rows dropped once a quarter of the
    batch has ended (the whole batch's forward otherwise runs for them), one host check a step."""
    W = model.lm_head_weight  # (V, H)
    lm_head = packed.head if packed is not None else (lambda h: h @ W.T)  # (n, H) -> (n, V)
    dev = W.device
    N = len(prompts) * G
    logits, cache, next_pos = prefill_grouped(model, lm_head, prompts, G, max_new, pad_id, amp)  # (N, V), ...

    s = DecodeState.start(N, max_new, eos_ids, pad_id, dev)  # each output row's tokens, length, end
    tokens, logps, length, ended, eos = s.tokens, s.logps, s.length, s.done, s.eos
    stops = StopCheck(stop_strings, tokenizer) if stop_strings else None
    check_end = stops is not None or len(eos) > 0
    # the batch shrinks as completions end: `rows` maps batch position -> output row (None: the identity),
    # `done` marks rows that have ended but still ride along until dropping them is worth a cache copy
    rows: torch.Tensor | None = None
    done = torch.zeros(N, dtype=torch.bool, device=dev)  # (n,)

    per_prompt = isinstance(generator, (list, tuple)) and temperature > 0
    for t in range(max_new):
        u = None
        if per_prompt:
            # G uniforms per prompt and step whatever has ended, so each prompt's stream stays in step
            u = torch.cat([torch.rand(G, generator=g, device=dev) for g in generator])[:, None]  # (N, 1)
            u = u if rows is None else u[rows]  # (n, 1)
        tok, lp = sample_tokens(logits, temperature, top_p, top_k, None if per_prompt else generator, u)
        if rows is None:
            tokens[:, t], logps[:, t] = tok, lp
        else:
            tokens[rows, t], logps[rows, t] = tok, lp
        if check_end:
            if len(eos):
                hit = torch.isin(tok, eos) & ~done  # (n,)
                out = hit.nonzero().squeeze(1) if rows is None else rows[hit]
                length[out], ended[out] = t + 1, True
            if stops is not None:
                stops(tokens, length, ended, t + 1)  # ends the rows whose text now holds a stop string
            new = (ended if rows is None else ended[rows]) & ~done  # (n,)
            if bool(new.any()):
                done |= new
                n_done = int(done.sum())
                if n_done == len(done):
                    break
                if 4 * n_done >= len(done):  # a quarter of the batch is idle: drop the ended rows
                    keep = (~done).nonzero().squeeze(1)  # (n',)
                    cache = cache.select(keep)
                    rows = keep if rows is None else rows[keep]
                    tok, done, next_pos = tok[keep], done[keep], next_pos[keep]
                    if packed is not None:
                        packed.shrunk(len(keep), steps_left=max_new - 1 - t)  # forward passes still to run
        if t == max_new - 1:
            break  # the last token needs no forward pass
        h = model(tok[:, None], position_ids=next_pos + t, kv_cache=cache, return_hidden=True)  # (n, 1, H)
        logits = lm_head(h[:, 0]).float()  # (n, V)

    return finish(tokens, logps, length, ended, pad_id)


def generate_fast(
    model, head, packed, prompts, G, new, temperature, top_p, top_k, eos_ids, stop_strings, tokenizer, generator,
    pad_id, amp, decode: str,
) -> Generation:  # fmt: skip
    """fast.sampler.generate's fast paths, in its sampling_weights block: 'eager' the grouped loop, ended rows
    dropped (generate_grouped); 'static', 'compiled', 'graph', 'compiled-graph' the row sampler's decode step
    over the grouped cache, kept on fixed shapes (row_sampler.decode_loop, static_decode.py)."""
    from nanogrpo.model.fast.static_decode import COMPILED, PROMPT_BUCKET

    if decode == "eager":  # the single-turn default
        return generate_grouped(model, packed, prompts, G, new, temperature, top_p, top_k, eos_ids, stop_strings,
                                tokenizer, generator, pad_id, amp)  # fmt: skip
    bucket = PROMPT_BUCKET if decode in COMPILED else 1  # compiled: one graph serves many prompt lengths
    cache_cls = lambda *a, **k: StaticGroupedKVCache(*a, bucket=bucket, **k)  # noqa: E731
    logits, cache, next_pos = prefill_grouped(model, head, prompts, G, new, pad_id, amp, cache_cls)
    cache.next_pos = next_pos  # (N, 1) each row's first new position
    sample = lambda z, u: sample_tokens(z, temperature, top_p, top_k, None, u)  # noqa: E731
    s = decode_loop(model, head, cache, logits, new, sample, eos_ids, stop_strings, tokenizer, generator,
                    len(prompts), G, pad_id, temperature, decode)  # fmt: skip
    return finish(s.tokens, s.logps, s.length, s.done, pad_id)
