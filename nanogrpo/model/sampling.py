"""The sampler: prefill the prompts once, give each sample a cache row of its own, decode every row a token a step.

    gen = generate(model, prompts, group_size=G, max_new_tokens=64, temperature=1.0, generator=gens)

An episode continues its rows from turn to turn instead of reading its history again:

    s = Sampler(model, head, turn)               # inside sampling_weights(...), which gives the head
    logits = s.prefill(prompts, rows)            # each prompt once; row k holds a copy of prompt rows[k]'s keys
    gen = s.decode(logits, max_new, gens, ...)   # turn 1
    logits = s.extend(observations)              # each row's last sampled token and its observation, only
    gen = s.decode(logits, max_new, gens, ...)   # turn 2, and so on

A decode step (`decode_step`) feeds each row's last token (its keys and values written after the row's own,
RowKVCache, below), samples the next from its logits (draw.py: one uniform per row, the log-prob taken before
any filtering) and records it; a row that samples an EOS id has ended and rides along, its tokens pad. Between
steps (every SYNC_EVERY steps when the step is captured) the host checks the stop strings and whether every
row has ended. The cache keeps its shapes from step to step, so the same step runs as it is, compiled, or
recorded as a CUDA graph (--sampling.decode).

The fast paths beside this loop compute the same (tests/test_sampling.py):
- the weights (`sampling_weights`): on the CPU every projection packed with LoRA folded in (packed.py);
  elsewhere LoRA folded into one weight a projection;
- the grouped cache (grouped.py): a prompt's keys once for its G samples, ended rows dropped: the default for
  single completions (--sampling.decode eager), and on fixed shapes under this loop's step (static, compiled,
  graph); it cannot continue an episode's rows, which part after their first turn;
- the step compiled, or recorded once and replayed as a CUDA graph (static_decode.py).
`generate` hands every mode but 'plain' to one call, grouped.generate_fast.

Departures from transformers' `generate`: only the last position of a prefill goes through the LM head (no
[B, T, V] logits), the draw of draw.py, and no logits processors beyond temperature, top-k and top-p.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import torch

from nanogrpo.model.attention import attention
from nanogrpo.model.draw import (
    DecodeState,
    Generation,
    StopCheck,
    draw_uniforms,
    finish,
    record,
    sample_tokens,
)
from nanogrpo.model.kvcache import visible_keys
from nanogrpo.model.packed import folded_lora, packed_weights

SYNC_EVERY = 8  # decode steps between host checks (stop strings, every row ended) of a captured step


def decode_step(model, lm_head, cache, s: DecodeState, u, sample) -> None:
    """One decode step, all its inputs in `s`: token t = s.step of every row through the model (the cache
    writes it after the row's own tokens), token t + 1 sampled with the uniforms u[t + 1] (u (max_new, N, 1),
    None when greedy) and recorded, s.step advanced. The same tensors every step: what a compiled or
    recorded step needs."""
    t = s.step  # (1,)
    tok = s.tokens.index_select(1, t)  # (N, 1) token t, pad for ended rows
    pos = cache.begin_step(t, s.done)  # (N, 1) where each row's token t goes
    h = model(tok, position_ids=pos, kv_cache=cache, return_hidden=True)  # (N, 1, H)
    logits = lm_head(h[:, 0]).float()  # (N, V)
    nxt, lp = sample(logits, None if u is None else u.index_select(0, t + 1)[0])  # (N,), (N,)
    record(s, t + 1, nxt, lp)
    s.step.add_(1)


def decode_loop(model, lm_head, cache, logits, max_new: int, sample, eos_ids, stop_strings, tokenizer, generator,
                P: int, G: int, pad_id: int, temperature: float, decode_mode: str = "eager") -> DecodeState:  # fmt: skip
    """The decode loop: up to max_new tokens for each row of the cache, the first from `logits` (N, V) (the
    prefill's, or an extension's). `generator`: one per prompt (its G rows draw G uniforms a step) or one for
    all; `decode_mode` wraps the step (static_decode.Stepper)."""
    from nanogrpo.model.static_decode import CAPTURED, Stepper

    dev, N = logits.device, logits.shape[0]
    s = DecodeState(
        tokens=torch.full((N, max_new), pad_id, dtype=torch.long, device=dev),
        logps=torch.zeros(N, max_new, dtype=torch.float32, device=dev),
        length=torch.full((N,), max_new, dtype=torch.long, device=dev),
        done=torch.zeros(N, dtype=torch.bool, device=dev),
        eos=torch.tensor(list(eos_ids), dtype=torch.long, device=dev), pad=torch.tensor(pad_id, device=dev),
        step=torch.zeros(1, dtype=torch.long, device=dev),
    )  # fmt: skip
    u = draw_uniforms(generator, P, G, max_new, dev) if temperature > 0 else None  # (max_new, N)
    u = None if u is None else u[:, :, None]  # (max_new, N, 1)
    stops = StopCheck(stop_strings, tokenizer) if stop_strings else None
    record(s, s.step, *sample(logits, None if u is None else u[0]))  # the first token, from `logits`
    captured = decode_mode in CAPTURED  # the fast paths: compiled, or recorded per key bucket (Stepper)
    step = Stepper(decode_step, decode_mode, dev) if captured else lambda *a, key: decode_step(*a)
    every = SYNC_EVERY if captured else 1  # a host sync a step costs a captured step its gain
    made = 1  # tokens sampled so far
    while made < max_new:
        if made % every == 0:
            if stops is not None:
                stops(s, made)
            if bool(s.done.all()):
                break
        cache.visible = cache.keys_for(made, bucketed=captured)  # keys this step reads
        step(model, lm_head, cache, s, u, sample, key=cache.visible)
        made += 1
    if stops is not None:
        stops(s, made)
    return s


class Sampler:
    """Rows that decode together, each with its own cache row and length (RowKVCache, below), continued
    as an episode goes on. `lm_head` (n, H) -> (n, V) comes from sampling_weights; `turn` is the most tokens
    one `decode` samples; `limit` (0: none) the most a row will hold. The cache grows as the rows do (a copy
    of what they hold, its room doubled, at most `limit`)."""

    def __init__(
        self, model, lm_head, turn: int, packed=None, amp: torch.dtype | None = None, limit: int = 0
    ):
        self.model, self.lm_head, self.turn, self.packed, self.amp = model, lm_head, turn, packed, amp
        self.limit = limit
        self.cache: RowKVCache | None = None
        self.pending: list[int] = []  # each row's last sampled token: not yet through the model

    def _forward(self, cache: RowKVCache, chunks: list[list[int]]) -> torch.Tensor:
        """Each row's chunk of new tokens through the model, after the row's own (right-padded into one
        block), the cache grown first if the chunk and a turn after it do not fit; the logits of each chunk's
        last token (B, V)."""
        dev, T = self.model.lm_head_weight.device, max(map(len, chunks))
        if cache.top + T + self.turn > cache.max_len:  # room for the chunk and the turn that follows it
            rows = torch.arange(len(chunks), device=dev)
            room = max(2 * cache.max_len, cache.top + T + self.turn)
            cache = self.cache = cache.rows(rows, min(room, self.limit) if self.limit else room)
        ids = torch.tensor([c + [0] * (T - len(c)) for c in chunks], device=dev)  # (B, T)
        new = torch.tensor([len(c) for c in chunks], device=dev)  # (B,)
        cache.visible = min(cache.top + T, cache.max_len)
        pos = cache.begin(new, T)  # (B, T)
        h = self.model(ids, position_ids=pos, kv_cache=cache, return_hidden=True)  # (B, T, H)
        cache.top = int(cache.lengths.max())
        return self.lm_head(h[torch.arange(len(chunks), device=dev), new - 1]).float()  # (B, V)

    def prefill(self, prompts: list[list[int]], rows: Sequence[int]) -> torch.Tensor:
        """Run each prompt once (the tokens they all start with once for all: a system prompt, a game's
        rules); row k then holds a copy of prompt rows[k]'s keys. The logits of each row's first new token
        (N, V)."""
        room, dtype = max(map(len, prompts)) + self.turn, cache_dtype(self.model, self.amp)
        common = len(os.path.commonprefix(prompts)) if len(prompts) > 1 else 0
        common = min(common, min(map(len, prompts)) - 1)  # each prompt keeps a token: its logits
        if common >= 16:  # the shared start once, then each prompt's rest after a copy of it
            self.cache = RowKVCache.empty(self.model, 1, room, dtype)
            self._forward(self.cache, [prompts[0][:common]])
            self.cache = self.cache.rows(
                torch.zeros(len(prompts), dtype=torch.long, device=self.cache.lengths.device)
            )
            prompts = [p[common:] for p in prompts]
        else:
            self.cache = RowKVCache.empty(self.model, len(prompts), room, dtype)
        logits = self._forward(self.cache, prompts)  # (P, V)
        index = torch.tensor(list(rows), device=logits.device)  # (N,)
        self.cache, self.pending = self.cache.rows(index, self.limit), []  # room for all they will hold
        return logits.index_select(0, index)  # (N, V)

    def extend(self, chunks: list[list[int]]) -> torch.Tensor:
        """Each row's pending token, then chunks[k] (an observation), through the model; no other token is
        computed again. The logits of each row's next token (N, V)."""
        assert self.cache is not None and len(chunks) == len(self.pending), "decode before extending"
        return self._forward(self.cache, [[p, *c] for p, c in zip(self.pending, chunks)])

    def keep(self, rows: Sequence[int]) -> None:
        """Only these rows go on (the episodes still running), in this order."""
        assert self.cache is not None
        if list(rows) != list(range(len(self.pending))):
            self.cache = self.cache.rows(torch.tensor(list(rows), device=self.cache.lengths.device))
            self.pending = [self.pending[k] for k in rows]
        if self.packed is not None:  # MKL's packed weights serve one row count: packed again when it pays
            self.packed.shrunk(len(rows), steps_left=self.turn)

    def decode(self, logits, max_new: int, generator, *, group: int = 1, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, eos_ids=(), stop_strings=(), tokenizer=None, pad_id: int = 0,
               decode_mode: str = "eager") -> Generation:  # fmt: skip
        """Up to max_new tokens for every row, the first from `logits` (N, V); `generator`: one per `group`
        consecutive rows (an episode's: one a row), or one for all. Afterwards each row's cache holds its
        tokens but the last, which the next `extend` feeds first."""
        assert self.cache is not None
        start = self.cache.lengths.clone()  # (N,)
        sample = lambda z, u: sample_tokens(z, temperature, top_p, top_k, None, u)  # noqa: E731
        N = logits.shape[0]
        s = decode_loop(self.model, self.lm_head, self.cache, logits, max_new, sample, eos_ids, stop_strings,
                        tokenizer, generator, N // group, group, pad_id, temperature, decode_mode)  # fmt: skip
        self.cache.lengths.copy_(start + s.length - 1)  # what went through the model, whatever the loop wrote
        self.cache.top = int(self.cache.lengths.max())
        self.pending = s.tokens.gather(1, (s.length - 1)[:, None]).squeeze(1).tolist()  # (N,) last tokens
        return finish(s.tokens, s.logps, s.length, s.done, pad_id)


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


@torch.inference_mode()
def generate(
    model, prompts: list[list[int]], *, group_size: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
    top_p: float = 1.0, top_k: int = 0, eos_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
    tokenizer=None, generator=None, pad_id: int = 0, autocast: torch.dtype | None = None, fold_lora: bool = True,
    decode: str = "eager",
) -> Generation:  # fmt: skip
    """Sample `group_size` completions of each prompt (token id lists); see Generation for the layout.

    `generator`: one torch.Generator for the batch, or one per prompt: then a prompt's completions depend
    only on its own generator, not on which other prompts share the batch (what lets torchrun ranks
    reproduce a single-process run). `autocast`: the compute dtype of a float32 model (a full fine-tune's
    master weights); on an accelerator the sampler then runs in it (its cache too), from the trainer's own
    numerics; on the CPU the packed float32 weights are faster. `fold_lora`: where nothing is packed (a GPU),
    each LoRA layer folded into one weight for the call (False runs the adapters as the trainer does).

    `decode`: 'plain' (this file's loop, a cache row a sample), 'eager' (the grouped cache, ended rows dropped:
    grouped.py, the default), 'static' (this loop's step over the grouped cache on fixed shapes), 'compiled'
    (that step through torch.compile), 'graph' or 'compiled-graph' (recorded once per key bucket as a CUDA
    graph and replayed; off CUDA they run as 'static' and 'compiled'). All draw the same tokens from the same
    generators, log-probs to float32 rounding.
    """
    from nanogrpo.model.grouped import generate_fast
    from nanogrpo.model.static_decode import check_generate

    check_generate(prompts, generator, group_size, max_new_tokens, temperature, top_p, top_k, stop_strings,
                   tokenizer, decode)  # fmt: skip
    G, new = group_size, max_new_tokens
    with sampling_weights(model, len(prompts) * G, fold_lora, autocast) as (head, packed, amp):
        if decode != "plain":  # the fast paths (grouped.py): a prompt's keys once for its G rows
            return generate_fast(model, head, packed, prompts, G, new, temperature, top_p, top_k, eos_ids,
                                 stop_strings, tokenizer, generator, pad_id, amp, decode, decode_loop)  # fmt: skip
        sampler = Sampler(model, head, new, packed, amp)
        logits = sampler.prefill(prompts, [i for i in range(len(prompts)) for _ in range(G)])
        return sampler.decode(logits, new, generator, group=G, temperature=temperature, top_p=top_p, top_k=top_k,
                              eos_ids=eos_ids, stop_strings=stop_strings, tokenizer=tokenizer, pad_id=pad_id,
                              decode_mode=decode)  # fmt: skip


def cache_dtype(model, amp=None) -> torch.dtype | None:
    """The sampler cache's dtype: on the CPU a bf16 model keeps a float32 cache (attention's float32 kernels
    are the faster ones there); elsewhere autocast's dtype, else the weights'."""
    W = model.lm_head_weight
    return torch.float32 if W.device.type == "cpu" and W.dtype == torch.bfloat16 else amp


@contextlib.contextmanager
def sampling_weights(model, rows: int, fold_lora: bool = True, autocast: torch.dtype | None = None):
    """What the sampler computes with, for the block: eval mode (no LoRA dropout); on the CPU every projection
    and the LM head packed with LoRA folded in (packed.py); elsewhere, with `fold_lora`, each LoRA layer folded
    into one weight; on an accelerator, `autocast`'s dtype. Yields (the LM head (n, H) -> (n, V), the packed
    weights or None, the autocast dtype or None)."""
    was_training = model.training
    model.eval()
    amp = autocast if autocast is not None and model.lm_head_weight.device.type != "cpu" else None
    W = model.lm_head_weight  # (V, H)
    try:
        with (
            packed_weights(model, batch_hint=rows) as packed,
            folded_lora(model, enabled=fold_lora and packed is None),  # packing folds LoRA itself
            torch.autocast(W.device.type, dtype=amp, enabled=amp is not None),
        ):
            yield (packed.head if packed is not None else (lambda h: h @ W.T)), packed, amp
    finally:
        model.train(was_training)
