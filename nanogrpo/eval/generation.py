"""Held-out generation: a model (and its LoRA adapter) loaded for generating, and its completions of rows.

`eval.py generate` loads with `load_model` and writes what `generate_completions` returns; train.py's
end-of-run evaluation and --eval-every generate through it too (nanogrpo/eval/evaluate.py
`answer_and_score`). Generation is greedy by default, as Concept Overlap evaluates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def load_model(
    model: str, adapter: str = "", dtype: str = "auto", device: str = "auto", impl: str = "auto",
    plain: bool = False,
) -> tuple[Any, Any]:  # fmt: skip
    """(model, tokenizer) for generation: `model` a folder or a known name ('smollm2', 'tiny'), `adapter` a
    LoRA adapter folder merged into it, frozen in eval mode on the device and dtype the flags resolve to.
    `impl` and `plain` are train.py's --model.impl and --plain: they decide the path generation takes
    (model/paths.py; transformers' model takes the plain path, model/hf_model.py)."""
    from nanogrpo.config import ModelConfig
    from nanogrpo.infra.device import resolve_device_dtype
    from nanogrpo.infra.heap import keep_freed_memory
    from nanogrpo.model import hf_model, lora
    from nanogrpo.model.zoo import load_tokenizer, resolve_model

    device_, dtype_ = resolve_device_dtype(ModelConfig(path=model, dtype=dtype, device=device), "--device")
    if device_.type == "cpu":  # glibc: one batch's freed blocks serve the next (nanogrpo/infra/heap.py)
        keep_freed_memory()
    path = resolve_model(model)
    hf_model.start(path, impl, plain)  # which model runs it, and so which path (said in one line)
    tokenizer = load_tokenizer(path)
    net = hf_model.load_model(path, impl, dtype_, device_)
    if adapter:
        lora.load_adapter(net, adapter)
        lora.merge(net)  # one matmul per layer again: generation runs at the base model's speed
    net.eval().requires_grad_(False)  # frozen: the sampler's packed LM head is kept across batches
    return net, tokenizer


def generate_completions(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict],
    *,
    batch_size: int = 8,
    num_samples: int = 1,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop: Sequence[str] = (),
    system_prompt: str = "",
    seed: int = 0,
    seeds: Sequence[int] | None = None,
    autocast: Any = None,
    progress: bool = True,
    return_lengths: bool = False,
    env: Any = None,
    episodes: list | None = None,
) -> list[list[str]] | tuple[list[list[str]], list[list[int]]]:
    """`num_samples` completions for each row (temperature 0 = greedy), in row order. A completion that
    hits a stop string ends right after it, the stop string kept, as in training (sampling.finish_text).

    `seeds`: one per row, each row sampling from its own generator, so its completions do not depend on the
    rows batched with it (else one generator, seeded by `seed`, serves the batches in turn). `autocast`: a
    float32 model's compute dtype (sampling.generate). `return_lengths`: also each completion's token count,
    as the trainer counts it (the token that ended it included).

    `env` (an envs.spec.EnvSpec): each completion is an episode in that environment, played greedily (or at
    `temperature`) with the loop training runs, `batch_size` rows at a time; the texts are the last turns,
    and `episodes`, when a list, receives every episode's record (transcript, reward, info)."""
    if env is not None:
        return _episodes(model, tokenizer, rows, env, episodes, num_samples=num_samples,
                         max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                         stop=stop, system_prompt=system_prompt, seed=seed, seeds=seeds, autocast=autocast,
                         return_lengths=return_lengths, batch_size=batch_size)  # fmt: skip
    import torch
    from tqdm import tqdm

    from nanogrpo.data import render_prompt
    from nanogrpo.model.fast.sampler import generate
    from nanogrpo.policy import eos_and_pad

    prompts = [render_prompt(tokenizer, row, system_prompt=system_prompt) for row in rows]
    # Longest first: similar lengths share a batch (less padding) and an OOM shows up at once.
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    eos, pad_id = eos_and_pad(model.config, tokenizer)
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    out: list[list[str]] = [[] for _ in rows]
    lengths: list[list[int]] = [[] for _ in rows]
    bar = tqdm(total=len(rows), desc="generate", unit="prompt", disable=not progress)
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        if seeds is not None:
            gen = [torch.Generator(device=device).manual_seed(seeds[i]) for i in idx]
        with torch.no_grad():
            g = generate(
                model,
                [prompts[i] for i in idx],
                group_size=num_samples,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                eos_ids=tuple(eos),
                stop_strings=tuple(stop),
                tokenizer=tokenizer,
                generator=gen,
                pad_id=pad_id,
                autocast=autocast,
            )
        # the training loop's decoding rule: a completion that hit a stop string ends right after it
        for r, (text, n) in enumerate(zip(g.texts(tokenizer, stop), g.lengths.tolist())):
            out[idx[r // num_samples]].append(text)
            lengths[idx[r // num_samples]].append(n)
        bar.update(len(idx))
    bar.close()
    return (out, lengths) if return_lengths else out


def _episodes(model, tok, rows, env, episodes, *, num_samples, max_new_tokens, temperature, top_p, top_k, stop,
              system_prompt, seed, seeds, autocast, return_lengths, batch_size):  # fmt: skip
    """generate_completions with an environment: episodes, a batch of every row at once."""
    from nanogrpo.config import SamplingConfig
    from nanogrpo.envs.episode import play_rows

    s = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                       stop=tuple(stop))  # fmt: skip
    recs = play_rows(model, tok, list(rows), env, s, num_samples=num_samples, seed=seed, seeds=seeds,
                     system_prompt=system_prompt, autocast=autocast, batch_rows=batch_size)  # fmt: skip
    if episodes is not None:
        episodes.extend(recs)
    k = num_samples
    out = [[r["completion"] for r in recs[i * k : (i + 1) * k]] for i in range(len(rows))]
    lengths = [[r["tokens"] for r in recs[i * k : (i + 1) * k]] for i in range(len(rows))]
    return (out, lengths) if return_lengths else out
