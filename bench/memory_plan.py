"""Memory plan for one GRPO step: how many GB each part takes on one GPU, computed from the model config.

    python bench/memory_plan.py                                  # Llama-3-8B and Qwen2.5-7B, the default plan
    python bench/memory_plan.py --model /models/Qwen2.5-7B-Instruct --group-size 16 --max-new-tokens 1024
    python bench/memory_plan.py --json
    python bench/memory_plan.py --model random:qwen2.5-1.5b --prompts-per-step 8 --max-new-tokens 256

--model takes a known name (below), 'random:SHAPE' (the shapes of nanogrpo.model.zoo.RANDOM_SHAPES:
qwen2.5-0.5b, qwen2.5-1.5b, llama-3-8b) or an HF folder with a config.json. `bench/step.py --plan` runs
this on the config.json of the model it trains and prints the prediction next to the measured CUDA peak.

The arithmetic is nanogrpo/model/memory.py's (`plan`, `plan_fsdp`: what each part counts, bytes per element, and
where it approximates), the same plan train.py checks at start-up (--memory-check); this prints it for a
GPU in bf16 with the Triton log-prob kernel. The first table is LoRA (r = --lora-r) on one GPU: weights,
adapters with their AdamW state, the sampler's KV cache, one training micro-batch's activations and the
log-prob kernel's backward chunk, next to the naive log-probs ([micro-batch x new tokens, V] float32 logits
plus their log_softmax) for comparison; sampling and training do not overlap, so the peak is the larger
phase on top of the weights. The sum is compared with the card's memory (--card-gb).

A second table (--fsdp-ranks N, 0 = skip) is a full fine-tune sharded with FSDP2 over N GPUs, per rank,
KL reference included, and the same full fine-tune unsharded on one GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanogrpo.model import memory  # noqa: E402
from nanogrpo.model.zoo import RANDOM_SHAPES, random_config  # noqa: E402

GB = memory.GiB

# the two configs of the plan (shapes only): Llama-3-8B as nanogrpo.model.zoo's random model has it, Qwen2.5-7B
# copied from its config.json
KNOWN = {
    "llama-3-8b": {**RANDOM_SHAPES["llama-3-8b"], "head_dim": 128},
    "qwen2.5-7b": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
    ),
}  # fmt: skip


def load_config(name_or_path: str) -> dict:
    """A known name's shapes, 'random:SHAPE' (nothing built), or a folder's config.json."""
    if name_or_path in KNOWN:
        return dict(KNOWN[name_or_path])
    if name_or_path.startswith("random:"):
        return memory.with_defaults(random_config(name_or_path.removeprefix("random:")))
    return memory.with_defaults(json.loads((Path(name_or_path) / "config.json").read_text()))


def step_of(a: argparse.Namespace, ranks: int = 1, reference: bool = False) -> memory.Step:
    """The flags as nanogrpo.model.memory's Step: bf16 on a GPU, the Triton log-prob kernel; P split over ranks."""
    return memory.Step(
        prompts=-(-a.prompts_per_step // ranks), group=a.group_size, prompt_len=a.prompt_len,
        new_tokens=a.max_new_tokens, micro_batch=a.micro_batch, checkpointing=a.checkpointing,
        lora_r=a.lora_r, reference=reference, logprob_chunk=a.logprob_chunk, lora_fold=not a.no_fold_lora,
    )  # fmt: skip


def plan(c: dict, a: argparse.Namespace) -> dict[str, float]:
    """GiB per part of a LoRA step on one GPU (nanogrpo.model.memory.plan), with the naive log-probs beside."""
    s = step_of(a)
    p = memory.plan(c, s)
    parts = {
        "weights (bf16)": p.parts["weights"],
        "LoRA + grads + AdamW (fp32)": p.parts["trained state"],
        "KV cache (sampling)": p.parts["KV cache"],
        "LoRA-folded weights (sampling)": p.parts["folded LoRA weights"],
        "activations (train micro-batch)": p.parts["activations"],
        "log-probs, fused": p.parts["log-probs"],
    }
    naive = memory.naive_logprob_bytes(c, s)
    out = {k: v / GB for k, v in parts.items()}
    out["total, fused"] = sum(parts.values()) / GB
    out["log-probs, naive (for reference)"] = naive / GB
    out["total, naive log-probs"] = (sum(parts.values()) - parts["log-probs, fused"] + naive) / GB
    out["params (B)"] = p.notes["params"] / 1e9
    out["LoRA params (M)"] = p.notes["lora params"] / 1e6
    # sampling and training do not overlap: the KV cache is freed before the loss pass
    out["peak, fused (sampling and training apart)"] = p.peak / GB
    return out


def plan_fsdp(c: dict, a: argparse.Namespace, ranks: int) -> dict[str, float]:
    """Per-rank GiB of a full fine-tune sharded over `ranks` GPUs (nanogrpo.model.memory.plan_fsdp)."""
    s = replace(step_of(a, ranks, reference=True), lora_r=0)
    p = memory.plan_fsdp(c, s, ranks)
    names = {
        "weights + grads + AdamW (fp32) / N": "weights + grads + AdamW (fp32) / N",
        "reference / N": "KL reference (bf16) / N",
        "2 unsharded blocks (w + g)": "2 unsharded blocks (bf16 w + g)",
        "root: embeddings + LM head (w + g)": "root: embeddings + LM head (bf16 w + g)",
        "activations": "activations (train micro-batch)",
        "log-probs": "log-probs, fused",
        "sampling: full model gathered": "sampling: full model gathered (bf16)",
        "sampling: KV cache": "sampling: KV cache / N",
    }
    out = {names[k]: v / GB for k, v in p.parts.items()}
    out["peak per rank (sampling and training apart)"] = p.peak / GB
    # one GPU runs the reference as a float32 copy under the policy's autocast (the same path: KL 0 at step 0)
    out["unsharded, one GPU: weights+grads+AdamW+ref"] = memory.plan(c, replace(s, prompts=1)).resident / GB
    return out


def _table(title: str, results: dict[str, dict[str, float]], peak_key: str, card_gb: float) -> None:
    names = list(results)
    print(title)
    print(f"{'':44}" + "".join(f"{n:>14}" for n in names))
    for k in results[names[0]]:
        print(f"{k:44}" + "".join(f"{results[n][k]:>14.2f}" for n in names))
    for n in names:
        fits = results[n][peak_key] <= card_gb
        print(f"{n}: {'fits' if fits else 'does NOT fit'} in {card_gb:g} GB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", nargs="*", default=["llama-3-8b", "qwen2.5-7b"], help="known name or HF folder"
    )
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8, help="completions per forward/backward (0 = all)")
    ap.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    ap.add_argument(
        "--no-fold-lora", action="store_true", help="sample through the adapters (no folded copy)"
    )
    ap.add_argument(
        "--logprob-chunk",
        type=int,
        default=0,
        help="rows of the log-prob backward's dz chunk (0 = the kernel's)",
    )
    ap.add_argument("--card-gb", type=float, default=80.0)
    ap.add_argument("--fsdp-ranks", type=int, default=8, help="full fine-tune with FSDP on N GPUs (0 = skip)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    results = {m: plan(load_config(m), a) for m in a.model}
    fsdp = {m: plan_fsdp(load_config(m), a, a.fsdp_ranks) for m in a.model} if a.fsdp_ranks > 0 else {}
    if a.json:
        print(json.dumps({"args": vars(a), "plan": results, "fsdp": fsdp}, indent=2))
        return
    _table(
        f"LoRA r={a.lora_r}, P={a.prompts_per_step} x G={a.group_size}, prompt {a.prompt_len} + "
        f"{a.max_new_tokens} new tokens, micro-batch {a.micro_batch or 'all'}, "
        f"checkpointing {'on' if a.checkpointing else 'off'}; GiB",
        results,
        "peak, fused (sampling and training apart)",
        a.card_gb,
    )
    if fsdp:
        print()
        _table(
            f"Full fine-tune, FSDP over {a.fsdp_ranks} GPUs, KL reference sharded, same batch; GiB per rank",
            fsdp,
            "peak per rank (sampling and training apart)",
            a.card_gb,
        )


if __name__ == "__main__":
    main()
