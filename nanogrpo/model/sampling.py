"""The sampler: G completions of each prompt, a token a step, and the rules every decode loop shares.

    gen = generate(model, prompts, group_size=G, max_new_tokens=64, temperature=1.0, generator=gens)

`generate` is the plain loop, the one --plain runs: the prompts left-padded into one block and run once
(their pads hidden by the attention mask), each prompt's keys copied to the cache rows of its G samples;
then, a step at a time, every row samples a token from its last logits and feeds it through the model, until
every row has ended or has max_new_tokens. It runs the weights as they are: LoRA as its own forward computes
it.

The rules of a draw, which the fast paths (model/fast/) follow too:
- One uniform per row and step, from the row's own generator (`draw_uniforms`: per prompt, G per step, in the
  same order whatever has ended), so a row's sample depends only on its generator, not on the rows batched
  with it: a torchrun rank and a resumed run draw the same.
- softmax(logits / temperature), then top-k and top-p (`sample_filtered`), then the inverse CDF at the row's
  uniform (`_draw`).
- The log-prob kept is the sampled token's under softmax(logits / temperature) in float32, taken *before*
  top-k / top-p filtering (softmax(logits) when greedy): what the trainer compares its own against. GRPO
  refuses top-k / top-p, whose samples come from a distribution the loss does not see (docs/KL.md).
- A row ends at an EOS id or at the token that completes a stop string (`StopCheck`, on the host); its text
  ends right after the stop string (`finish_text`). `finish` makes a loop's records a Generation.

The fast paths (model/fast/sampler.py's `generate`, the default) draw the same tokens (tests/test_sampling.py):
packed weights with LoRA folded, a prompt's keys once for its G samples with ended rows dropped, a decode step
compiled or replayed as a CUDA graph, and the row sampler that continues an episode's rows.

Departures from transformers' `generate`: only the last position of a prefill goes through the LM head (no
[B, T, V] logits); one uniform per row through the CDF of the kept tokens, with top-k and top-p on a partial
sort, not K Gumbel noises and a full-vocabulary mask (an order of magnitude faster on a CPU); no logits
processors beyond temperature, top-k and top-p.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@torch.inference_mode()
def generate(
    model, prompts: list[list[int]], *, group_size: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
    top_p: float = 1.0, top_k: int = 0, eos_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
    tokenizer=None, generator=None, pad_id: int = 0, autocast: torch.dtype | None = None,
) -> Generation:  # fmt: skip
    """Sample `group_size` completions of each prompt (token id lists), the plain loop (module docstring); see
    Generation for the layout. `generator`: one torch.Generator per prompt (a prompt's completions then
    depend only on it), or one for all; none is drawn from when `temperature` is 0 (greedy). `autocast`: a
    float32 model's compute dtype on an accelerator (the cache's too), as the trainer's."""
    P, G, T = len(prompts), group_size, max_new_tokens
    draw = Draw(temperature, top_p, top_k, tuple(eos_ids), tuple(stop_strings), tokenizer, pad_id)
    ids, attn = pad_left(prompts, pad_id)  # (P, Tp) each
    dev = model.lm_head.weight.device
    amp = autocast if dev.type != "cpu" else None
    ids, attn = ids.to(dev), attn.to(dev)
    with torch.autocast(dev.type, dtype=amp, enabled=amp is not None):
        cache = model.new_kv_cache(P, ids.shape[1] + T, amp)
        h = model(ids, attention_mask=attn, kv_cache=cache, return_hidden=True)  # (P, Tp, H)
        rows = torch.arange(P, device=dev).repeat_interleave(G)  # (N,) the prompt of each row
        cache, attn = cache.select(rows), attn[rows]  # each prompt's keys copied to its G rows; (N, Tp)
        logits = model.lm_head(h[rows, -1]).float()  # (N, V) only the last position needs the LM head
        u = draw_uniforms(generator, P, G, T, dev) if temperature > 0 else None  # (T, N)
        return decode(model, cache, attn, logits, u, T, draw)[0]


@dataclass(frozen=True)
class Draw:
    """How a row's tokens are drawn (sample_tokens) and how a row ends (module docstring)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    tokenizer: object = None  # decodes the rows for the stop strings
    pad_id: int = 0


def decode(model, cache, attn, logits, u, T: int, draw: Draw) -> tuple[Generation, torch.Tensor]:
    """The loop: up to T tokens for each row of the cache, the first from `logits` (N, V), with the uniforms
    u (T, N) (None: greedy); attn (N, S) the mask of the keys the cache holds. Returns the Generation and the
    mask (N, S') of the keys it then holds: a row's tokens are fed up to its end, each but its last masked in
    (the pads after a row's end are keys an episode's next turn masks: Episodes)."""
    N, dev = logits.shape[0], logits.device
    tokens = torch.full((N, T), draw.pad_id, dtype=torch.long, device=dev)  # (N, T) pad after a row's end
    logps = torch.zeros(N, T, device=dev)  # (N, T) float32 sampler log-probs, 0 after the end
    length = torch.full((N,), T, device=dev)  # (N,) tokens up to and including the end (T while running)
    done = torch.zeros(N, dtype=torch.bool, device=dev)  # (N,) ended: an EOS id or a stop string
    eos = torch.tensor(draw.eos_ids, dtype=torch.long, device=dev)  # (E,)
    stops = StopCheck(draw.stop_strings, draw.tokenizer) if draw.stop_strings else None
    for t in range(T):
        tok, lp = sample_tokens(
            logits, draw.temperature, draw.top_p, draw.top_k, u=None if u is None else u[t, :, None]
        )
        tokens[:, t] = tok.masked_fill(done, draw.pad_id)  # (N,) an ended row rides along, its tokens pad
        logps[:, t] = lp.masked_fill(done, 0.0)
        new = (tokens[:, t, None] == eos).any(-1) & ~done  # (N,) the rows that sample an EOS id now
        length[new] = t + 1
        done |= new
        if stops is not None:
            stops(tokens, length, done, t + 1)
        if t + 1 == T or bool(done.all()):
            break
        attn = torch.cat([attn, (~done).long()[:, None]], 1)  # (N, S + t + 1) an ended row's tokens: pads
        h = model(tokens[:, t : t + 1], attention_mask=attn, kv_cache=cache, return_hidden=True)  # (N, 1, H)
        logits = model.lm_head(h[:, 0]).float()  # (N, V)
    return finish(tokens, logps, length, done, draw.pad_id), attn


class Episodes:
    """The plain loop's cache continued from turn to turn, for an episode's rows (envs/episode.py; --plain):
    what row_sampler.Sampler does on the fast path, the same calls, the same tokens to float32 rounding.

    The rows share one left-padded KVCache, as `generate`'s do. A turn's new tokens (each row's last sampled
    token and its observation) are left-padded into one block and appended after every row's keys; the
    attention mask hides the pads (in the middle of a row now, as after a row's end) and positions count the
    real tokens only, so each row sees its own tokens and nothing else. Where a block does not fit, the cache
    is copied into one with twice the room. `turn` is the most tokens one `decode` samples."""

    def __init__(self, model, turn: int, autocast: torch.dtype | None = None):
        self.model, self.turn = model, turn
        self.amp = autocast if model.lm_head.weight.device.type != "cpu" else None
        self.cache, self.attn = None, None  # KVCache of the rows, its mask (N, S)
        self.pending: list[int] = []  # each row's last sampled token: not yet through the model

    def _forward(self, chunks: list[list[int]]) -> torch.Tensor:
        """Each row's chunk after its keys, the cache grown first if the chunk and a turn do not fit; the
        logits of each chunk's last token (N, V)."""
        ids, mask = (t.to(self.attn.device) for t in pad_left(chunks, 0))  # (N, Tc) each
        S = self.attn.shape[1]
        if S + ids.shape[1] + self.turn > self.cache.max_len:
            room = max(2 * self.cache.max_len, S + ids.shape[1] + self.turn)
            grown = self.model.new_kv_cache(len(chunks), room, self.cache.k.dtype)
            grown.k[:, :, :, :S], grown.v[:, :, :, :S] = self.cache.k[:, :, :, :S], self.cache.v[:, :, :, :S]
            grown.length = S  # k/v (L, N, n_kv, max_len, D)
            self.cache = grown
        self.attn = torch.cat([self.attn, mask], 1)  # (N, S + Tc)
        with torch.autocast(ids.device.type, dtype=self.amp, enabled=self.amp is not None):
            h = self.model(
                ids, attention_mask=self.attn, kv_cache=self.cache, return_hidden=True
            )  # (N, Tc, H)
            return self.model.lm_head(h[:, -1]).float()  # (N, V)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], rows: Sequence[int]) -> torch.Tensor:
        """Each prompt once; row k then holds a copy of prompt rows[k]'s keys. Logits (N, V)."""
        dev = self.model.lm_head.weight.device
        self.cache = self.model.new_kv_cache(len(prompts), max(map(len, prompts)) + self.turn, self.amp)
        self.attn = torch.zeros(len(prompts), 0, dtype=torch.long, device=dev)
        logits = self._forward(prompts)  # (P, V)
        index = torch.tensor(list(rows), device=dev)  # (N,)
        self.cache, self.attn, self.pending = self.cache.select(index), self.attn[index], []
        return logits[index]

    @torch.inference_mode()
    def extend(self, chunks: list[list[int]]) -> torch.Tensor:
        """Each row's pending token, then chunks[k] (an observation), after its keys. Logits (N, V)."""
        return self._forward([[p, *c] for p, c in zip(self.pending, chunks)])

    def keep(self, rows: Sequence[int]) -> None:
        """Only these rows go on (the episodes still running), in this order."""
        index = torch.tensor(list(rows), device=self.attn.device)
        self.cache, self.attn = self.cache.select(index), self.attn[index]
        self.pending = [self.pending[k] for k in rows]

    @torch.inference_mode()
    def decode(self, logits, max_new: int, generator, *, group: int = 1, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, eos_ids=(), stop_strings=(), tokenizer=None, pad_id: int = 0,
               decode_mode: str = "plain") -> Generation:  # fmt: skip
        """Up to max_new tokens for every row (row_sampler.Sampler.decode's arguments; `decode_mode` is
        always the plain loop here). Afterwards the cache holds each row's tokens but the last, which the next
        `extend` feeds first."""
        N = logits.shape[0]
        draw = Draw(temperature, top_p, top_k, tuple(eos_ids), tuple(stop_strings), tokenizer, pad_id)
        u = draw_uniforms(generator, N // group, group, max_new, logits.device) if temperature > 0 else None
        with torch.autocast(logits.device.type, dtype=self.amp, enabled=self.amp is not None):
            gen, attn = decode(self.model, self.cache, self.attn, logits, u, max_new, draw)
        self.attn = attn  # (N, S') each row's sampled tokens but the last: that one is not fed yet
        self.pending = gen.completion_ids.gather(1, (gen.lengths - 1)[:, None]).squeeze(1).tolist()
        return gen


@contextlib.contextmanager
def eval_mode(model):
    """The model in eval mode for the block (no LoRA dropout), its mode back after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ids [B, T] and an attention mask [B, T] (1 real, 0 pad)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, T - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, T - len(s) :] = 1
    return ids, mask


def draw_uniforms(generator, P: int, G: int, max_new: int, device) -> torch.Tensor | None:
    """(max_new, N) uniforms for every step and row, in the order the eager loop draws them: per prompt,
    G per step (per-prompt generators); or N per step from one generator (None: torch's default)."""
    if isinstance(generator, (list, tuple)):
        if device.type == "cpu":  # the CPU generator draws serially: one call equals max_new calls of G
            cols = [torch.rand(max_new, G, generator=g) for g in generator]  # each (max_new, G)
        else:  # Philox offsets advance per call: draw as the eager loop does, one call per step
            cols = [torch.stack([torch.rand(G, generator=g, device=device) for _ in range(max_new)])
                    for g in generator]  # fmt: skip
        return torch.cat(cols, 1).to(device)  # (max_new, N)
    return torch.rand(max_new, P * G, generator=generator, device=device)  # (max_new, N)


CHUNK = 512  # block size of the two-level inverse CDF in _draw


def _draw(w: torch.Tensor, generator: torch.Generator | None, u: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (N, 1) drawn in proportion to the non-negative, unnormalised weights w (N, K).

    Inverse CDF with one uniform per row: drawing K Gumbel/exponential noises per row (what transformers
    does) costs an order of magnitude more on a CPU. Over a whole vocabulary, a block is picked by its total weight and then
    a token inside it, since a full-length cumsum is sequential and slow. u lies in (0, total], so a
    zero-weight token (a flat step of the CDF) is never picked.
    """
    N, K = w.shape
    if u is None:
        u = torch.rand(N, 1, generator=generator, device=w.device)  # (N, 1) in [0, 1)
    u = 1.0 - u  # (N, 1) in (0, 1]
    if K <= 4 * CHUNK:
        cdf = w.cumsum(-1)  # (N, K)
        return torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=K - 1)
    blocks = (F.pad(w, (0, -K % CHUNK)) if K % CHUNK else w).view(N, -1, CHUNK)  # (N, nb, C)
    mass = blocks.sum(-1)  # (N, nb)
    cs = mass.cumsum(-1)  # (N, nb)
    u = u * cs[:, -1:]
    b = torch.searchsorted(cs, u).clamp_(max=cs.shape[1] - 1)  # (N, 1) block
    u = u - (cs.gather(1, b) - mass.gather(1, b))  # (N, 1) what is left inside the block
    inner = blocks.gather(1, b[:, :, None].expand(N, 1, CHUNK)).squeeze(1).cumsum_(-1)  # (N, C)
    j = torch.searchsorted(inner, u).clamp_(max=CHUNK - 1)  # (N, 1)
    return (b * CHUNK + j).clamp_(max=K - 1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    u: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of float32 `logits` (N, V) -> (tokens (N,) long, logp (N,) float32).

    logp is under softmax(logits / temperature) before filtering (softmax(logits) when greedy).
    `u` (N, 1) in [0, 1) are the rows' uniforms when the caller draws them (else from `generator`).
    `logits` may be overwritten.
    """
    if temperature == 0:
        tok = logits.argmax(-1)  # (N,)
        return tok, logits.gather(1, tok[:, None]).squeeze(1) - logits.logsumexp(-1)
    z = logits.div_(temperature) if temperature != 1.0 else logits  # (N, V)
    if 0 < top_k < z.shape[1] or top_p < 1.0:
        return sample_filtered(z, top_p, top_k, generator, u)
    # one fused softmax serves the draw and the log-prob (log p is exact to float32 rounding; a token whose p
    # underflows to 0 can never be drawn)
    p = z.softmax(-1)  # (N, V)
    tok = _draw(p, generator, u)  # (N, 1)
    return tok.squeeze(1), p.gather(1, tok).log_().squeeze(1)


def sample_filtered(
    z: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator | None, u: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_tokens with top-k and / or top-p on logits z (N, V) already divided by the temperature: the draw
    from the kept tokens, the log-prob under the whole softmax(z)."""
    V = z.shape[1]
    k = top_k if 0 < top_k < V else V
    lse = z.logsumexp(-1, keepdim=True)  # (N, 1)
    if k < V:
        zs, idx = z.topk(k, dim=-1)  # (N, k) most likely first
        p = (zs - lse).exp_()  # (N, k)
    else:
        # top-p alone: a partial sort that already holds top_p of the mass (a full sort of a 50k-150k
        # vocabulary is slow on a CPU); grow it in the rare case it does not
        k = min(V, 256)
        while True:
            zs, idx = z.topk(k, dim=-1)  # (N, k)
            p = (zs - lse).exp_()  # (N, k)
            if k == V or bool((p.sum(-1) >= top_p).all()):
                break
            k = min(V, 8 * k)
    if top_p < 1.0:
        # drop a token when the mass before it reaches top_p (of the top-k mass when top-k is on, as in
        # transformers); the most likely token always stays
        cum = p.cumsum(-1)  # (N, k)
        total = cum[:, -1:] if 0 < top_k < V else 1.0
        p.masked_fill_(cum - p >= top_p * total, 0.0)
    tok = idx.gather(1, _draw(p, generator, u))  # (N, 1)
    return tok.squeeze(1), (z.gather(1, tok) - lse).squeeze(1)


class StopCheck:
    """Stop strings, checked on the host (every step, or every few steps of a captured one), for every decode
    loop: the row ends at the first token i whose window (the last `window` tokens up to i) decodes to a text
    holding a stop string.

    One decode per live row covers all the steps since the last check (window + new tokens): a stop string
    in a window's text is then in this text too, since it only extends the window on the left and right.
    Only the rows whose text holds a stop string (or a U+FFFD from split UTF-8 bytes, or every row when the
    tokenizer rewrites spaces around punctuation) get the per-token check that finds where it ends."""

    def __init__(self, stop_strings: Sequence[str], tokenizer):
        self.stops, self.tok = list(stop_strings), tokenizer
        self.window = (
            max(len(s.encode()) for s in self.stops) + 2
        )  # a stop string of b UTF-8 bytes spans <= b tokens
        self.exact_only = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.checked = 0  # steps checked so far

    def __call__(self, tokens: torch.Tensor, length: torch.Tensor, done: torch.Tensor, upto: int) -> None:
        """Check steps checked .. upto - 1 of the rows not ended before them (tokens (N, T), length (N,),
        done (N,), as the loop keeps them); end the rows that hit, in place."""
        first, w = self.checked, self.window
        lo = max(0, first - w + 1)
        ids, lengths = tokens[:, lo:upto].tolist(), length.tolist()
        ended_before = (done & (length <= first)).tolist()
        hits = {}
        rows = [r for r in range(len(ids)) if not ended_before[r]]
        last = {r: min(upto, lengths[r]) for r in rows}  # a row ended by EOS here: up to its EOS
        texts = self.tok.batch_decode([ids[r][: last[r] - lo] for r in rows])
        suspects = [r for r, x in zip(rows, texts) if self.exact_only or "\ufffd" in x or self.hit(x)]
        for r in suspects:
            for i in range(first, last[r]):
                if self.hit(self.tok.decode(ids[r][max(lo, i - w + 1) - lo : i + 1 - lo])):
                    hits[r] = i
                    break
        if hits:
            idx = torch.tensor(list(hits), device=length.device)
            length[idx] = torch.tensor([i + 1 for i in hits.values()], device=length.device)
            done[idx] = True
        self.checked = upto

    def hit(self, text: str) -> bool:
        return any(x in text for x in self.stops)


@dataclass
class Generation:
    """G completions per prompt; rows i*G .. i*G+G-1 belong to prompt i."""

    completion_ids: torch.Tensor  # (B*G, T) long, pad_id after the end
    mask: torch.Tensor  # (B*G, T) float, 1 on completion tokens (the EOS / stop token included)
    logp: torch.Tensor  # (B*G, T) float32, sampler log-probs (0 where mask is 0)
    truncated: torch.Tensor  # (B*G,) bool, hit max_new_tokens without EOS or stop string

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(1).long()  # (B*G,)

    def texts(
        self, tokenizer, stop_strings: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> list[str]:
        """Decoded completions (pads and everything after the end dropped), each finished by
        `finish_text`: the text of one that ended on a stop string ends right after it. The one decoding
        rule of training, eval.py generate and the final eval."""
        ids = self.completion_ids.tolist()
        return [
            finish_text(tokenizer.decode(row[:n], skip_special_tokens=skip_special_tokens), stop_strings)
            for row, n in zip(ids, self.lengths.tolist())
        ]


def finish_text(text: str, stop_strings: Sequence[str] = ()) -> str:
    """`text` up to the end of its first stop string, the stop string kept.

    The sampler stops at the token that completes a stop string, and a token may carry characters past
    it (' </answer>\n' as one token): those are dropped. The stop string stays, since format graders check
    closing tags such as '</answer>'. The trained tokens are still all the sampled ones, the completing
    token included; only the text the graders see ends at the stop string. No stop string: unchanged.
    """
    ends = [i + len(s) for s in stop_strings if s and (i := text.find(s)) >= 0]
    return text[: min(ends)] if ends else text


def finish(tokens, logps, length, ended, pad_id: int) -> Generation:
    """The Generation of tokens and log-probs (N, max_new), lengths (N,) and ended (N,): trimmed to the
    longest completion, pad and 0 after each row's end."""
    T = int(length.max())
    mask = torch.arange(T, device=tokens.device)[None, :] < length[:, None]  # (N, T)
    return Generation(
        completion_ids=tokens[:, :T].masked_fill(~mask, pad_id),
        mask=mask.float(),
        logp=logps[:, :T].masked_fill(~mask, 0.0),
        truncated=~ended,
    )
