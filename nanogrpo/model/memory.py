"""How much memory one training step takes, from the model's config.json alone (the start-up check that
fits a run to its device, before the model loads, is nanogrpo/model/memory_fit.py).

The plan (`plan`) counts, per device, the parts below; D is the compute dtype's size (2 for bf16/fp16, 4 for
float32: a CPU without bf16 units runs float32), bytes per element in brackets:
- weights: every parameter once. LoRA: the frozen base in the compute dtype [D]; a full fine-tune (--lora.r
  0): float32 master weights [4].
- trained state: LoRA adapters, their gradients and AdamW's two moments [4 + 4 + 8]; a full fine-tune: the
  gradients and moments of every weight [4 + 8]. Muon is counted as AdamW (it keeps less).
- reference: a full fine-tune whose loss needs the reference (GRPO's KL, PPO's KL penalty; policy.
  needs_reference) keeps a frozen float32 copy [4]; with LoRA the reference is the model with its adapters
  off, which costs nothing.
- KV cache while sampling: 2 x layers x kv_heads x head_dim x (P x prompt + P x G x new tokens): each
  prompt's keys once, shared by its G completions (grouped.GroupedKVCache) [D on a GPU, 4 on the CPU,
  where the sampler keeps a float32 cache]. Episodes (--env) keep a cache row of their own for their whole
  length instead (row_sampler.RowKVCache, continued from turn to turn): P x G x (prompt + the episode's budget +
  one turn), at most twice what the rows hold as it grows, counted at that bound. On the CPU the sampler also packs a copy of every projection
  and of the LM head, with LoRA folded in (packed.py), for as long as it generates [the weights' dtype].
  Elsewhere (a GPU) a LoRA run's sampler folds the adapters into a copy of every adapted projection
  (packed.folded_lora; --sampling.no-fold-lora turns it off) for as long as it generates [D].
- activations of one training micro-batch of M rows: each prompt runs once for the rows of its group in
  the micro-batch (kvcache.PrefixKV), so a micro-batch is Tm = ceil(M / G) x prompt + M x new tokens
  tokens. Per token and layer the backward keeps q, k, v, o, the MLP's three [I] tensors, the norms'
  outputs, ~ (4H + 3I + 2H), and the inputs of the seven projections [D]. With activation checkpointing
  each layer keeps only its input [H] and one layer at a time is recomputed; without, every layer keeps
  its set. The prompts' keys and values expanded to the M rows, per layer [D].
- log-probs (nanogrpo_kernels/logprobs.py). The Triton kernel (CUDA): no vocabulary-sized tensor in the
  forward, and one dz chunk [C, V] in the backward, C = 2^28 / V rows [D]. The PyTorch reference (the CPU, or
  --model.kernels torch): chunks of 2^22 / V rows, about three [C, V] float32 tiles alive at once (the
  logits, their exponential, a product), and, when the whole log-softmax of the micro-batch has at most
  2^25 entries, that log-softmax kept for the backward [4]. A full fine-tune also accumulates the LM
  head's gradient in float32 [V, H] [4].
- a full fine-tune in bf16 runs its forward under autocast, which keeps a cast copy of each weight it
  used until the backward [D]; off the CPU its sampler runs under the same autocast, with the same copy
  for the whole call (on the CPU it samples the packed float32 weights instead).
Sampling and training never overlap (the KV cache is freed before the loss pass), so the peak is the larger
of the two phases on top of what stays all run long (weights, trained state, reference).

`plan_fsdp` is a full fine-tune sharded over N ranks with FSDP2 (nanogrpo/infra/fsdp.py), per rank: the float32
weights, gradients and AdamW moments [4 + 4 + 8] and the bf16 reference [D] divided by N; while training,
two decoder blocks unsharded (the running one and the prefetched one, weights and gradients [D + D]) and
the root group (embeddings, LM head, final norm, unsharded from forward to backward [D + D]); while
sampling, the whole model gathered [D] and this rank's KV cache.

Where it approximates. The activation count is generous: k and v are counted at H each (GQA makes them
smaller) and some tensors autograd shares are counted twice (on SmolLM2's shapes, counted tensor by tensor,
what a layer keeps is ~75% of it); and every completion is counted at --sampling.max-new-tokens, where the
training forward pads each group of similar lengths to its own longest. Not counted: biases and QK norms among the parameters; attention score matrices (the
fused SDPA kernels keep none; a fallback to the math kernel does); the no-grad passes (the reference's and
the old policy's log-probs run without a graph, a layer at a time); the sampler's [N, V] logits and the
prefill's activations; on the CPU the float32 copies of bf16 queries and keys the attention makes; the
transient full copy while a model loads before FSDP shards it; the CUDA context (already outside the free
memory the check reads), allocator fragmentation, cuBLAS, Triton and NCCL workspaces. The margin of
memory_fit.py is there for these. A measured CUDA peak against this plan is still pending
(docs/BENCHMARKS.md, `bench/step.py --plan`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from nanogrpo.config import TrainConfig

GiB = 1024**3

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# the Triton backward's dz chunk (elements, nanogrpo_kernels/logprobs_tiles.py); the reference's float32 chunk
# and the largest log-softmax it keeps for the backward (nanogrpo_kernels/logprobs.py). Copied, not imported:
# importing nanogrpo_kernels imports triton.
TRITON_CHUNK_ELEMS = 1 << 28
TORCH_CHUNK_ELEMS = 1 << 22
TORCH_KEEP_ELEMS = 1 << 25
TORCH_TILES = 3  # [C, V] float32 tiles the reference holds at once

# ---------------------------------------------------------------------------------------------------- shapes


def with_defaults(c: dict) -> dict:
    """A config.json's shape fields with HF's defaults filled in (head_dim, num_key_value_heads)."""
    c = dict(c)
    c.setdefault("num_key_value_heads", c["num_attention_heads"])
    if not c.get("head_dim"):
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    return c


def model_config(name_or_path: str) -> dict:
    """The config.json of --model.path, read without loading any weight: 'random:SHAPE' from its shape table
    (nothing is built); 'tiny', 'smollm2' and folders through model_zoo.resolve_model, as training resolves
    them (the first use builds 'tiny' or converts 'smollm2' into the cache, as training would next)."""
    from nanogrpo.model.zoo import random_config, resolve_model

    if name_or_path.startswith("random:"):
        return with_defaults(random_config(name_or_path.removeprefix("random:")))
    folder = resolve_model(name_or_path)
    return with_defaults(json.loads((Path(folder) / "config.json").read_text()))


def linear_shapes(c: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of one layer."""
    H, I, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return {
        "q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
        "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H),
    }  # fmt: skip


def layer_params(c: dict) -> int:
    """Parameters of one decoder layer: its projections and its two norms."""
    return sum(i * o for i, o in linear_shapes(c).values()) + 2 * c["hidden_size"]


def root_params(c: dict) -> int:
    """Parameters outside the layers: embeddings, the LM head unless tied, the final norm."""
    H, V = c["hidden_size"], c["vocab_size"]
    return V * H * (1 if c.get("tie_word_embeddings") else 2) + H


def param_count(c: dict) -> int:
    return c["num_hidden_layers"] * layer_params(c) + root_params(c)


def lora_param_count(c: dict, r: int, targets: tuple[str, ...] = TARGETS) -> int:
    """Parameters of rank-r adapters on the `targets` projections of every layer."""
    shapes = linear_shapes(c)
    return c["num_hidden_layers"] * sum(r * (i + o) for name, (i, o) in shapes.items() if name in targets)


# ----------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Step:
    """The sizes of one step on one device, as the plan sees them."""

    prompts: int
    """P: prompts on this device per step (CPT: windows)."""
    group: int
    """G: completions per prompt (PPO: samples per prompt; CPT: 1)."""
    prompt_len: int
    """Tokens of the longest prompt (CPT: the context a window carries)."""
    new_tokens: int
    """Most tokens of a completion (CPT: the trained tokens of a window)."""
    micro_batch: int = 0
    """Rows per forward/backward; 0 = all P x G at once."""
    checkpointing: bool = False
    """Activation checkpointing."""
    lora_r: int = 16
    """Adapter rank; 0 = full fine-tune."""
    lora_targets: tuple[str, ...] = TARGETS
    """Projections that get an adapter."""
    reference: bool = False
    """A full fine-tune keeps a frozen copy for the reference."""
    samples: bool = True
    """The step samples (GRPO, PPO); CPT does not."""
    dtype_bytes: int = 2
    """Bytes of the compute dtype."""
    device: str = "cuda"
    """'cuda' or 'cpu' (a float32 KV cache, the sampler's packed weights)."""
    logprobs: str = "triton"
    """The log-prob path: 'triton' (the CUDA kernel) or 'torch' (the chunked PyTorch reference)."""
    logprob_chunk: int = 0
    """Rows of the Triton backward's dz chunk; 0 = the kernel's."""
    cpu_packing: bool = False
    """The CPU sampler packs a copy of the weights (packed.py)."""
    lora_fold: bool = False
    """Where nothing is packed, the sampler folds LoRA into a copy of the adapted weights (--sampling.fold-lora)."""
    turn_tokens: int = 0
    """Episodes (--env): the most tokens of one turn; each row then keeps its own cache of prompt +
    new_tokens (the episode's budget) + a turn (row_sampler.RowKVCache). 0: single completions, the grouped cache."""

    @property
    def rows(self) -> int:
        """Rows of the training batch: P x G."""
        return self.prompts * self.group

    @property
    def micro_rows(self) -> int:
        """Rows of one micro-batch (at most the batch's)."""
        return min(self.micro_batch, self.rows) if self.micro_batch > 0 else self.rows


@dataclass(frozen=True)
class Plan:
    """Bytes per part of a step, and of the two phases that never overlap."""

    parts: dict[str, int]
    """Each part's bytes, by name."""
    resident: int
    """What stays all run long: weights, trained state, reference."""
    sampling: int
    """resident + the sampler's KV cache (and on the CPU its packed weights)."""
    training: int
    """resident + one micro-batch's activations, log-prob tiles and the like."""
    notes: dict[str, float] = field(default_factory=dict)
    """Counts that are not bytes (parameters)."""

    @property
    def peak(self) -> int:
        return max(self.sampling, self.training)


def kv_bytes_per_token(c: dict, elem: int) -> int:
    """Keys and values of one token in every layer."""
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * elem


def kv_cache_bytes(c: dict, s: Step) -> int:
    """The sampler's cache: each prompt once, plus every completion's own tokens."""
    if not s.samples:
        return 0
    elem = 4 if s.device == "cpu" else s.dtype_bytes
    if s.turn_tokens:  # episodes: a row of its own each, its room doubled as it grows
        return kv_bytes_per_token(c, elem) * s.rows * 2 * (s.prompt_len + s.new_tokens + s.turn_tokens)
    return kv_bytes_per_token(c, elem) * (s.prompts * s.prompt_len + s.rows * s.new_tokens)


def micro_tokens(s: Step) -> int:
    """Tokens one micro-batch runs: each prompt once for its group, every completion token."""
    M = s.micro_rows
    return -(-M // s.group) * s.prompt_len + M * s.new_tokens


def activation_bytes(c: dict, s: Step) -> int:
    """What the backward of one micro-batch keeps (the module docstring's count)."""
    H, I, L, D = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], s.dtype_bytes
    per_token_layer = (4 * H + 3 * I + 2 * H) * D + sum(i for i, _ in linear_shapes(c).values()) * D
    Tm = micro_tokens(s)
    if s.checkpointing:
        acts = Tm * H * D * L + Tm * per_token_layer  # every layer's input, one layer recomputed
    else:
        acts = Tm * per_token_layer * L
    return acts + kv_bytes_per_token(c, D) * s.micro_rows * s.prompt_len  # prompt K/V expanded to the rows


def logprob_bytes(c: dict, s: Step) -> int:
    """The vocabulary-sized tensors of one micro-batch's log-probs (nanogrpo_kernels/logprobs.py)."""
    V, tok = c["vocab_size"], s.micro_rows * s.new_tokens
    if s.logprobs == "triton":
        rows = s.logprob_chunk or max(128, (TRITON_CHUNK_ELEMS // V) // 128 * 128)
        return min(tok, rows) * V * s.dtype_bytes  # dz, the only vocabulary-sized tensor
    rows = max(1, min(tok, TORCH_CHUNK_ELEMS // V))
    kept = tok * V * 4 if tok * V <= TORCH_KEEP_ELEMS else 0  # the log-softmax kept for the backward
    return TORCH_TILES * rows * V * 4 + kept


def naive_logprob_bytes(c: dict, s: Step) -> int:
    """For comparison: float32 logits and their log_softmax for every completion token of a micro-batch."""
    return s.micro_rows * s.new_tokens * c["vocab_size"] * 4 * 2


def packed_bytes(c: dict, s: Step) -> int:
    """The CPU sampler's packed copy: every projection and the LM head, in the weights' dtype."""
    if not (s.samples and s.cpu_packing):
        return 0
    elem = s.dtype_bytes if s.lora_r > 0 else 4
    proj = c["num_hidden_layers"] * sum(i * o for i, o in linear_shapes(c).values())
    return (proj + c["vocab_size"] * c["hidden_size"]) * elem


def folded_bytes(c: dict, s: Step) -> int:
    """The sampler's LoRA-folded copy of every adapted projection, in the weights' dtype, while it generates."""
    if not (s.samples and s.lora_fold and s.lora_r > 0):
        return 0
    shapes = linear_shapes(c)
    return (
        c["num_hidden_layers"]
        * sum(i * o for k, (i, o) in shapes.items() if k in s.lora_targets)
        * s.dtype_bytes
    )


def plan(c: dict, s: Step) -> Plan:
    """The plan of one step on one device (no FSDP); see the module docstring."""
    n = param_count(c)
    full = s.lora_r == 0
    lora = 0 if full else lora_param_count(c, s.lora_r, s.lora_targets)
    parts = {
        "weights": n * (4 if full else s.dtype_bytes),
        "trained state": n * 12 if full else lora * 16,
        "reference": n * 4 if full and s.reference else 0,
        "KV cache": kv_cache_bytes(c, s),
        "packed sampling weights": packed_bytes(c, s),
        "folded LoRA weights": folded_bytes(c, s),
        "activations": activation_bytes(c, s),
        "log-probs": logprob_bytes(c, s),
        "autocast weight copies": n * s.dtype_bytes if full and s.dtype_bytes < 4 else 0,
        "LM head gradient": c["vocab_size"] * c["hidden_size"] * 4 if full else 0,
    }
    resident = parts["weights"] + parts["trained state"] + parts["reference"]
    sampling = resident + parts["KV cache"] + parts["packed sampling weights"] + parts["folded LoRA weights"]
    if s.device != "cpu":  # a full fine-tune samples under its autocast off the CPU (sampling.generate)
        sampling += parts["autocast weight copies"]
    train = ("activations", "log-probs", "autocast weight copies", "LM head gradient")
    training = resident + sum(parts[k] for k in train)
    return Plan(parts, resident, sampling, training, {"params": n, "lora params": lora})


def plan_fsdp(c: dict, s: Step, ranks: int) -> Plan:
    """Per rank, a full fine-tune sharded over `ranks` with FSDP2; s.prompts is this rank's share."""
    n, D = param_count(c), s.dtype_bytes
    base = plan(c, s)  # activations, log-prob chunk and KV cache have the same shapes
    parts = {
        "weights + grads + AdamW (fp32) / N": n * 16 // ranks,
        "reference / N": n * D // ranks if s.reference else 0,
        "2 unsharded blocks (w + g)": 2 * layer_params(c) * 2 * D,
        "root: embeddings + LM head (w + g)": root_params(c) * 2 * D,
        "activations": base.parts["activations"],
        "log-probs": base.parts["log-probs"],
        "sampling: full model gathered": n * D if s.samples else 0,
        "sampling: KV cache": base.parts["KV cache"],
    }
    resident = parts["weights + grads + AdamW (fp32) / N"] + parts["reference / N"]
    keys = list(parts)
    training = resident + sum(parts[k] for k in keys[2:6])
    sampling = resident + sum(parts[k] for k in keys[6:8])
    return Plan(parts, resident, sampling, training, {"params": n, "lora params": 0})


def plan_of(c: dict, s: Step, fsdp_ranks: int = 0) -> Plan:
    """plan_fsdp over fsdp_ranks ranks when it is > 1, else plan."""
    return plan_fsdp(c, s, fsdp_ranks) if fsdp_ranks > 1 else plan(c, s)


def needs_reference(cfg: TrainConfig) -> bool:
    """Whether a full fine-tune keeps a frozen copy of the model: for GRPO's KL, DPO's reference margins and
    PPO's KL penalty (with LoRA the reference is the model with its adapters off, and costs nothing)."""
    return (
        (cfg.algo == "grpo" and cfg.grpo.kl_placement != "none")
        or cfg.algo == "dpo"
        or (cfg.algo == "ppo" and cfg.ppo.kl_coef > 0)
    )
