"""The row sampler: each sample a cache row of its own, continued from turn to turn, and the decode loop
whose one step runs as it is, compiled, or recorded as a CUDA graph.

An episode continues its rows from turn to turn instead of reading its history again (envs/episode.py):

    s = Sampler(model, head, turn)               # in fast.sampler.sampling_weights(...), which gives the head
    logits = s.prefill(prompts, rows)            # each prompt once; row k a copy of prompt rows[k]'s keys
    gen = s.decode(logits, max_new, gens, ...)   # turn 1
    logits = s.extend(observations)              # each row's last sampled token and its observation, only
    gen = s.decode(logits, max_new, gens, ...)   # turn 2, and so on

A decode step (`decode_step`) feeds each row's last token (its keys and values written after the row's own,
RowKVCache, below), samples the next from its logits (sampling.sample_tokens) and records it
(`record`); a row that samples an EOS id has ended and rides along, its tokens pad. Between steps
(every SYNC_EVERY steps when the step is captured) the host checks the stop strings and whether every row
has ended. The state of the loop lives in tensors of fixed shape (`DecodeState`, the cache, the
uniforms), so the same step runs as it is, compiled, or recorded as a CUDA graph (--sampling.decode
static|compiled|graph, static_decode.py); the grouped cache's fixed-shape modes (grouped.py) run this loop
too.

What it computes is the plain loop's (sampling.generate; an episode's, sampling.Episodes), to float32
rounding: the same tokens from the same generators (tests/test_sampling.py), and a continued row the same as
its history prefilled again.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanogrpo.model.fast.kvcache import visible_keys
from nanogrpo.model.sampling import Generation, StopCheck, draw_uniforms, finish, sample_tokens
from nanogrpo.model.transformer import attention

SYNC_EVERY = 8  # decode steps between host checks (stop strings, every row ended) of a captured step


@dataclass
class DecodeState:
    """The tensors one decode step reads and writes, all of fixed shape for the whole call."""

    tokens: torch.Tensor  # (N, max_new) long, the sampled tokens (pad after a row's end)
    logps: torch.Tensor  # (N, max_new) float32, their sampler log-probs (0 after the end)
    length: torch.Tensor  # (N,) long, tokens up to and including the end (max_new while running)
    done: torch.Tensor  # (N,) bool, the row has ended (EOS or stop string)
    eos: torch.Tensor  # (E,) long, the EOS ids
    pad: torch.Tensor  # () long, the pad id
    step: torch.Tensor  # (1,) long, t: the completion token the next step feeds (it then samples token t + 1)

    @classmethod
    def start(cls, N: int, max_new: int, eos_ids: Sequence[int], pad_id: int, device) -> DecodeState:
        """N rows, nothing sampled yet: every token pad, every row running, at step 0."""
        return cls(
            tokens=torch.full((N, max_new), pad_id, dtype=torch.long, device=device),
            logps=torch.zeros(N, max_new, dtype=torch.float32, device=device),
            length=torch.full((N,), max_new, dtype=torch.long, device=device),
            done=torch.zeros(N, dtype=torch.bool, device=device),
            eos=torch.tensor(list(eos_ids), dtype=torch.long, device=device),
            pad=torch.tensor(pad_id, device=device),
            step=torch.zeros(1, dtype=torch.long, device=device),
        )


def record(s: DecodeState, t: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor) -> None:
    """Write step t's (1,) tokens (N,) and log-probs (N,), ended rows as pad and 0 (what the next step
    feeds); mark the rows that hit an EOS id now. sampling.generate's rule, on tensors a captured step keeps."""
    tok = torch.where(s.done, s.pad, tok)  # (N,)
    s.tokens[:, t] = tok[:, None]  # an index_put_: in place when compiled (see grouped.StaticGroupedKVCache)
    s.logps[:, t] = lp.masked_fill(s.done, 0.0)[:, None]
    if len(s.eos):
        # a compare with each EOS id, not torch.isin: for more rows than a few EOS ids CUDA's isin sorts and
        # calls unique(), which reads a size back to the host (no graph can hold that)
        new = (tok[:, None] == s.eos).any(-1) & ~s.done  # (N,)
        s.length.copy_(torch.where(new, t + 1, s.length))
        s.done.logical_or_(new)


def cache_dtype(model, amp=None) -> torch.dtype | None:
    """The fast samplers' cache dtype: on the CPU a bf16 model keeps a float32 cache (attention's float32
    kernels are the faster ones there); elsewhere autocast's dtype, else the weights'."""
    W = model.lm_head_weight
    return torch.float32 if W.device.type == "cpu" and W.dtype == torch.bfloat16 else amp


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
    from nanogrpo.model.fast.static_decode import CAPTURED, Stepper

    dev, N = logits.device, logits.shape[0]
    s = DecodeState.start(N, max_new, eos_ids, pad_id, dev)
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
                stops(s.tokens, s.length, s.done, made)
            if bool(s.done.all()):
                break
        cache.visible = cache.keys_for(made, bucketed=captured)  # keys this step reads
        step(model, lm_head, cache, s, u, sample, key=cache.visible)
        made += 1
    if stops is not None:
        stops(s.tokens, s.length, s.done, made)
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
        """A decode step (decode_step): each row's next token after its own; an ended row's into the
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
