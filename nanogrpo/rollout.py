"""One step's samples: G completions for each of this rank's prompts, decoded, and laid out as a training batch.

    roll = rollout(policy, rows, step, first, cfg, device)

Each prompt samples from its own generator, seeded by (seed, step, its index in the global batch), so a
resumed run needs no generator state and a prompt samples the same on any rank and in any batch. The
sampler's log-probs come along (`sampler_logp`): the trainer measures its own against them every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rewards import Sample
from rewards.rows import prompt_text

from .config import TrainConfig
from .logprobs import Batch, make_batch, pad_left
from .sampling import generate


@dataclass
class Rollout:
    """G completions per prompt; rows i*G .. i*G+G-1 answer prompt i."""

    rows: list[dict]  # (P,) this rank's data rows
    texts: list[str]  # (N,) the completions as the graders read them (a stop string ends one, kept)
    samples: list[Sample]  # (N,) what the graders score
    batch: Batch  # prompts + completions, on the device
    sampler_logp: torch.Tensor  # (N, Tc) the sampler's log-probs of its tokens (0 past the end)
    lengths: torch.Tensor  # (N,) completion tokens
    truncated: torch.Tensor  # (N,) bool: hit max_new_tokens
    seconds: float  # wall time of sampling and decoding


def rollout(
    policy, rows: list[dict], step: int, first: int, cfg: TrainConfig, device: torch.device
) -> Rollout:
    """Sample `cfg.grpo.group_size` completions of each row's prompt (`row['_prompt_ids']`); `first` is the
    index of rows[0] in the step's global batch (rank * prompts per rank)."""
    t0 = time.perf_counter()
    G, s, tok = cfg.grpo.group_size, cfg.sampling, policy.tokenizer
    prompts = [r["_prompt_ids"] for r in rows]  # (P,) token lists, rendered at start-up
    policy.model.eval()
    gens = [
        torch.Generator(device=device).manual_seed((cfg.seed * 1_000_003 + step) * 4099 + first + i)
        for i in range(len(prompts))
    ]
    with policy.gathered(), torch.inference_mode():  # FSDP: full weights for the sampler
        gen = generate(
            policy.core, prompts, group_size=G, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
            top_p=s.top_p, top_k=s.top_k, eos_ids=policy.eos_ids, stop_strings=s.stop, tokenizer=tok,
            generator=gens, pad_id=policy.pad_id,
        )  # fmt: skip
    completion_ids, cmask = gen.completion_ids.clone(), gen.mask.float().clone()  # (N, Tc)
    texts = gen.texts(tok, s.stop)  # a stop string ends the text, kept (sampling.finish_text)
    samples = [
        Sample(prompt=prompt_text(r["prompt"]), completion=texts[i * G + j], group=i, row=r)
        for i, r in enumerate(rows)
        for j in range(G)
    ]
    p_ids, p_mask = pad_left(prompts, policy.pad_id)
    p_ids, p_mask = p_ids.repeat_interleave(G, 0), p_mask.repeat_interleave(G, 0)  # (N, Tp)
    batch = make_batch(p_ids, p_mask, completion_ids, cmask).to(device)
    sampler_logp = gen.logp.float().to(device) * batch.mask  # (N, Tc)
    return Rollout(
        rows, texts, samples, batch, sampler_logp, cmask.sum(1), gen.truncated, time.perf_counter() - t0
    )
