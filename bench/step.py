"""Seconds per GRPO step and peak memory: nanogrpo's train.py against TRL's GRPOTrainer.

    python bench/step.py                              # SmolLM2-135M + LoRA r=16, P=2 x G=8, 32 new tokens
    python bench/step.py --model tiny --steps 2       # seconds, to check that both sides run
    python bench/step.py --threads 1 --repeat 2       # on a shared machine: 1 thread a side, twice
    python bench/step.py --model random:qwen2.5-1.5b --side nanogrpo --device cuda --plan  # plan vs peak

Both sides train the same model folder with the same LoRA (rank, alpha, target layers), dtype (bf16 on a
GPU or a bf16-capable CPU, as nanogrpo.infra.device.resolve_device_dtype picks), prompts (the built-in demo
task, same order), group size, batch (P prompts x G completions, one optimizer step each), sampling
(temperature 1, no top-k/top-p), reward (ROUGE-L against the reference) and loss (token-mean clipped
surrogate, eps 0.2, group-std advantages, no KL, no activation checkpointing unless --checkpointing).
Completions are forced to exactly --new-tokens tokens on both sides (nanogrpo: EOS ignored; TRL:
min_new_tokens), so the work per step is the same; the table prints the mean prompt and completion
lengths each side saw so that this can be checked. What differs is each trainer's own way of doing the
work (TRL samples with transformers `generate` on the PEFT model, one prefill per completion).

A step is timed from the start of sampling to the end of the optimizer step, after --warmup untimed
steps: wall seconds, and the process's CPU seconds (all threads), which a loaded machine disturbs less
than wall time (with one thread a side, CPU seconds are close to the time on a quiet machine). Each side
runs in its own subprocess, so memory is not shared: "peak RSS" is the process high-water mark (loading
included), "RSS added" the highest RSS sampled during the steps minus the RSS just before the first
step, and on CUDA the peak of torch.cuda.max_memory_allocated over the steps.

TRL is not a dependency of nanogrpo: the bench asks for it and prints the pip line when it is missing.

--plan checks bench/memory_plan.py against the measurement: it runs `memory_plan.py --model FOLDER --json`
on the same config.json with this run's settings (P, G, the longest prompt seen in tokens, new tokens,
micro-batch, checkpointing, LoRA rank; the log-prob tile at the kernel's real row count and at the plan's
default) and prints the predicted peak next to torch.cuda.max_memory_allocated. nanogrpo's side needs
transformers, tokenizers, safetensors, tyro, tqdm and numpy (train.py does); the bench says which are
missing before it starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memwatch import MemoryMonitor  # noqa: E402
from step_trl import run_trl, trl_install_line  # noqa: E402

from nanogrpo.model.lora import DEFAULT_TARGETS as TARGETS  # noqa: E402

FILLER = (
    "Background notes follow; they do not change the question. The quick brown fox jumps over the lazy "
    "dog while the river runs past old mills, green fields and quiet villages under a grey sky. "
).split()


def write_prompts(path: Path, n: int, filler_words: int) -> None:
    """The demo task's train rows (repeated to n), each prompt optionally lengthened by filler words."""
    from nanogrpo.recipes.demo import demo_rows

    rows = demo_rows("train", system=False)  # one user message, as in the recorded runs
    pad = " ".join(FILLER[i % len(FILLER)] for i in range(filler_words))
    with path.open("w") as f:
        for i in range(n):
            r = rows[i % len(rows)]
            text = (pad + "\n\n" if pad else "") + r["prompt"][-1]["content"]
            row = {"id": f"{r['id']}-{i}", "prompt": [{"role": "user", "content": text}]}
            f.write(json.dumps({**row, "reference": r["reference"]}) + "\n")


# ----------------------------------------------------------------------------------------------------------
# the two sides; each runs in its own process and returns a dict


def run_nanogrpo(a: argparse.Namespace, data: Path, out_dir: Path) -> dict:
    import train
    from nanogrpo import startup
    from nanogrpo.config import (
        DataConfig,
        GRPOConfig,
        LoraConfig,
        ModelConfig,
        OptimConfig,
        SamplingConfig,
        TrainConfig,
    )
    from nanogrpo.infra.metrics import read_jsonl
    from nanogrpo.model.fast import sampler
    from rewards.options import RewardConfig

    mem = MemoryMonitor()
    prompt_lens: list[float] = []
    prompt_max: list[int] = []
    generate = sampler.generate  # the sampler call of every default step (nanogrpo/rollout.py)

    cpu0: list[float] = []
    cpu_step: list[float] = []
    cpu_sample: list[float] = []
    console_line = startup.console_line

    def fixed_length_generate(model, prompts, **kw):
        # no EOS and no stop strings: every completion is exactly max_new_tokens long, as on the TRL side
        mem.start()
        cpu0.append(time.process_time())
        prompt_lens.append(sum(map(len, prompts)) / len(prompts))
        prompt_max.append(max(map(len, prompts)))
        out = generate(model, prompts, **{**kw, "eos_ids": (), "stop_strings": ()})
        cpu_sample.append(time.process_time() - cpu0[-1])
        return out

    def console_line_mark(m: dict) -> str:
        cpu_step.append(time.process_time() - cpu0[-1])  # called once a step, after the optimizer step
        return console_line(m)

    sampler.generate = fixed_length_generate
    startup.console_line = console_line_mark  # after_step prints the step's line through it
    cfg = TrainConfig(
        steps=a.warmup + a.steps,
        prompts_per_step=a.prompts,
        micro_batch=a.micro_batch,
        seed=0,
        out_dir=str(out_dir),
        log_samples_every=0,
        eval_prompts=0,
        model=ModelConfig(
            path=a.model, dtype=a.dtype, device=a.device, activation_checkpointing=a.checkpointing
        ),
        lora=LoraConfig(r=a.lora_r, alpha=2.0 * a.lora_r, targets=TARGETS),
        sampling=SamplingConfig(max_new_tokens=a.new_tokens, temperature=1.0),
        grpo=GRPOConfig(group_size=a.group),
        optim=OptimConfig(lr=1e-4),
        data=DataConfig(train=str(data), shuffle=False),
        reward=RewardConfig(spec="rouge_l:1"),
    )
    train.main(cfg)
    steps = read_jsonl(out_dir / "metrics.jsonl")
    timed = steps[a.warmup :]
    return {
        "version": "nanogrpo",
        "t_step": [s["t_step"] for s in timed],
        "t_sample": [s["t_sample"] for s in timed],
        "cpu_step": cpu_step[a.warmup :],
        "cpu_sample": cpu_sample[a.warmup :],
        "len_mean": statistics.mean(s["len_mean"] for s in timed),
        "prompt_len": statistics.mean(prompt_lens[a.warmup :]),
        "prompt_len_max": max(prompt_max),
        "micro_batch": a.micro_batch,
        "reward": statistics.mean(s["reward"] for s in timed),
        # how far the trainer's log-probs of the sampled tokens are from the sampler's (metrics.jsonl)
        "sampler_abs_diff": statistics.mean(s["sampler_abs_diff"] for s in timed),
        "sampler_kl": statistics.mean(s["sampler_kl"] for s in timed),
        "checkpointing": cfg.model.activation_checkpointing,
        **mem.result(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' or an HF model folder")
    p.add_argument("--prompts", type=int, default=2, help="P: prompts per step")
    p.add_argument("--group", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="completion length (forced on both sides)")
    p.add_argument(
        "--filler-words", type=int, default=0, help="words prepended to each prompt (longer prompts)"
    )
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha = 2r) on q,k,v,o,gate,up,down")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda', ...")
    p.add_argument("--threads", type=int, default=0, help="torch threads per side (0 = torch's default)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing on both sides")
    p.add_argument("--micro-batch", type=int, default=0, help="nanogrpo: completions per fwd/bwd (0 = all)")
    p.add_argument("--plan", action="store_true", help="compare bench/memory_plan.py with the CUDA peak")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--repeat", type=int, default=1, help="run both sides this many times, alternating")
    p.add_argument("--side", default="both", choices=["both", "nanogrpo", "trl"])
    p.add_argument("--json", default="", help="also write every measurement to this file")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--data", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


BENCH_FLAGS = "model prompts group new_tokens filler_words lora_r dtype device steps warmup threads".split()
BENCH_FLAGS += ["micro_batch"]
NANOGRPO_NEEDS = ("transformers", "tokenizers", "safetensors", "tyro", "tqdm", "numpy")


def flag_list(a: argparse.Namespace) -> list[str]:
    out = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in BENCH_FLAGS]
    return out + (["--checkpointing"] if a.checkpointing else [])


def run_side(a: argparse.Namespace, side: str, data: Path, tmp: Path, rep: int) -> dict:
    result, log = tmp / f"{side}-{rep}.json", tmp / f"{side}-{rep}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), *flag_list(a), "--worker", side]
    cmd += ["--data", str(data), "--result", str(result)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    print(f"[{rep + 1}/{a.repeat}] {side} ... (log: {log})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        sys.exit(f"{side} failed (exit {rc}); end of {log}:\n{tail}")
    return {**json.loads(result.read_text()), "wall_s": time.perf_counter() - t0}


def fmt_table(a: argparse.Namespace, runs: list[dict[str, dict]], hardware: str) -> str:
    sides = [s for s in ("nanogrpo", "trl") if s in runs[0]]
    head = [runs[0][s]["version"] for s in sides] + (["nanogrpo/TRL"] if len(sides) == 2 else [])
    lines = [
        f"GRPO step: {a.model}, LoRA r={a.lora_r}, P={a.prompts} prompts x G={a.group}, {a.new_tokens} new "
        f"tokens; {hardware}; mean of {a.steps} steps after {a.warmup} warm-up",
        f"{'':34}" + "".join(f"{h:>18}" for h in head),
    ]

    def row(name: str, r: dict, key, digits: int = 2, ratio: bool = True) -> None:
        vals = [key(r[s]) for s in sides]
        if any(v is None for v in vals):
            return
        cells = [v if isinstance(v, str) else f"{v:.{digits}f}" for v in vals]
        if ratio and len(sides) == 2:
            cells.append(f"{vals[0] / vals[1]:.2f}x")
        lines.append(f"{name:34}" + "".join(f"{c:>18}" for c in cells))

    def mean(x: list[float]) -> float:
        return statistics.mean(x)

    for i, r in enumerate(runs):
        if len(runs) > 1:
            lines.append(f"run {i + 1}")
        row("seconds / step", r, lambda x: mean(x["t_step"]))
        row("  min .. max", r, lambda x: f"{min(x['t_step']):.2f} .. {max(x['t_step']):.2f}", ratio=False)
        row("  sampling", r, lambda x: mean(x["t_sample"]))
        row("  scoring, loss, backward, optim", r, lambda x: mean(x["t_step"]) - mean(x["t_sample"]))
        row("CPU seconds / step (all threads)", r, lambda x: mean(x["cpu_step"]))
        row("  sampling", r, lambda x: mean(x["cpu_sample"]))
        row("  scoring, loss, backward, optim", r, lambda x: mean(x["cpu_step"]) - mean(x["cpu_sample"]))
        row("peak RSS of the process (GiB)", r, lambda x: x["peak_rss_gib"])
        row("RSS added during the steps (GiB)", r, lambda x: x["step_rss_gib"])
        row("CUDA peak allocated (GiB)", r, lambda x: x.get("cuda_peak_gib"))
        row("prompt tokens (mean)", r, lambda x: x["prompt_len"], 1, ratio=False)
        row("completion tokens (mean)", r, lambda x: x["len_mean"], 1, ratio=False)
        row("reward (mean ROUGE-L)", r, lambda x: x["reward"], 3, ratio=False)
        row("sampler-trainer |dlogp| / token", r, lambda x: x.get("sampler_abs_diff", "-"), 5, ratio=False)
    return "\n".join(lines)


def hardware_line(a: argparse.Namespace) -> str:
    import torch

    from nanogrpo.config import ModelConfig
    from nanogrpo.infra.device import resolve_device_dtype

    device, dtype = resolve_device_dtype(ModelConfig(path=a.model, dtype=a.dtype, device=a.device))
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        from nanogrpo.infra.cpu import cpu_capability

        where = f"CPU {cpu_capability()}, {a.threads or torch.get_num_threads()} threads"
    return f"{str(dtype).removeprefix('torch.')} on {where}, torch {torch.__version__}"


def check_plan(a: argparse.Namespace, r: dict) -> dict:
    """bench/memory_plan.py on the same config.json and settings; its peak next to the measured one."""
    from nanogrpo.model.zoo import resolve_model

    folder = resolve_model(a.model)
    cmd = [sys.executable, str(ROOT / "bench" / "memory_plan.py"), "--model", str(folder), "--json"]
    cmd += ["--lora-r", str(a.lora_r), "--prompts-per-step", str(a.prompts), "--group-size", str(a.group)]
    cmd += ["--prompt-len", str(r["prompt_len_max"]), "--max-new-tokens", str(a.new_tokens)]
    cmd += ["--micro-batch", str(a.micro_batch), "--fsdp-ranks", "0"]
    cmd += [] if a.checkpointing else ["--no-checkpointing"]
    plan = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)["plan"]
    plan = next(iter(plan.values()))
    measured = r.get("cuda_peak_gib")
    pred = plan["peak, fused (sampling and training apart)"]
    out = {
        "command": shlex.join(["python", "bench/memory_plan.py", *cmd[2:]]),
        "plan": plan,
        "predicted_gib": pred,
        "measured_cuda_peak_gib": measured,
        "ratio": measured / pred if measured else None,
    }
    print(
        f"\nmemory plan vs measured (one GRPO step, {a.model}, longest prompt {r['prompt_len_max']} tokens)"
    )
    print(f"  predicted peak {pred:7.2f} GiB")
    print(
        f"  measured torch.cuda.max_memory_allocated: {f'{measured:.2f} GiB' if measured else 'n/a (no CUDA)'}"
    )
    if measured:
        print(f"  measured / predicted {measured / pred:.2f}")
    print(f"  plan: {out['command']}")
    return out


def main() -> None:
    a = parse_args()
    if a.worker:
        if a.threads > 0:
            import torch

            torch.set_num_threads(a.threads)
        out_dir = Path(a.result).with_suffix("")
        run = run_nanogrpo if a.worker == "nanogrpo" else run_trl
        Path(a.result).write_text(json.dumps(run(a, Path(a.data), out_dir)))
        return
    sides = ["nanogrpo", "trl"] if a.side == "both" else [a.side]
    if "trl" in sides and a.micro_batch:
        raise ValueError("--micro-batch applies to nanogrpo's side only: add --side nanogrpo")
    missing = [m for m in NANOGRPO_NEEDS if importlib.util.find_spec(m) is None]
    if "nanogrpo" in sides and missing:
        sys.exit(
            f"cannot run nanogrpo's train.py: missing Python packages {', '.join(missing)} "
            "(pip install them, or offline put their wheels in .whl/: see bench/gpu_check.sh)"
        )
    if "trl" in sides:
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit(
                "TRL is not installed (it is not a nanogrpo dependency; the bench compares against it).\n"
                f"Install it next to the torch you have:\n    {trl_install_line()}\n"
                "(check first with --dry-run that pip keeps your torch), or run --side nanogrpo."
            )
    tmp = Path(tempfile.mkdtemp(prefix="nanogrpo-bench-step-"))
    data = tmp / "prompts.jsonl"
    write_prompts(data, max(64, a.prompts * (a.warmup + a.steps)), a.filler_words)
    runs = [{s: run_side(a, s, data, tmp, rep) for s in sides} for rep in range(a.repeat)]
    table = fmt_table(a, runs, hardware_line(a))
    print(table)
    cmd = "python bench/step.py " + " ".join(shlex.quote(f) for f in flag_list(a))
    cmd += f" --repeat={a.repeat}" if a.repeat > 1 else ""
    print(f"reproduce: {cmd}" + (f" --side={a.side}" if a.side != "both" else ""))
    plan = check_plan(a, runs[-1]["nanogrpo"]) if a.plan and "nanogrpo" in sides else None
    if a.json:
        out = {"args": vars(a), "table": table, "runs": runs, "plan_check": plan}
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
