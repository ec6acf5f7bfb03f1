"""The fast samplers' entry: `generate` (the default sampler of every caller but the plain rollout), and the
weights they sample with (`sampling_weights`).

    gen = generate(model, prompts, group_size=G, max_new_tokens=64, generator=gens, decode="eager")

`generate` takes sampling.generate's arguments and `decode`: 'plain' (or a --plain run) hands the call to the
plain loop, sampling.generate, on the weights as they are; every other mode samples in `sampling_weights`
(on the CPU every projection packed with LoRA folded in, packed.py; elsewhere each LoRA layer folded into one
weight) and takes grouped.generate_fast: 'eager' the grouped cache, ended rows dropped; 'static', 'compiled',
'graph', 'compiled-graph' the row sampler's decode step on fixed shapes (static_decode.py). All draw the same
tokens as the plain loop from the same generators, log-probs to float32 rounding (tests/test_sampling.py),
by its rules (sampling.py: the uniforms, the draw, the ends).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from nanogrpo.model import sampling
from nanogrpo.model.fast.grouped import generate_fast
from nanogrpo.model.fast.packed import folded_lora, packed_weights
from nanogrpo.model.paths import plain
from nanogrpo.model.sampling import Generation, eval_mode


@torch.inference_mode()
def generate(
    model, prompts: list[list[int]], *, group_size: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
    top_p: float = 1.0, top_k: int = 0, eos_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
    tokenizer=None, generator=None, pad_id: int = 0, autocast: torch.dtype | None = None, fold_lora: bool = True,
    decode: str = "eager",
) -> Generation:  # fmt: skip
    """sampling.generate's samples, by the path `decode` names (module docstring), its arguments checked
    first. `fold_lora`: where nothing is packed (a GPU), each LoRA layer folded into one weight for the call
    (False runs the adapters as the trainer does). `autocast`: a float32 model's compute dtype on an
    accelerator, the sampler's (its cache's too); on the CPU the packed float32 weights are faster."""
    from nanogrpo.model.fast.static_decode import check_generate

    check_generate(prompts, generator, group_size, max_new_tokens, temperature, top_p, top_k, stop_strings,
                   tokenizer, decode)  # fmt: skip
    if plain() or decode == "plain":  # the reading path: the plain loop on the weights as they are
        with eval_mode(model):
            return sampling.generate(
                model, prompts, group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature,
                top_p=top_p, top_k=top_k, eos_ids=eos_ids, stop_strings=stop_strings, tokenizer=tokenizer,
                generator=generator, pad_id=pad_id, autocast=autocast,
            )  # fmt: skip
    with sampling_weights(model, len(prompts) * group_size, fold_lora, autocast) as (head, packed, amp):
        return generate_fast(model, head, packed, prompts, group_size, max_new_tokens, temperature, top_p, top_k,
                             eos_ids, stop_strings, tokenizer, generator, pad_id, amp, decode)  # fmt: skip


@contextlib.contextmanager
def sampling_weights(model, rows: int, fold_lora: bool = True, autocast: torch.dtype | None = None):
    """What the fast samplers compute with, for the block: eval mode (no LoRA dropout); on the CPU every
    projection and the LM head packed with LoRA folded in (packed.py); elsewhere, with `fold_lora`, each LoRA
    layer folded into one weight; on an accelerator, `autocast`'s dtype. Yields (the LM head (n, H) -> (n, V),
    the packed weights or None, the autocast dtype or None)."""
    amp = autocast if autocast is not None and model.lm_head_weight.device.type != "cpu" else None
    W = model.lm_head_weight  # (V, H)
    with (
        eval_mode(model),
        packed_weights(model, batch_hint=rows) as packed,
        folded_lora(model, enabled=fold_lora and packed is None),  # packing folds LoRA
        torch.autocast(W.device.type, dtype=amp, enabled=amp is not None),
    ):
        yield (packed.head if packed is not None else (lambda h: h @ W.T)), packed, amp
