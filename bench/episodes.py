"""The episode rollout (nanogrpo/envs/episode.py): sampled and observation tokens per second, and the share
of the time spent re-prefilling the history at every turn.

    python bench/episodes.py --model smollm2 --env guess --rows 4 --group 6
    python bench/episodes.py --model tiny --env calc          # seconds: a check that it runs

The rollout re-prefills each live trajectory's whole history through `generate` at every turn. The share
spent doing so is measured side by side in the same run: after the episodes, the same histories (each
turn's prompt, exactly as the rollout fed it) go through `generate` again with one new token, which is a
prefill and a single decode step. No KV-cache continuation is built: this is the number that would say
when one pays.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nanogrpo.config import EnvConfig, SamplingConfig
from nanogrpo.data import render_prompt
from nanogrpo.envs.episode import play
from nanogrpo.envs.spec import check_start, resolve_env
from nanogrpo.model.draw import eos_and_pad
from nanogrpo.model.sampling import generate
from nanogrpo.model.transformer import Transformer
from nanogrpo.model.zoo import load_tokenizer, resolve_model
from nanogrpo.recipes import recipe_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--env", default="guess", choices=["guess", "calc", "search"])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--group", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    a = ap.parse_args()
    torch.manual_seed(0)
    path = resolve_model(a.model)
    tok, model = load_tokenizer(path), Transformer.from_pretrained(path).eval()
    rows = [json.loads(line) for line in recipe_path(a.env).read_text().splitlines()[: a.rows]]
    s = SamplingConfig(max_new_tokens=a.max_new_tokens, temperature=1.0)
    env = resolve_env(EnvConfig(name=a.env, max_turns=a.max_turns, max_tokens=a.max_tokens), a.max_new_tokens)

    eos, pad = eos_and_pad(model.config, tok)
    rows = [{**r, "_prompt_ids": render_prompt(tok, r)} for r in rows]
    positions = model.config.max_position_embeddings
    env = check_start(env, tok, rows, "", positions - env.max_tokens, positions, len(rows) * a.group)
    t0 = time.perf_counter()
    with torch.no_grad():
        trajs = play(model, tok, env, rows, [(7 * i + 1) * 4099 for i in range(len(rows))], s, a.group,
                     system_prompt="", eos_ids=tuple(eos), pad_id=pad)  # fmt: skip
    t_play = time.perf_counter() - t0
    sampled = sum(int(sum(t.mask)) for t in trajs)
    observed = sum(len(t.mask) - int(sum(t.mask)) for t in trajs)
    # every turn's prompt exactly as the rollout fed it: the prompt and the history up to that turn's start
    prefixes: list[list[list[int]]] = []  # per turn: the histories of the episodes still live
    for t in trajs:
        starts = [i for i in range(len(t.mask)) if t.mask[i] == 1 and (i == 0 or t.mask[i - 1] == 0)]
        for k, i in enumerate(starts):
            while len(prefixes) <= k:
                prefixes.append([])
            prefixes[k].append(t.prompt_ids + t.ids[:i])
    t0 = time.perf_counter()
    with torch.no_grad():
        for batch in prefixes:
            generate(model, batch, max_new_tokens=1, temperature=1.0, eos_ids=tuple(eos), pad_id=pad)
    t_prefill = time.perf_counter() - t0
    t0 = (
        time.perf_counter()
    )  # what a generate call costs whatever its prompts: packing the weights, LoRA folded
    with torch.no_grad():
        for batch in prefixes:
            generate(
                model, [[1]] * len(batch), max_new_tokens=1, temperature=1.0, eos_ids=tuple(eos), pad_id=pad
            )
    t_fixed = time.perf_counter() - t0
    turns = sum(sum(x["role"] == "assistant" for x in t.turns) for t in trajs) / len(trajs)

    print(
        f"episodes: {len(trajs)} ({a.rows} rows x {a.group}), {a.env}, {a.model}, {torch.get_num_threads()} threads"
    )
    print("| what | value |\n|---|---|")
    print(f"| wall time of the rollout | {t_play:.2f} s |")
    print(f"| turns per episode | {turns:.2f} |")
    print(f"| sampled tokens / s | {sampled / t_play:.1f} |")
    print(f"| observation tokens / s | {observed / t_play:.1f} |")
    print(f"| the same histories through generate again, each turn (+1 token) | {t_prefill:.2f} s |")
    print(f"| of which a call's fixed cost (1-token prompts: packing the weights) | {t_fixed:.2f} s |")
    print(
        f"| share of the rollout spent re-prefilling (fixed cost excluded) | {(t_prefill - t_fixed) / t_play:.0%} |"
    )
    print(f"| share spent on the calls' fixed cost | {t_fixed / t_play:.0%} |")
    print(f"\npython bench/episodes.py --model {a.model} --env {a.env} --rows {a.rows} --group {a.group}")


if __name__ == "__main__":
    main()
