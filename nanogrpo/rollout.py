"""One step's samples: G completions for each of this rank's prompts, decoded, and laid out as a training batch.

    roll = rollout(policy, rows, step, first, cfg, device)

Each prompt samples from its own generator, seeded by (seed, step, its index in the global batch), so a
resumed run needs no generator state and a prompt samples the same on any rank and in any batch (a
resampling round of --grpo.dynamic-sampling adds its round to the seed). The sampler's log-probs come along
(`sampler_logp`): the trainer measures its own against them every step.

`assemble` lays sampled completions out as a Rollout (rollout() and dynamic.py's regrouping share it), and
`loss_rows` is what the loss sees of it: everything, or without the truncated rows (--grpo.mask-truncated).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch

from nanogrpo.config import TrainConfig
from nanogrpo.model import fast
from nanogrpo.model.logprobs import Batch
from nanogrpo.model.paths import plain
from nanogrpo.model.sampling import generate, pad_left
from nanogrpo_base.rows import prompt_text
from rewards import Sample


@dataclass
class Rollout:
    """G completions per prompt, laid out as a training batch, and their scores; rows i*G .. i*G+G-1 answer
    prompt i."""

    rows: list[dict]  # (P,) this rank's data rows
    texts: list[str]  # (N,) the completions as the graders read them (a stop string ends one, kept)
    samples: list[Sample]  # (N,) what the graders score
    batch: Batch  # prompts + completions, on the device
    sampler_logp: torch.Tensor  # (N, Tc) the sampler's log-probs of its tokens (0 past the end)
    lengths: torch.Tensor  # (N,) completion tokens
    truncated: torch.Tensor  # (N,) bool: hit max_new_tokens (an episode: ended on a budget, not done)
    seconds: float  # wall time of sampling and decoding
    failed: torch.Tensor | None = None  # (N,) bool: an episode its environment failed (no reward); --env only
    # the graders' scores, once train.sample_round has scored the rollout
    reward: torch.Tensor | None = None  # (N,) NaN where no grader applied (or the episode failed)
    parts: dict[str, list] = field(
        default_factory=dict
    )  # each grader's (N,) scores, None where it did not apply
    details: dict[str, list] = field(default_factory=dict)  # per-completion details (the judge's reasons)
    t_score: float = 0.0  # wall time of scoring


def prompt_seed(seed: int, step: int, index: int, resample: int = 0) -> int:
    """The seed of one prompt's generator, from (seed, step, its index in the global batch) and, for a
    resampling round of --grpo.dynamic-sampling, the round (round 0 keeps the formula runs always had)."""
    if resample == 0:
        return (seed * 1_000_003 + step) * 4099 + index
    key = f"{seed},{step},{resample},{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1  # < 2**63


def rollout(policy, rows: list[dict], step: int, first: int, cfg: TrainConfig, device: torch.device,
            resample: int = 0) -> Rollout:  # fmt: skip
    """Sample `cfg.grpo.group_size` completions of each row's prompt (`row['_prompt_ids']`); `first` is the
    index of rows[0] in the round's global batch (rank * prompts per rank); `resample`: the round of
    --grpo.dynamic-sampling (0: the step's first draw). With --env, nanogrpo/envs/episode.py's
    episode_rollout samples episodes instead and lays them out the same way."""
    t0 = time.perf_counter()
    G, s, tok = cfg.grpo.group_size, cfg.sampling, policy.tokenizer
    prompts = [r["_prompt_ids"] for r in rows]  # (P,) token lists, rendered at start-up
    policy.model.eval()
    gens = [
        torch.Generator(device=device).manual_seed(prompt_seed(cfg.seed, step, first + i, resample))
        for i in range(len(prompts))
    ]
    kw = dict(group_size=G, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
              top_k=s.top_k, eos_ids=policy.eos_ids, stop_strings=s.stop, tokenizer=tok, generator=gens,
              pad_id=policy.pad_id, autocast=policy.autocast)  # fmt: skip
    with policy.gathered(), torch.inference_mode():  # FSDP: full weights for the sampler
        if plain():  # --plain: the plain loop, on the weights as they are (model/paths.py)
            gen = generate(policy.core, prompts, **kw)
        else:  # the fast paths (model/fast/): packed weights, LoRA folded, the grouped cache
            gen = fast.sampler.generate(policy.core, prompts, **kw, fold_lora=s.fold_lora, decode=s.decode)
    completion_ids, cmask = gen.completion_ids.clone(), gen.mask.float().clone()  # (N, Tc)
    texts = gen.texts(tok, s.stop)  # a stop string ends the text, kept (sampling.finish_text)
    roll = assemble(rows, texts, completion_ids, cmask, gen.logp, gen.truncated, policy.pad_id, device)
    roll.seconds = time.perf_counter() - t0
    return roll


def assemble(rows: list[dict], texts: list[str], completion_ids: torch.Tensor, cmask: torch.Tensor,
             logp: torch.Tensor, truncated: torch.Tensor, pad_id: int, device: torch.device,
             prompt_ids: list[list[int]] | None = None) -> Rollout:  # fmt: skip
    """A Rollout of G = len(texts) / len(rows) completions per row: completion ids, mask and sampler
    log-probs (N, Tc), truncated (N,); the prompts come from each row's `_prompt_ids`, or `prompt_ids`, one
    per completion (episodes whose environment wrote the first message)."""
    G, lengths = len(texts) // len(rows), cmask.sum(1)  # (N,) tokens sampled
    n_tok = [int(n) for n in lengths.tolist()]  # what the overlong grader reads (Sample.tokens)
    samples = [
        Sample(prompt_text(r["prompt"]), texts[i * G + j], group=i, row=r, tokens=n_tok[i * G + j])
        for i, r in enumerate(rows)
        for j in range(G)
    ]
    # the prompts are padded on the host; everything meets on `device` before it is combined
    if prompt_ids is None:
        p_ids, p_mask = (
            t.repeat_interleave(G, 0).to(device) for t in pad_left([r["_prompt_ids"] for r in rows], pad_id)
        )
    else:
        p_ids, p_mask = (t.to(device) for t in pad_left(prompt_ids, pad_id))
    batch = make_batch(p_ids, p_mask, completion_ids.to(device), cmask.to(device))  # (N, Tp+Tc)
    sampler_logp = logp.float().to(device) * batch.mask  # (N, Tc)
    return Rollout(rows, texts, samples, batch, sampler_logp, lengths, truncated, 0.0)


def make_batch(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, mask: torch.Tensor
) -> Batch:
    """prompt_ids/prompt_mask [N, Tp] (already repeated per completion), completion ids/mask [N, Tc].

    Adjacent rows with the same prompt form a group (their prompt runs once in the forward).
    """
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (N, Tp+Tc)
    # tokens after a completion's end only attend backwards (causal), so they cannot change earlier ones
    attn = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)  # (N, Tp+Tc)
    pos = (attn.cumsum(dim=1) - 1).clamp(min=0)  # (N, Tp+Tc)
    new = torch.ones(len(ids), dtype=torch.bool)  # (N,) row starts a new group
    new[1:] = ((prompt_ids[1:] != prompt_ids[:-1]) | (prompt_mask[1:] != prompt_mask[:-1])).any(1).cpu()
    group = new.long().cumsum(0) - 1  # (N,)
    return Batch(ids, attn, pos, prompt_ids.shape[1], completion_ids, mask.float(), group.to(ids.device))


def loss_rows(
    roll: Rollout, adv: torch.Tensor, ref_logp: torch.Tensor | None, mask_truncated: bool
) -> tuple[Batch, torch.Tensor, torch.Tensor | None, torch.Tensor, int]:
    """What the loss sees of the step: (batch, adv, ref_logp, sampler_logp, rows left out).

    With --grpo.mask-truncated the completions that hit max_new_tokens are taken out (after the
    advantages, so their rewards still count in their group's baseline): they add no gradient and are out
    of the loss's num_seqs and num_tokens, so the loss is that of the batch without them. A rank whose
    every completion is truncated keeps them, with advantage 0: no policy gradient, but it still runs the
    forward and backward the other ranks' collectives wait for (they count in the normalisation then)."""
    if not mask_truncated or not bool(roll.truncated.any()):
        return roll.batch, adv, ref_logp, roll.sampler_logp, 0
    keep = (~roll.truncated).nonzero().squeeze(1).to(adv.device)  # (n,) rows that train
    if len(keep) == 0:
        return roll.batch, torch.zeros_like(adv), ref_logp, roll.sampler_logp, 0
    ref = None if ref_logp is None else ref_logp[keep]  # (n, Tc)
    return roll.batch.rows(keep), adv[keep], ref, roll.sampler_logp[keep], len(adv) - len(keep)
