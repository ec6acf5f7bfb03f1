"""The sampler: G completions of each prompt, a token a step.

    gen = generate(model, prompts, group_size=G, max_new_tokens=64, temperature=1.0, generator=gens)

The plain loop (`plain_generate`, --sampling.decode plain) is the reference the fast paths are tested
against: the prompts left-padded into one block and run once (their pads hidden by the attention mask), each
prompt's keys copied to the cache rows of its G samples; then, a step at a time, every row samples a token
from its last logits and feeds it through the model, until every row has ended or has max_new_tokens. How a
token is drawn, recorded and ended is draw.py's, the rules every decode path shares.

The fast paths beside the plain loop draw the same tokens (tests/test_sampling.py):
- the weights (`sampling_weights`): on the CPU every projection packed with LoRA folded in (packed.py);
  elsewhere LoRA folded into one weight a projection;
- the grouped cache (grouped.py): a prompt's keys once for its G samples, ended rows dropped: the default
  (--sampling.decode eager);
- one decode step over fixed shapes, run as it is, compiled, or recorded as a CUDA graph (row_sampler.py's
  decode_loop over the grouped cache; static_decode.py): --sampling.decode static|compiled|graph;
- the row sampler (row_sampler.py), which continues an episode's rows from turn to turn.
`generate` hands every mode but 'plain' to one call, grouped.generate_fast (which builds on draw.py, as the
row sampler does).

Departures from transformers' `generate`: only the last position of a prefill goes through the LM head (no
[B, T, V] logits), the draw of draw.py, and no logits processors beyond temperature, top-k and top-p.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from nanogrpo.model.draw import (
    DecodeState,
    Generation,
    StopCheck,
    cache_dtype,
    draw_uniforms,
    finish,
    record,
    sample_tokens,
)
from nanogrpo.model.logprobs import pad_left
from nanogrpo.model.packed import folded_lora, packed_weights
from nanogrpo.model.paths import plain


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

    `decode`: 'plain' (plain_generate, the reference) or a fast path (module docstring): 'eager' (the
    default), 'static', 'compiled', 'graph', 'compiled-graph' (the last two run as 'static' and 'compiled' off
    CUDA). All draw the same tokens from the same generators, log-probs to float32 rounding.
    """
    from nanogrpo.model.grouped import generate_fast
    from nanogrpo.model.static_decode import check_generate

    check_generate(prompts, generator, group_size, max_new_tokens, temperature, top_p, top_k, stop_strings,
                   tokenizer, decode)  # fmt: skip
    G, new = group_size, max_new_tokens
    decode = "plain" if plain() else decode  # --plain: the reading path (paths.py)
    with sampling_weights(model, len(prompts) * G, fold_lora, autocast) as (head, packed, amp):
        if decode != "plain":  # the fast paths (grouped.py): a prompt's keys once for its G rows
            return generate_fast(model, head, packed, prompts, G, new, temperature, top_p, top_k, eos_ids,
                                 stop_strings, tokenizer, generator, pad_id, amp, decode)  # fmt: skip
        sample = lambda z, u: sample_tokens(z, temperature, top_p, top_k, None, u)  # noqa: E731
        return plain_generate(model, head, prompts, G, new, sample, eos_ids, stop_strings, tokenizer, generator,
                              pad_id, cache_dtype(model, amp), temperature)  # fmt: skip


def plain_generate(model, lm_head, prompts: list[list[int]], G: int, max_new: int, sample, eos_ids, stop_strings,
                   tokenizer, generator, pad_id: int, dtype: torch.dtype | None, temperature: float) -> Generation:  # fmt: skip
    """The plain loop (module docstring): `lm_head` (n, H) -> (n, V) from sampling_weights, `sample` (logits
    (N, V), uniforms (N, 1) or None) -> (tokens (N,), log-probs (N,)), `generator` one per prompt or one for
    all (no uniforms drawn when `temperature` is 0: greedy), `dtype` the cache's."""
    P, N, dev = len(prompts), len(prompts) * G, model.lm_head_weight.device
    ids, attn = (t.to(dev) for t in pad_left(prompts, pad_id))  # (P, Tp) each
    cache = model.new_kv_cache(P, ids.shape[1] + max_new, dtype)
    h = model(ids, attention_mask=attn, kv_cache=cache, return_hidden=True)  # (P, Tp, H)
    rows = torch.arange(P, device=dev).repeat_interleave(G)  # (N,) the prompt of each row
    cache, attn = cache.select(rows), attn[rows]  # each prompt's keys copied to its G rows; (N, Tp)
    logits = lm_head(h[rows, -1]).float()  # (N, V) only the last position needs the LM head
    u = draw_uniforms(generator, P, G, max_new, dev) if temperature > 0 else None  # (max_new, N)
    s = DecodeState.start(N, max_new, eos_ids, pad_id, dev)
    stops = StopCheck(stop_strings, tokenizer) if stop_strings else None
    for t in range(max_new):  # s.step is t: where record writes
        record(s, s.step, *sample(logits, None if u is None else u[t, :, None]))  # token t of every row
        if stops is not None:
            stops(s, t + 1)
        if t + 1 == max_new or bool(s.done.all()):
            break
        tok = s.tokens[:, t : t + 1]  # (N, 1) token t, pad for ended rows (nothing reads what they compute)
        attn = F.pad(attn, (0, 1), value=1)  # (N, Tp + t + 1)
        h = model(tok, attention_mask=attn, kv_cache=cache, return_hidden=True)  # (N, 1, H)
        logits = lm_head(h[:, 0]).float()  # (N, V)
        s.step.add_(1)
    return finish(s.tokens, s.logps, s.length, s.done, pad_id)


@contextlib.contextmanager
def sampling_weights(model, rows: int, fold_lora: bool = True, autocast: torch.dtype | None = None):
    """What the sampler computes with, for the block: eval mode (no LoRA dropout); on the CPU every projection
    and the LM head packed with LoRA folded in (packed.py); elsewhere, with `fold_lora`, each LoRA layer folded
    into one weight; on an accelerator, `autocast`'s dtype. Under --plain the weights as they are (nothing
    packed or folded: LoRA as its forward computes it). Yields (the LM head (n, H) -> (n, V), the packed
    weights or None, the autocast dtype or None)."""
    was_training = model.training
    model.eval()
    amp = autocast if autocast is not None and model.lm_head_weight.device.type != "cpu" else None
    W = model.lm_head_weight  # (V, H)
    try:
        with (
            packed_weights(model, batch_hint=rows) if not plain() else contextlib.nullcontext() as packed,
            folded_lora(model, enabled=fold_lora and packed is None and not plain()),  # packing folds LoRA
            torch.autocast(W.device.type, dtype=amp, enabled=amp is not None),
        ):
            yield (packed.head if packed is not None else (lambda h: h @ W.T)), packed, amp
    finally:
        model.train(was_training)
