"""Memory plan for one GRPO step: how many GB each part takes on one GPU, computed from the model config.

    python bench/memory_plan.py                                  # Llama-3-8B and Qwen2.5-7B, the default plan
    python bench/memory_plan.py --model /models/Qwen2.5-7B-Instruct --group-size 16 --max-new-tokens 1024
    python bench/memory_plan.py --json
    python bench/memory_plan.py --model random:qwen2.5-1.5b --prompts-per-step 8 --max-new-tokens 256

--model takes a known name (below), 'random:SHAPE' (the shapes of nanogrpo.model_zoo.RANDOM_SHAPES:
qwen2.5-0.5b, qwen2.5-1.5b, llama-3-8b) or an HF folder with a config.json. `bench/step.py --plan` runs
this on the config.json of the model it trains and prints the prediction next to the measured CUDA peak.

The parts (bf16 frozen weights, float32 LoRA adapters with AdamW; bytes per element in brackets):
- weights: every parameter of the base model [2];
- LoRA: adapter weights [4] + grads [4] + AdamW moments [8];
- KV cache while sampling: 2 x layers x kv_heads x head_dim x (P x prompt + P*G x max_new_tokens) [2]
  (each prompt's keys once, shared by its G completions: nanogrpo.kvcache.GroupedKVCache);
- activations of one training micro-batch of M completions (whole groups): each prompt runs once for its
  group (nanogrpo.kvcache.PrefixKV), so a micro-batch is Tm = M/G x prompt + M x max_new_tokens tokens.
  With activation checkpointing each layer keeps its input [Tm, H] [2] and one layer at a time is
  recomputed (q, k, v, o, the MLP's three [Tm, I] tensors, norms: ~ (4H + 3I + 2H) per token [2]), LoRA
  inputs included; without checkpointing every layer keeps its recompute set. The completions' attention
  also keeps the prompt keys/values expanded to the M rows, per layer [2];
- log-probs: the Triton kernel keeps no vocabulary-sized tensor in the forward; its backward writes dz in
  chunks of C = 2^28 / V rows (`TRITON_CHUNK_ELEMS` in kernels/logprobs.py) x V [2], instead of the naive
  [M x max_new_tokens, V] float32 logits plus their log_softmax (two such tensors).
The reference pass runs without grad and needs no more than the policy's forward.
It prints a table, and the sum is compared with the card's memory. Measured peaks: docs/SCALING.md.

A second table (--fsdp-ranks N, 0 = skip) is a full fine-tune sharded with FSDP2 over N GPUs, per rank:
float32 weights [4] + grads [4] + AdamW moments [8], and the bf16 KL reference [2], all divided by N;
while training, two decoder blocks unsharded in bf16 (the running one and the prefetched one, weights and
gradients [2 + 2]) and the root group (embeddings, LM head, final norm: unsharded from forward to
backward, weights and gradients [2 + 2]); while sampling, the whole model gathered in bf16 [2] and this
rank's share (1/N) of the KV cache.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanogrpo.model_zoo import RANDOM_SHAPES, random_config  # noqa: E402

TRITON_CHUNK_ELEMS = 1 << 28  # kernels/logprobs.py (not imported: that module needs triton)

GB = 1024**3

# the two configs of the plan (shapes only): Llama-3-8B as nanogrpo.model_zoo's random model has it, Qwen2.5-7B
# copied from its config.json
KNOWN = {
    "llama-3-8b": {**RANDOM_SHAPES["llama-3-8b"], "head_dim": 128},
    "qwen2.5-7b": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
    ),
}  # fmt: skip
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_config(name_or_path: str) -> dict:
    if name_or_path in KNOWN:
        return dict(KNOWN[name_or_path])
    if name_or_path.startswith("random:"):
        cfg = random_config(name_or_path.removeprefix("random:"))
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        return cfg
    cfg = json.loads((Path(name_or_path) / "config.json").read_text())
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    return cfg


def linear_shapes(c: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of one layer."""
    H, I, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return {
        "q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
        "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H),
    }  # fmt: skip


def plan(c: dict, a: argparse.Namespace) -> dict[str, float]:
    H, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    shapes = linear_shapes(c)
    layer_params = sum(i * o for i, o in shapes.values()) + 2 * H
    n_params = L * layer_params + V * H * (1 if c.get("tie_word_embeddings") else 2) + H
    lora_params = L * sum(a.lora_r * (i + o) for name, (i, o) in shapes.items() if name in TARGETS)
    N = a.prompts_per_step * a.group_size  # completions per step
    M = a.micro_batch or N
    kv_per_token = 2 * L * c["num_key_value_heads"] * c["head_dim"] * 2  # k and v of every layer, bf16
    kv = kv_per_token * (a.prompts_per_step * a.prompt_len + N * a.max_new_tokens)
    per_token_layer = (4 * H + 3 * I + 2 * H) * 2 + sum(
        i for n, (i, o) in shapes.items()
    ) * 2  # recompute set
    Tm = -(-M // a.group_size) * a.prompt_len + M * a.max_new_tokens  # tokens of one micro-batch
    keep = Tm * H * 2 * L  # checkpointed layer inputs
    acts = keep + Tm * per_token_layer if a.checkpointing else Tm * per_token_layer * L
    acts += kv_per_token * M * a.prompt_len  # the prompt's keys/values expanded to the completions
    tok = M * a.max_new_tokens  # completion tokens through the LM head
    rows = a.logprob_chunk or max(128, (TRITON_CHUNK_ELEMS // V) // 128 * 128)  # the kernel's dz chunk
    fused = min(tok, rows) * V * 2  # dz in bf16, the only vocabulary-sized tensor
    naive = tok * V * 4 * 2  # logits + log_softmax, float32
    parts = {
        "weights (bf16)": n_params * 2,
        "LoRA + grads + AdamW (fp32)": lora_params * 16,
        "KV cache (sampling)": kv,
        "activations (train micro-batch)": acts,
        "log-probs, fused": fused,
    }
    out = {k: v / GB for k, v in parts.items()}
    out["total, fused"] = sum(parts.values()) / GB
    out["log-probs, naive (for reference)"] = naive / GB
    out["total, naive log-probs"] = (sum(parts.values()) - fused + naive) / GB
    out["params (B)"] = n_params / 1e9
    out["LoRA params (M)"] = lora_params / 1e6
    # sampling and training do not overlap: the KV cache is freed before the loss pass
    out["peak, fused (sampling and training apart)"] = (
        parts["weights (bf16)"] + parts["LoRA + grads + AdamW (fp32)"] + max(kv, acts + fused)
    ) / GB
    return out


def plan_fsdp(c: dict, a: argparse.Namespace, ranks: int) -> dict[str, float]:
    """Per-rank GiB of a full fine-tune sharded over `ranks` GPUs (see the module docstring)."""
    H, V = c["hidden_size"], c["vocab_size"]
    base = plan(c, a)  # activations, log-prob tile and KV cache are the same shapes as with LoRA
    n_params = base["params (B)"] * 1e9
    layer_params = sum(i * o for i, o in linear_shapes(c).values()) + 2 * H
    root_params = V * H * (1 if c.get("tie_word_embeddings") else 2) + H
    parts = {
        "weights + grads + AdamW (fp32) / N": n_params * 16 / ranks,
        "KL reference (bf16) / N": n_params * 2 / ranks,
        "2 unsharded blocks (bf16 w + g)": 2 * layer_params * 4,
        "root: embeddings + LM head (bf16 w + g)": root_params * 4,
        "activations (train micro-batch)": base["activations (train micro-batch)"] * GB,
        "log-probs, fused": base["log-probs, fused"] * GB,
        "sampling: full model gathered (bf16)": n_params * 2,
        "sampling: KV cache / N": base["KV cache (sampling)"] * GB / ranks,
    }
    out = {k: v / GB for k, v in parts.items()}
    sharded = parts["weights + grads + AdamW (fp32) / N"] + parts["KL reference (bf16) / N"]
    train = sum(parts[k] for k in list(parts)[2:6])
    sample = parts["sampling: full model gathered (bf16)"] + parts["sampling: KV cache / N"]
    out["peak per rank (sampling and training apart)"] = (sharded + max(train, sample)) / GB
    # one GPU runs the reference as a float32 copy under the policy's autocast (the same path: KL 0 at step 0)
    out["unsharded, one GPU: weights+grads+AdamW+ref"] = n_params * 20 / GB
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
