"""The episode rollout, continued against re-prefilled: the same episodes played both ways, side by side.

    python bench/episodes.py --model smollm2 --env guess --rows 4 --group 6      # the guess preset's rollout
    python bench/episodes.py --model tiny --env calc --repeats 1                 # seconds: a check that it runs

`continued` is the episode loop (nanogrpo/envs/episode.py play): each trajectory's cache carries over from turn
to turn, turn 1 prefills each first message once for its group, a later turn feeds only the new observation.
`re-prefilled` is the loop before it: every turn sends each live trajectory's whole history (prompt and every
turn so far) through `generate` again, with the same generators, environments and budgets. The two take turns
(`--repeats` each, medians), so a busy moment costs both sides. In float32 both play the same episodes
(tests/test_sampling.py checks that continuing equals re-prefilling); in bf16 they part where rounding flips a
token, so the tokens per second are the comparable numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nanogrpo.config import EnvConfig, SamplingConfig
from nanogrpo.data import render_prompt
from nanogrpo.envs.episode import _append_turns, _observe, _reset, _take, play, turn_seed
from nanogrpo.envs.spec import check_start, resolve_env
from nanogrpo.model.fast.sampler import generate
from nanogrpo.model.transformer import Transformer
from nanogrpo.model.zoo import load_tokenizer, resolve_model
from nanogrpo.policy import eos_and_pad
from nanogrpo.recipes import recipe_path


def play_reprefilled(model, tok, env, rows, seeds, s: SamplingConfig, G: int, eos, pad):
    """The episode loop before continuation: each turn, every live history through generate again."""
    stop = tuple(dict.fromkeys((*s.stop, *env.stop)))
    trajs = _reset(env, rows, seeds, G, tok, "")
    try:
        for turn in range(env.max_turns):
            live = [k for k, t in enumerate(trajs) if not t.over]
            if not live:
                break
            room = [env.max_tokens - len(trajs[k].ids) for k in live]
            gens = [torch.Generator().manual_seed(turn_seed(seeds[k // G], k % G, turn)) for k in live]
            out = generate(
                model, [trajs[k].prompt_ids + trajs[k].ids for k in live], max_new_tokens=max(1, min(s.max_new_tokens, max(room))),
                temperature=s.temperature, eos_ids=eos, stop_strings=stop, tokenizer=tok, generator=gens, pad_id=pad,
            )  # fmt: skip
            texts, on_eos = _append_turns(trajs, live, out, room, tok, stop, eos)
            replies = env.workers.call({k: ("step", (text, env.max_chars)) for k, text in texts.items()})
            for k in live:
                _take(trajs[k], *replies[k])
                _observe(trajs[k], env, tok, on_eos[k], last_turn=turn + 1 == env.max_turns)
    finally:
        env.workers.call({k: ("end", None) for k in range(len(trajs))})
    return trajs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--env", default="guess", choices=["guess", "calc", "search"])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--group", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    path = resolve_model(a.model)
    dtype = getattr(torch, a.dtype)
    tok, model = load_tokenizer(path), Transformer.from_pretrained(path, dtype=dtype).eval()
    rows = [json.loads(line) for line in recipe_path(a.env).read_text().splitlines()[: a.rows]]
    rows = [{**r, "_prompt_ids": render_prompt(tok, r)} for r in rows]
    s = SamplingConfig(max_new_tokens=a.max_new_tokens, temperature=1.0)
    env = resolve_env(EnvConfig(name=a.env, max_turns=a.max_turns, max_tokens=a.max_tokens), a.max_new_tokens)
    positions = model.config.max_position_embeddings
    env = check_start(env, tok, rows, "", positions - env.max_tokens, positions, len(rows) * a.group)
    eos, pad = eos_and_pad(model.config, tok)
    seeds = [(7 * i + 1) * 4099 for i in range(len(rows))]
    sides = {
        "continued": lambda: play(model, tok, env, rows, seeds, s, a.group, system_prompt="", eos_ids=tuple(eos),
                                  pad_id=pad),
        "re-prefilled": lambda: play_reprefilled(model, tok, env, rows, seeds, s, a.group, tuple(eos), pad),
    }  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in sides}
    counts: dict[str, tuple[int, int, float]] = {}
    with torch.inference_mode():
        for _ in range(a.repeats):
            for name, run in sides.items():
                t0 = time.perf_counter()
                trajs = run()
                times[name].append(time.perf_counter() - t0)
                sampled = sum(int(sum(t.mask)) for t in trajs)
                turns = sum(sum(x["role"] == "assistant" for x in t.turns) for t in trajs) / len(trajs)
                counts[name] = (sampled, sum(len(t.mask) for t in trajs) - sampled, turns)
    env.workers.close()

    print(f"episodes: {len(rows) * a.group} ({a.rows} rows x {a.group}), {a.env}, {a.model} {a.dtype}, "
          f"{torch.get_num_threads()} threads, {a.repeats} rollouts a side, taking turns")  # fmt: skip
    print(
        "| loop | s / rollout (median) | turns / episode | sampled tok/s | observation tok/s |\n|---|---|---|---|---|"
    )
    for name in sides:
        t = statistics.median(times[name])
        sampled, observed, turns = counts[name]
        print(f"| {name} | {t:.2f} | {turns:.2f} | {sampled / t:.1f} | {observed / t:.1f} |")
    ratio = statistics.median(times["re-prefilled"]) / statistics.median(times["continued"])
    print(f"\ncontinued / re-prefilled: {ratio:.2f}x faster a rollout")
    print(f"python bench/episodes.py --model {a.model} --dtype {a.dtype} --env {a.env} --rows {a.rows} --group {a.group} "
          f"--max-new-tokens {a.max_new_tokens} --max-turns {a.max_turns} --max-tokens {a.max_tokens}")  # fmt: skip


if __name__ == "__main__":
    main()
