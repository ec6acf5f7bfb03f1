"""Tokens/s of nanogrpo's sampler against transformers' `generate`, same model, batch and lengths.

Both sample P prompts x G completions x N new tokens (temperature 1, no top-k/top-p, EOS off by default so
every completion has exactly N tokens and both sides do the same work). transformers expands the prompts
to P*G rows before its prefill (num_return_sequences); nanogrpo prefills P rows and expands the cache.

    python bench/generate.py --model smollm2 --prompts 4 --group 8 --new-tokens 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanogrpo.model import ModelArgs, Transformer  # noqa: E402
from nanogrpo.model_zoo import resolve_model  # noqa: E402
from nanogrpo.sampling import generate  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors and explain briefly why they are called primary.",
    "What is 12 + 35?",
    "Write one sentence about the moon.",
    "Which is larger, an elephant or a mouse? Reply with one word.",
    "Translate 'good morning' into Italian.",
    "Give a short definition of photosynthesis.",
    "What is the boiling point of water at sea level in degrees Celsius?",
]


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    """Chat-formatted prompts of mixed lengths (as in training), cycling through QUESTIONS."""
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        else:
            text = msgs[0]["content"]
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def eos_ids(path: Path) -> list[int]:
    cfg = json.loads((path / "config.json").read_text())
    gen = path / "generation_config.json"
    return ModelArgs.from_hf(cfg, json.loads(gen.read_text()) if gen.is_file() else None).eos_token_ids


def timed(fn, warmup: int, repeats: int) -> tuple[list[float], list[float]]:
    """Wall-clock and process CPU seconds of each repeat. CPU time is the steadier number on a shared
    machine (with one thread it is the compute actually spent); wall time is what a user waits."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="'tiny', 'smollm2' or an HF model folder")
    ap.add_argument("--prompts", type=int, default=4, help="P: prompts per batch")
    ap.add_argument("--group", type=int, default=8, help="G: completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="N: tokens per completion")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--eos", action="store_true", help="stop at EOS (lengths then differ between the two)")
    ap.add_argument("--greedy", action="store_true", help="temperature 0 instead of 1")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per sampler (the median is shown)")
    ap.add_argument("--only", choices=["nanogrpo", "transformers"], default=None, help="run one side only")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = make_prompts(tok, args.prompts)
    P, G, N = args.prompts, args.group, args.new_tokens
    eos = eos_ids(path) if args.eos else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    temperature = 0.0 if args.greedy else 1.0
    results: dict[str, tuple[tuple[list[float], list[float]], int]] = {}

    if args.only != "transformers":
        model = Transformer.from_pretrained(path, dtype=dtype, device=args.device)
        gen = torch.Generator(args.device).manual_seed(0)
        ntok = []

        def ours():
            g = generate(
                model, prompts, group_size=G, max_new_tokens=N, temperature=temperature,
                eos_ids=eos, generator=gen, pad_id=pad,
            )  # fmt: skip
            ntok.append(int(g.mask.sum()))

        results["nanogrpo"] = (timed(ours, args.warmup, args.repeats), ntok[-1])
        del model

    if args.only != "nanogrpo":
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
        L = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts], device=args.device)
        attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=args.device)
        cfg = GenerationConfig(
            max_new_tokens=N,
            do_sample=not args.greedy,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=G,
            eos_token_id=eos or None,
            pad_token_id=pad,
        )
        ntok = []

        def theirs():
            torch.manual_seed(0)
            with torch.inference_mode():
                out = hf.generate(input_ids=ids, attention_mask=attn, generation_config=cfg)
            new = out[:, L:]
            if eos:  # count up to and including the first EOS, as our mask does
                done = torch.isin(new, torch.tensor(eos, device=new.device)).long().cumsum(1)
                ntok.append(int(((done == 0) | ((done == 1) & torch.isin(new, torch.tensor(eos)))).sum()))
            else:
                assert new.shape == (P * G, N), (
                    f"transformers returned {tuple(new.shape)}, wanted {(P * G, N)}"
                )
                ntok.append(new.numel())

        results["transformers"] = (timed(theirs, args.warmup, args.repeats), ntok[-1])

    lens = [len(p) for p in prompts]
    print(
        f"\nmodel {args.model} | {args.dtype} on {args.device}, {torch.get_num_threads()} threads | "
        f"P={P} prompts ({min(lens)}-{max(lens)} tokens) x G={G} x N={N} new tokens | "
        f"{'greedy' if args.greedy else 'T=1'}, EOS {'on' if args.eos else 'off'}"
    )
    print(f"{'sampler':<14}{'wall s':>9}{'cpu s':>9}{'tokens':>8}{'tok/s wall':>12}{'tok/s cpu':>11}")
    tps: dict[str, tuple[float, float]] = {}
    for name, ((wall, cpu), n) in results.items():
        w, c = statistics.median(wall), statistics.median(cpu)
        tps[name] = (n / w, n / c)
        print(f"{name:<14}{w:>9.2f}{c:>9.2f}{n:>8}{n / w:>12.1f}{n / c:>11.1f}")
    if len(tps) == 2:
        (ow, oc), (tw, tc) = tps["nanogrpo"], tps["transformers"]
        print(
            f"{'ratio':<14}{'':>9}{'':>9}{'':>8}{ow / tw:>11.2f}x{oc / tc:>10.2f}x  (nanogrpo / transformers)"
        )
    print("reproduce: python " + " ".join(shlex.quote(a) for a in ["bench/generate.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
