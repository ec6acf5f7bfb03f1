"""Tokens/s of nanogrpo's sampler against transformers' `generate`, same model, batch and lengths.

Both sample P prompts x G completions x N new tokens (temperature 1, no top-k/top-p, EOS off by default so
every completion has exactly N tokens and both sides do the same work). transformers expands the prompts
to P*G rows before its prefill (num_return_sequences); nanogrpo prefills P rows and expands the cache.
The two take turns (one call each, --repeats times, after a warm-up call each), so a machine whose speed
drifts (a shared VM: 20% between minutes here) slows both alike; the table shows the medians and each
turn's ratio. On a CPU the process keeps its freed memory, as train.py does (nanogrpo/infra/heap.py); the
transformers side runs with that too.

    python bench/generate.py --model smollm2 --prompts 4 --group 8 --new-tokens 64 --dtype bfloat16
    python bench/generate.py --model random:qwen2.5-1.5b --device cuda --roofline 1,64 --json gen.json

--roofline B1,B2 also times nanogrpo's decode step alone at each batch (P x G rows) and compares the bytes
a step must read (weights + KV cache) per second with the device's copy bandwidth (measured here, or
--peak-gbs), and its FLOPs per second with the machine's matmul rate (a large matmul, timed in turns with
the step's calls): the share of each roofline that decoding reaches, the step's floor (the slower of the
two) and the step's time over it ('x floor', with each turn's ratio on a line below). On a CPU it is on by
default at P x G, and the ceilings (copy GB/s, float32 and bf16 matmul GFLOP/s) are printed.
--decode eager,static,compiled gives a row per decode loop of the sampler (--sampling.decode), side by side,
in the samplers' table and in the roofline's; a compiled loop's first call (the compile) is timed apart. The
loops that replay a CUDA graph (graph, compiled-graph) run on a GPU only; elsewhere their rows are skipped with
a line saying so.

--stop 'A,B' gives nanogrpo's sampler stop strings (its side only: the transformers side is then skipped);
strings that never occur make every step check every row, what the check costs.

Works without transformers (its side is skipped, with a line saying so) and without a tokenizer (the
prompts are then plain questions through `tokenizers`, or random token ids), so a random model of a real
shape ('random:qwen2.5-0.5b', see nanogrpo.model.zoo) runs on a machine with torch alone; without
safetensors such a model is built in memory.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanogrpo.infra.cpu import cpu_capability  # noqa: E402
from nanogrpo.infra.heap import keep_freed_memory  # noqa: E402
from nanogrpo.model.fast.packed import packing_supported  # noqa: E402
from nanogrpo.model.fast.sampler import generate  # noqa: E402
from nanogrpo.model.fast.static_decode import GRAPHED  # noqa: E402
from nanogrpo.model.hf_config import ModelArgs  # noqa: E402
from nanogrpo.model.transformer import Transformer  # noqa: E402
from nanogrpo.model.zoo import random_config, random_transformer, resolve_model  # noqa: E402

MM_REPEATS = 5  # matmuls per turn of the decode roofline; the fastest gives that turn's rate
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

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


def make_prompts(path: Path, n: int, vocab: int) -> tuple[list[list[int]], object, str]:
    """Chat-formatted prompts of mixed lengths (as in training), cycling through QUESTIONS. Without
    transformers, the plain questions through `tokenizers`; without a tokenizer at all, random token ids
    of mixed lengths (a random-weights model does not care). Returns (prompts, tokenizer or None, how)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path) if path.is_dir() else None
    except (ImportError, OSError, ValueError):
        tok = None
    if tok is not None:
        out = []
        for i in range(n):
            msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
            if tok.chat_template:
                text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            else:
                text = msgs[0]["content"]
            out.append(tok.encode(text, add_special_tokens=False))
        return out, tok, "chat template (transformers)"
    try:
        from tokenizers import Tokenizer

        raw = Tokenizer.from_file(str(path / "tokenizer.json"))
        return (
            [raw.encode(QUESTIONS[i % len(QUESTIONS)]).ids for i in range(n)],
            None,
            "tokenizers, no template",
        )
    except Exception:  # no tokenizers package or no tokenizer.json
        g = torch.Generator().manual_seed(0)
        lens = [12 + 7 * (i % 5) for i in range(n)]
        ids = [torch.randint(3, min(vocab, 1024), (k,), generator=g).tolist() for k in lens]
        return ids, None, "random token ids (no tokenizer)"


def model_args(path: Path) -> ModelArgs:
    cfg = json.loads((path / "config.json").read_text())
    gen = path / "generation_config.json"
    return ModelArgs.from_hf(cfg, json.loads(gen.read_text()) if gen.is_file() else None)


def timed(fn, warmup: int, repeats: int) -> tuple[list[float], list[float]]:
    """Wall-clock and process CPU seconds of each repeat. CPU time is the steadier number on a shared
    machine (with one thread it is the compute actually spent); wall time is what a user waits."""
    return taking_turns({"fn": fn}, warmup, repeats)["fn"][0]


def taking_turns(samplers: dict, warmup: int, repeats: int) -> dict[str, tuple[tuple[list, list], object]]:
    """`timed` for several calls (name -> fn) taking turns, A B A B ..., so that a machine whose speed
    drifts over the minutes (a shared VM) slows each alike. Returns name -> ((wall seconds, CPU seconds)
    of each repeat, what its last call returned)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in samplers.values():
        for _ in range(warmup):
            fn()
    times = {name: ([], []) for name in samplers}
    last = dict.fromkeys(samplers)
    for _ in range(repeats):
        for name, fn in samplers.items():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            last[name] = fn()
            sync()
            times[name][0].append(time.perf_counter() - t0)
            times[name][1].append(time.process_time() - c0)
    return {name: (times[name], last[name]) for name in samplers}


def copy_bandwidth_gbs(device: str) -> float:
    """Device-to-device copy (bytes read + written per second), as bench/kernel_timings.py measures it."""
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)  # 1 GiB: many times the L2
    y = torch.empty_like(x)
    wall, _ = timed(lambda: y.copy_(x), warmup=2, repeats=10)
    return 2 * x.numel() * x.element_size() / statistics.median(wall) / 1e9


def matmul_call(dtype: torch.dtype, device: str) -> tuple[Callable[[], object], int] | None:
    """One large matmul (1024 x 2048 @ 2048 x 2048) and its FLOPs: what the machine's matmul rate is timed
    with; None if the dtype's matmul does not run here (no bf16 units: emulated, not a ceiling to quote)."""
    if device == "cpu" and dtype == torch.bfloat16 and not cpu_capability().onednn_bf16:
        return None
    x = torch.randn(1024, 2048, device=device).to(dtype)
    w = torch.randn(2048, 2048, device=device).to(dtype)
    return (lambda: torch.mm(x, w)), 2 * 1024 * 2048 * 2048


def matmul_gflops(dtype: torch.dtype, device: str) -> float | None:
    """The machine's matmul rate at a large shape, GFLOP/s (None: see matmul_call). On a CPU this is the
    compute ceiling a decode step's matmuls can reach."""
    if (mm := matmul_call(dtype, device)) is None:
        return None
    wall, _ = timed(mm[0], warmup=2, repeats=5)
    return mm[1] / statistics.median(wall) / 1e9


def cpu_copy_gbs() -> float:
    """CPU copy bandwidth (bytes read + written per second) over 256 MiB, many times the last-level cache."""
    x = torch.empty(1 << 26, dtype=torch.float32)
    y = torch.empty_like(x)
    wall, _ = timed(lambda: y.copy_(x), warmup=2, repeats=10)
    return 2 * x.numel() * 4 / statistics.median(wall) / 1e9


def decode_roofline(
    model, prompts, batch: int, a, pad: int, peak: float, loops: list[str], mm=None
) -> list[dict]:
    """For each decode loop: seconds per decode step at `batch` rows (P prompts x G), from two timings of the
    same prompts ((t(N new tokens) - t(1 new token)) / (N - 1): the prefill and the first draw cancel), and
    the bytes a step must read at least: every weight once (the embedding table only as the tied LM head)
    plus the KV cache (each prompt's keys once per group, as the sampler shares them, and on average N/2 keys
    of each completion's own). Utilisation = those bytes / step time / peak bandwidth.

    The step's floor is the slower of its bytes at `peak` and its FLOPs at the matmul rate. Every loop's two
    calls and `mm` (matmul_call's (call, FLOPs): the best of MM_REPEATS matmuls) take turns, so the loops and
    the rate are measured in the same minutes: on a shared VM whose speed drifts by 20-40% between minutes,
    a rate taken once moved the step / floor ratio from 1.3x to 2.0x between runs. Each turn's ratio is kept."""
    G = min(a.group, batch)
    P = batch // G
    assert P * G == batch and P <= len(prompts), f"batch {batch} is not P x G with G={G}"
    prompts, N = prompts[:P], a.new_tokens
    gen = torch.Generator(a.device).manual_seed(0)

    def run(n: int, decode: str) -> None:
        generate(model, prompts, group_size=G, max_new_tokens=n, generator=gen, pad_id=pad, decode=decode)

    calls = {}
    for d in loops:
        calls[f"{d} full"], calls[f"{d} one"] = functools.partial(run, N, d), functools.partial(run, 1, d)
    best: list[float] = []  # each turn's fastest matmul, seconds
    if mm is not None:
        calls["mm"] = lambda: best.append(min(timed(mm[0], warmup=0, repeats=MM_REPEATS)[0]))
    turns = {name: wall for name, ((wall, _), _) in taking_turns(calls, a.warmup, a.repeats).items()}
    rates = [mm[1] / t / 1e9 for t in best[-a.repeats :]] if mm is not None else []  # each turn's GFLOP/s
    rate = statistics.median(rates) if rates else None
    c, w = model.config, model.lm_head.weight
    tied = w is model.model.embed_tokens.weight
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    if not tied:  # an untied embedding table is only gathered (B rows), not read whole
        weights -= model.model.embed_tokens.weight.numel() * w.element_size()
    elem = w.element_size() if w.is_cuda else 4  # the CPU sampler keeps a float32 cache
    kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * elem  # bytes per cached token
    kv = (P * max(map(len, prompts)) + batch * N / 2) * kv_token
    # every weight is one multiply-add per row, the LM head included (the embedding gather is free)
    matmul_params = sum(p.numel() for p in params) - (0 if tied else model.model.embed_tokens.weight.numel())
    flops = 2 * batch * matmul_params  # attention's own FLOPs are small at these lengths

    def floor(gflops: float | None) -> float:
        """Seconds: the step cannot beat its bytes at copy speed or its FLOPs at the matmul rate."""
        return max((weights + kv) / (peak * 1e9) if peak else 0.0, flops / (gflops * 1e9) if gflops else 0.0)

    rows = []
    for d in loops:
        full, one = turns[f"{d} full"], turns[f"{d} one"]
        t_full, t_one = statistics.median(full), statistics.median(one)
        t_step = max(t_full - t_one, 1e-9) / (N - 1)
        steps = [max(f - o, 1e-9) / (N - 1) for f, o in zip(full, one)]  # each turn's step
        # what one decode step dispatches, by the same difference: ATen ops on the host, kernels on the GPU
        (aten_n, kern_n), (aten_1, kern_1) = (op_counts(calls[f"{d} {n}"], a.device) for n in ("full", "one"))
        aten_step, kern_step = (aten_n - aten_1) / (N - 1), (kern_n - kern_1) / (N - 1)
        launches = kern_step if a.device.startswith("cuda") else aten_step
        gbs = (weights + kv) / t_step / 1e9
        rows.append({
            "batch": batch, "decode": d, "P": P, "G": G, "new_tokens": N, "prompt_len_max": max(map(len, prompts)),
            "t_call_s": t_full, "t_prefill_s": t_one, "t_step_ms": t_step * 1e3, "decode_tok_per_s": batch / t_step,
            "aten_ops_step": aten_step, "kernels_step": kern_step,
            "us_per_launch": t_step * 1e6 / launches if launches > 0 else None,
            "weight_bytes": weights, "kv_bytes_mean": kv, "GBps": gbs, "peak_GBps": peak or None,
            "utilisation": gbs / peak if peak else None, "flops_step": flops, "GFLOPs": flops / t_step / 1e9,
            "matmul_GFLOPs": rate, "matmul_GFLOPs_turns": rates, "floor_ms": floor(rate) * 1e3,
            "x_floor": t_step / floor(rate) if floor(rate) else None,
            "x_floor_turns": [t / floor(r) for t, r in zip(steps, rates)] if floor(rate) else [],
        })  # fmt: skip
    return rows


def op_counts(fn, device: str) -> tuple[int, int]:
    """(ATen ops dispatched on the host, kernels run on the GPU) in one call of fn, counted by the profiler
    (nested ops count: aten::linear and the aten::addmm it calls are two)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    aten = sum(1 for e in events if e.name.startswith("aten::") and e.device_type == DeviceType.CPU)
    return aten, sum(1 for e in events if e.device_type == DeviceType.CUDA)


def load_ours(name: str, path: Path | None, dtype: torch.dtype, device: str, lora_r: int = 0) -> Transformer:
    """The model frozen, as eval.py and a LoRA run's base are (the sampler keeps a frozen LM head packed).
    lora_r > 0: float32 LoRA adapters (alpha 2r) on every projection, trainable, as a training run's policy
    has them when it samples (a random B, so they change the outputs as a trained adapter does)."""
    if path is None:
        model = random_transformer(name, device=device, dtype=dtype)
    else:
        model = Transformer.from_pretrained(path, dtype=dtype, device=device)
    model.requires_grad_(False)
    if lora_r > 0:
        from nanogrpo.model import lora

        lora.inject_lora(model, r=lora_r, alpha=2.0 * lora_r, dropout=0.0, targets=LORA_TARGETS)
        with torch.no_grad():
            for name_, p in model.named_parameters():
                if "lora_B" in name_:
                    p.normal_(0, 1e-3)
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="'tiny', 'smollm2', 'random:SHAPE' or an HF folder")
    ap.add_argument("--prompts", type=int, default=4, help="P: prompts per batch")
    ap.add_argument("--group", type=int, default=8, help="G: completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="N: tokens per completion")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--eos", action="store_true", help="stop at EOS (lengths then differ between the two)")
    ap.add_argument(
        "--stop", default="", help="stop strings for nanogrpo's sampler, comma-separated (its side only)"
    )
    ap.add_argument("--greedy", action="store_true", help="temperature 0 instead of 1")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--repeats", type=int, default=5, help="timed calls per sampler, taking turns (median shown)"
    )
    ap.add_argument("--only", choices=["nanogrpo", "transformers"], default=None, help="run one side only")
    ap.add_argument(
        "--roofline",
        default="auto",
        help="decode batches to time against the roofline, e.g. 1,64 ('auto': P x G on a CPU, off on a GPU; '' off)",
    )
    ap.add_argument("--peak-gbs", type=float, default=0.0, help="peak bandwidth (0: measure a copy on CUDA)")
    ap.add_argument(
        "--lora-r",
        type=int,
        default=0,
        help="nanogrpo side: LoRA adapters of rank R on every projection, as training samples",
    )
    ap.add_argument(
        "--decode", default="eager",
        help="decode loops to time (--sampling.decode), comma-separated: eager, static, compiled, graph, "
        "compiled-graph (the last two on a GPU)",
    )  # fmt: skip
    ap.add_argument("--json", default="", help="also write every measurement to this file")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cpu":  # as train.py and eval.py run on a CPU; the transformers side gets it too
        keep_freed_memory()
    dtype = getattr(torch, args.dtype)
    P, G, N = args.prompts, args.group, args.new_tokens
    if args.roofline == "auto":
        args.roofline = str(P * G) if args.device == "cpu" else ""
    batches = [int(b) for b in args.roofline.split(",") if b]
    notes: list[str] = []
    # a random model without safetensors is built in memory (no folder, no tokenizer, no transformers side)
    in_memory = args.model.startswith("random:") and importlib.util.find_spec("safetensors") is None
    path = None if in_memory else resolve_model(args.model)
    if in_memory:
        notes.append("safetensors missing: random model built in memory, transformers side skipped")
    cfg = random_config(args.model.removeprefix("random:")) if in_memory else None
    margs = ModelArgs.from_hf(cfg) if cfg else model_args(path)
    n_prompts = max([P] + [b // min(G, b) for b in batches])
    prompts, tok, how = make_prompts(path or Path("/nonexistent"), n_prompts, margs.vocab_size)
    eos = margs.eos_token_ids if args.eos else []
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else margs.pad_token_id or 0
    temperature = 0.0 if args.greedy else 1.0
    only = args.only
    stops = [x for x in args.stop.split(",") if x]
    if stops and tok is None:
        sys.exit("--stop needs the model's tokenizer (a model folder with one)")
    if stops and only != "nanogrpo":
        notes.append("--stop: transformers side skipped (the stop strings are nanogrpo's side only)")
        only = "nanogrpo"
    if only != "nanogrpo" and (in_memory or importlib.util.find_spec("transformers") is None):
        if only == "transformers":
            sys.exit("--only transformers: transformers is not installed (or the model has no folder)")
        notes.append("transformers side skipped: transformers is not installed (pip install transformers)")
        only = "nanogrpo"
    roofline: list[dict] = []
    ceilings: dict = {}
    peak, peak_from = args.peak_gbs, "--peak-gbs"

    samplers = {}  # name -> one call of that sampler, returning the tokens it generated
    if only != "transformers":
        model = load_ours(args.model, path, dtype, args.device, args.lora_r)
        if args.lora_r:
            notes.append(
                f"nanogrpo samples with LoRA r={args.lora_r} on every projection (transformers: none)"
            )
        gen = torch.Generator(args.device).manual_seed(0)
        loops = args.decode.split(",")
        if not args.device.startswith("cuda") and (graphed := [d for d in loops if d in GRAPHED]):
            notes.append(f"{', '.join(graphed)}: skipped, a CUDA graph needs a GPU")
            loops = [d for d in loops if d not in GRAPHED]

        def ours(decode: str) -> Callable[[], int]:
            def call() -> int:
                g = generate(
                    model, prompts[:P], group_size=G, max_new_tokens=N, temperature=temperature,
                    eos_ids=eos, stop_strings=stops, tokenizer=tok, generator=gen, pad_id=pad, decode=decode,
                )  # fmt: skip
                return int(g.mask.sum())

            return call

        for d in loops:  # a row per decode loop; the eager one is 'nanogrpo'
            name = "nanogrpo" if d == "eager" else f"nanogrpo {d}"
            samplers[name] = ours(d)
            if d.startswith("compiled"):  # its first call compiles the step: timed apart, then warm
                t0 = time.perf_counter()
                samplers[name]()
                notes.append(
                    f"{name}: the first call took {time.perf_counter() - t0:.1f} s (compiling the step)"
                )

    if only != "nanogrpo":
        from transformers import AutoModelForCausalLM, GenerationConfig

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
        L = max(len(p) for p in prompts[:P])
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts[:P]], device=args.device)
        attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts[:P]], device=args.device)
        gcfg = GenerationConfig(
            max_new_tokens=N,
            do_sample=not args.greedy,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=G,
            eos_token_id=eos or None,
            pad_token_id=pad,
        )

        def theirs() -> int:
            torch.manual_seed(0)
            with torch.inference_mode():
                out = hf.generate(input_ids=ids, attention_mask=attn, generation_config=gcfg)
            new = out[:, L:]
            if eos:  # count up to and including the first EOS, as our mask does
                is_eos = torch.isin(new, torch.tensor(eos, device=new.device))
                done = is_eos.long().cumsum(1)
                return int(((done == 0) | ((done == 1) & is_eos)).sum())
            assert new.shape == (P * G, N), f"transformers returned {tuple(new.shape)}, wanted {(P * G, N)}"
            return new.numel()

        samplers["transformers"] = theirs

    results = taking_turns(samplers, args.warmup, args.repeats)
    if "nanogrpo" in samplers:
        if batches:
            if not peak and args.device.startswith("cuda"):
                peak, peak_from = copy_bandwidth_gbs(args.device), "measured device copy"
            elif not peak:
                peak, peak_from = cpu_copy_gbs(), "measured CPU copy"
            mm = matmul_call(dtype, args.device)
            rate = matmul_gflops(dtype, args.device)
            ceilings = {"copy_GBps": peak, "matmul_GFLOPs": rate, "dtype": args.dtype}
            if args.device == "cpu":
                other = torch.float32 if dtype != torch.float32 else torch.bfloat16
                ceilings[f"matmul_GFLOPs_{str(other).split('.')[1]}"] = matmul_gflops(other, args.device)
            roofline = [  # one row per batch and decode loop; a batch's loops take turns
                row for b in batches for row in decode_roofline(model, prompts, b, args, pad, peak, loops, mm)
            ]
        del model

    lens = [len(p) for p in prompts[:P]]
    c = margs
    shape = (
        f"{c.model_type}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads {c.num_attention_heads}"
        f"/{c.num_key_value_heads}, vocab {c.vocab_size}"
    )
    on = args.device
    if on == "cpu":  # which CPU path ran: packed bf16 (oneDNN) or float32 (MKL) weights where they run
        packed = packing_supported(torch.zeros(1, dtype=dtype))
        on = f"cpu {cpu_capability()}, packed weights {'on' if packed else 'off'}"
    print(
        f"\nmodel {args.model} ({shape}) | {args.dtype} on {on}, {torch.get_num_threads()} threads | "
        f"P={P} prompts ({min(lens)}-{max(lens)} tokens: {how}) x G={G} x N={N} new tokens | "
        f"{'greedy' if args.greedy else 'T=1'}, EOS {'on' if args.eos else 'off'}"
    )
    for n in notes:
        print(n)
    print(f"{'sampler':<18}{'wall s':>9}{'cpu s':>9}{'tokens':>8}{'tok/s wall':>12}{'tok/s cpu':>11}")
    tps: dict[str, tuple[float, float]] = {}
    for name, ((wall, cpu), n) in results.items():
        w, cp = statistics.median(wall), statistics.median(cpu)
        tps[name] = (n / w, n / cp)
        print(f"{name:<18}{w:>9.2f}{cp:>9.2f}{n:>8}{n / w:>12.1f}{n / cp:>11.1f}")
    for name in [n for n in tps if n.startswith("nanogrpo")] if "transformers" in tps else []:
        (ow, oc), (tw, tc) = tps[name], tps["transformers"]
        print(
            f"{'ratio':<18}{'':>9}{'':>9}{'':>8}{ow / tw:>11.2f}x{oc / tc:>10.2f}x  ({name} / transformers)"
        )
        turns = [t / o for o, t in zip(results[name][0][0], results["transformers"][0][0])]
        print(f"each turn's wall ratio: {', '.join(f'{r:.2f}x' for r in turns)} (the calls took turns)")
    if roofline:
        where = f"peak {peak:.0f} GB/s ({peak_from})" if peak else "no peak bandwidth: pass --peak-gbs"
        print(f"\ndecode vs the bandwidth roofline (weights + KV cache read per step), {where}")
        rate = ceilings.get("matmul_GFLOPs")
        if ceilings:
            rates = ", ".join(
                f"{k.removeprefix('matmul_GFLOPs_') or args.dtype} {v:.0f}"
                if v
                else f"{k.removeprefix('matmul_GFLOPs_')} n/a"
                for k, v in ceilings.items()
                if k.startswith("matmul_GFLOPs") and k != "matmul_GFLOPs"
            )
            print(
                f"machine ceilings: copy {peak:.1f} GB/s, matmul {args.dtype} "
                f"{(rate or 0):.0f} GFLOP/s{', ' + rates if rates else ''} (1024x2048 @ 2048x2048)"
            )
        head = f"{'batch':>6}{'decode':>10}{'P x G':>8}{'ms/step':>10}{'tok/s':>10}{'MB/step':>10}{'GB/s':>9}"
        launch = "kernels" if args.device.startswith("cuda") else "aten ops"
        head += (
            f"{'of peak':>9}{'GFLOP/s':>9}{'of mm':>7}{'floor ms':>10}{'x floor':>9}{launch + '/step':>15}"
        )
        print(head + f"{'us/launch':>11}")
        for r in roofline:
            util = f"{100 * r['utilisation']:.0f}%" if r["utilisation"] is not None else "-"
            mb = (r["weight_bytes"] + r["kv_bytes_mean"]) / 1e6
            pg = f"{r['P']}x{r['G']}"
            share = f"{100 * r['GFLOPs'] / r['matmul_GFLOPs']:.0f}%" if r["matmul_GFLOPs"] else "-"
            times = f"{r['x_floor']:.2f}x" if r["x_floor"] else "-"
            print(
                f"{r['batch']:>6}{r['decode']:>10}{pg:>8}{r['t_step_ms']:>10.2f}{r['decode_tok_per_s']:>10.0f}"
                f"{mb:>10.0f}{r['GBps']:>9.0f}{util:>9}{r['GFLOPs']:>9.0f}{share:>7}{r['floor_ms']:>10.1f}{times:>9}"
                f"{r['kernels_step' if args.device.startswith('cuda') else 'aten_ops_step']:>15.0f}"
                f"{r['us_per_launch'] or 0:>11.1f}"
            )
        for r in (r for r in roofline if r["x_floor_turns"]):
            rates = ", ".join(f"{g:.0f}" for g in r["matmul_GFLOPs_turns"])
            print(
                f"batch {r['batch']} {r['decode']}: each turn's step / floor "
                f"{', '.join(f'{x:.2f}x' for x in r['x_floor_turns'])} (matmul GFLOP/s in those turns: {rates})"
            )
    print("reproduce: python " + " ".join(shlex.quote(a) for a in ["bench/generate.py", *sys.argv[1:]]))
    if args.json:
        out = {
            "args": vars(args), "model": {"name": args.model, "path": str(path) if path else None, **asdict(c)},
            "dtype": args.dtype, "device": args.device, "cpu": str(cpu_capability()),
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
            "torch": torch.__version__, "P": P, "G": G, "N": N, "prompt_lens": lens, "prompts_from": how,
            "notes": notes, "peak_GBps": peak or None, "peak_from": peak_from if peak else None,
            "samplers": {
                name: {"wall_s": wall, "cpu_s": cpu, "tokens": n, "tok_per_s_wall": tps[name][0]}
                for name, ((wall, cpu), n) in results.items()
            },
            "roofline": roofline, "ceilings": ceilings,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
