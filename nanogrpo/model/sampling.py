"""Batched generation with a preallocated KV cache: prefill each prompt once, expand to its group, decode.

GRPO samples G completions of each of P prompts. The P prompts are left-padded into one batch (mixed
lengths: an attention mask hides the pads, position ids count real tokens only) and run through the model
once (prefill), so a prompt's tokens are computed once, not G times. Its keys and values are not copied
G times either: the G completions share them (kvcache.GroupedKVCache), and each decode step reads a
prompt's keys once for its whole group. Decoding runs one token for all P*G rows per step. A row that
has hit an EOS id or a stop string rides along (its outputs are ignored and padded at the end) until a
quarter of the batch has ended; then the ended rows are dropped from the batch and the cache, so long
completions do not pay for finished ones.

What the trainer keeps from a sample is the log-probability of each sampled token under
softmax(logits / temperature) in float32, *before* top-k / top-p filtering (softmax(logits) when greedy).
The trainer takes pi_old from its own forward and uses these to measure, and optionally correct, the
sampler-trainer gap (grpo.importance_weights); GRPO refuses top-k / top-p, whose samples come from a
distribution the loss does not see (docs/KL.md). Evaluation may use both.

On the CPU, a model samples with packed copies of its weights with LoRA folded in (packed.py: oneDNN's
layout for bf16, and for float32 MKL's packed sgemm on Intel CPUs, oneDNN's elsewhere); a bf16 model keeps
a float32 cache (the fp32 attention kernels are the faster ones there).

Departures from transformers' `generate`: only the last position of the prefill goes through the LM head
(no [B, T, V] logits), a draw is one uniform per row through the CDF of the kept tokens (top-k and
top-p on a partial sort, not a full-vocabulary mask), and there are no logits processors beyond
temperature, top-k and top-p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanogrpo.model.kvcache import GroupedKVCache
from nanogrpo.model.packed import folded_lora, packed_weights
from nanogrpo.model.static_decode import DECODE_LOOPS, generate_static


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
    N, V = z.shape
    k = top_k if 0 < top_k < V else V
    if k == V and top_p >= 1.0:
        # one fused softmax serves the draw and the log-prob (log p is exact to float32 rounding; a token
        # whose p underflows to 0 can never be drawn)
        p = z.softmax(-1)  # (N, V)
        tok = _draw(p, generator, u)  # (N, 1)
        return tok.squeeze(1), p.gather(1, tok).log_().squeeze(1)

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


class _StopStrings:
    """Incremental stop-string check: decode only a window of recent tokens per row."""

    def __init__(self, stop_strings: Sequence[str], tokenizer, n_rows: int):
        self.stops = list(stop_strings)
        self.tok = tokenizer
        # a stop string of b UTF-8 bytes spans at most b tokens; 2 more so the window never starts on it
        self.window = max(len(s.encode()) for s in self.stops) + 2
        self.hist: list[list[int]] = [[] for _ in range(n_rows)]

    def __call__(self, rows: list[int], tokens: list[int], done: list[bool]) -> list[int]:
        """Append each row's new token; return the batch positions whose text now holds a stop string."""
        hits = []
        for i, (row, t) in enumerate(zip(rows, tokens)):
            if done[i]:
                continue
            h = self.hist[row]
            h.append(t)
            text = self.tok.decode(h[-self.window :])
            if any(s in text for s in self.stops):
                hits.append(i)
        return hits


def eos_and_pad(model_config, tokenizer) -> tuple[list[int], int]:
    """(the ids that end a completion, the pad id) the sampler is given: the EOS ids of the model's
    config.json, then the tokenizer's; its pad token, else the first EOS id (0 when there is none). Pads are
    masked and cut off when decoding, so the pad id never changes a completion."""
    eos = [*(getattr(model_config, "eos_token_ids", None) or ())]
    if tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    eos = list(dict.fromkeys(eos))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    return eos, pad


@torch.inference_mode()
def generate(
    model,
    prompts: list[list[int]],
    *,
    group_size: int = 1,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    tokenizer=None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    pad_id: int = 0,
    autocast: torch.dtype | None = None,
    fold_lora: bool = True,
    decode: str = "eager",
) -> Generation:
    """Sample `group_size` completions of each prompt (token id lists); see Generation for the layout.

    `generator` is one torch.Generator for the batch, or one per prompt: then a prompt's completions
    depend only on its own generator, not on which other prompts share the batch (what lets torchrun
    ranks reproduce a single-process run).

    `autocast`: the compute dtype of a float32 model (a full fine-tune's master weights, trained under
    autocast). On an accelerator the sampler then runs in it too: autocast casts each weight once per call
    (its cache holds that copy, 2 bytes a parameter in bf16, until the call returns) and the KV cache is
    kept in it, so a decode step reads half the bytes it would in float32 and samples from the trainer's
    own numerics. On the CPU it is ignored: the packed float32 weights are faster there (packed.py).

    `fold_lora`: where the weights are not packed (a GPU, NANOGRPO_PACKED=0), sample with each LoRA layer's
    W + (alpha / r) B A folded into one weight (packed.folded_lora: one copy of the adapted weights in their
    dtype for the call) instead of running the adapters; False runs the adapters as the trainer does.
    `decode`: 'eager' (the loop below: slices the cache, drops ended rows), 'static' (fixed-shape steps,
    static_decode.py: same tokens with the same generators, log-probs to float32 rounding), 'compiled'
    (those steps through torch.compile: the same tokens; compiling costs once per process and shape), 'graph'
    or 'compiled-graph' (the static or compiled step recorded once per call as a CUDA graph and replayed; off
    CUDA, where there is no graph, they run the step as 'static' and 'compiled' do).
    """
    if isinstance(generator, (list, tuple)) and len(generator) != len(prompts):
        raise ValueError(f"{len(generator)} generators for {len(prompts)} prompts: give one per prompt")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(
            "generate needs at least one prompt and no empty prompt (give each a token, e.g. BOS)"
        )
    if group_size < 1 or max_new_tokens < 1:
        raise ValueError(f"group_size={group_size}, max_new_tokens={max_new_tokens}: both must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"temperature={temperature} (>= 0), top_p={top_p} (0, 1], top_k={top_k} (>= 0)")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer to decode completions: pass tokenizer=")
    if decode not in DECODE_LOOPS:
        raise ValueError(f"decode={decode!r}: use one of {', '.join(map(repr, DECODE_LOOPS))}")
    if any(s == "" for s in stop_strings):
        raise ValueError("an empty stop string would end every completion at once; remove it")

    was_training = model.training
    model.eval()  # LoRA dropout off while sampling
    try:
        # on the CPU: packed weights with LoRA folded in, for the duration of this call (packed.py)
        amp = autocast if autocast is not None and model.lm_head_weight.device.type != "cpu" else None
        with (
            packed_weights(model, batch_hint=len(prompts) * group_size) as packed,
            folded_lora(model, enabled=fold_lora and packed is None),  # packing folds LoRA itself
            torch.autocast(model.lm_head_weight.device.type, dtype=amp, enabled=amp is not None),
        ):
            if decode != "eager":
                return _generate_static(
                    model, packed, prompts, group_size, max_new_tokens, temperature, top_p, top_k,
                    eos_ids, stop_strings, tokenizer, generator, pad_id, amp, decode,
                )  # fmt: skip
            return _generate(
                model, packed, prompts, group_size, max_new_tokens, temperature, top_p, top_k,
                eos_ids, stop_strings, tokenizer, generator, pad_id, amp,
            )  # fmt: skip
    finally:
        model.train(was_training)


def _prefill(model, lm_head, prompts, G: int, max_new: int, pad_id: int, amp=None, cache_cls=GroupedKVCache):
    """Run the P prompts once, left-padded into one batch, and expand them to their groups.

    Returns the logits of each row's first new token (N, V) float32, a GroupedKVCache (the prompts' keys
    and values once, shared by their G completions, their padding kept, so decode steps pass no attention
    mask) and each row's position of the first new token (N, 1). `amp`: the autocast dtype, the cache's;
    `cache_cls`: GroupedKVCache, or StaticGroupedKVCache for fixed-shape decode steps.
    """
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
    # on the CPU a bf16 model keeps a float32 cache: decode attention then runs the faster fp32 kernel
    # without casting the whole cache at every step
    W = model.lm_head_weight
    cache_dtype = torch.float32 if dev.type == "cpu" and W.dtype == torch.bfloat16 else amp
    cache = model.new_kv_cache(P, L, dtype=cache_dtype)
    h = model(ids, position_ids=pos, attention_mask=attn, kv_cache=cache, return_hidden=True)  # (P, L, H)
    logits = lm_head(h[:, -1]).float()  # (P, V) only the last position needs the LM head
    grouped = cache_cls(cache, G, max_new, prompt_mask=attn)
    return logits.repeat_interleave(G, 0), grouped, lens.repeat_interleave(G)[:, None]


def _generate(
    model, packed, prompts, G, max_new, temperature, top_p, top_k, eos_ids, stop_strings, tokenizer, generator, pad_id,
    amp=None,
) -> Generation:  # fmt: skip
    W = model.lm_head_weight  # (V, H)
    lm_head = packed.head if packed is not None else (lambda h: h @ W.T)  # (n, H) -> (n, V)
    dev = W.device
    N = len(prompts) * G
    logits, cache, next_pos = _prefill(model, lm_head, prompts, G, max_new, pad_id, amp)  # (N, V), ...

    tokens = torch.empty(N, max_new, dtype=torch.long, device=dev)  # (N, max_new)
    logps = torch.empty(N, max_new, dtype=torch.float32, device=dev)  # (N, max_new)
    length = torch.full((N,), max_new, dtype=torch.long, device=dev)  # (N,) tokens up to and incl. the end
    ended = torch.zeros(N, dtype=torch.bool, device=dev)  # (N,) hit EOS or a stop string
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=dev)
    stops = _StopStrings(stop_strings, tokenizer, N) if stop_strings else None
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
            hit = torch.isin(tok, eos) if len(eos) else torch.zeros_like(done)  # (n,)
            if stops is not None:
                out_rows = range(len(tok)) if rows is None else rows.tolist()
                for i in stops(out_rows, tok.tolist(), done.tolist()):
                    hit[i] = True
            new = hit & ~done  # (n,)
            if bool(new.any()):
                out = new.nonzero().squeeze(1) if rows is None else rows[new]
                length[out], ended[out] = t + 1, True
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

    return _finish(tokens, logps, length, ended, pad_id)


def _generate_static(
    model, packed, prompts, G, max_new, temperature, top_p, top_k, eos_ids, stop_strings, tokenizer, generator, pad_id,
    amp=None, decode: str = "static",
) -> Generation:  # fmt: skip
    """The fixed-shape decode loop (static_decode.py), drawing with the same rule as the eager loop;
    `decode`: 'static', 'compiled', 'graph' or 'compiled-graph'."""
    W = model.lm_head_weight  # (V, H)
    lm_head = packed.head if packed is not None else (lambda h: h @ W.T)  # (n, H) -> (n, V)
    sample = lambda logits, u: sample_tokens(logits, temperature, top_p, top_k, None, u)  # noqa: E731
    s = generate_static(
        model, lm_head, prompts, G, max_new, sample, eos_ids, stop_strings, tokenizer, generator, pad_id,
        amp, temperature, _prefill, decode,
    )  # fmt: skip
    return _finish(s.tokens, s.logps, s.length, s.done, pad_id)


def _finish(tokens, logps, length, ended, pad_id: int) -> Generation:
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
