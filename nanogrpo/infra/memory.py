"""How much memory one training step takes, from the model's config.json alone, and the start-up check that
fits a run to its device before the model loads (`fit_to_memory`, called by train.py).

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
  prompt's keys once, shared by its G completions (kvcache.GroupedKVCache) [D on a GPU, 4 on the CPU,
  where the sampler keeps a float32 cache]. On the CPU the sampler also packs a copy of every projection
  and of the LM head, with LoRA folded in (packed.py), for as long as it generates [the weights' dtype].
- activations of one training micro-batch of M rows: each prompt runs once for the rows of its group in
  the micro-batch (kvcache.PrefixKV), so a micro-batch is Tm = ceil(M / G) x prompt + M x new tokens
  tokens. Per token and layer the backward keeps q, k, v, o, the MLP's three [I] tensors, the norms'
  outputs, ~ (4H + 3I + 2H), and the inputs of the seven projections [D]. With activation checkpointing
  each layer keeps only its input [H] and one layer at a time is recomputed; without, every layer keeps
  its set. The prompts' keys and values expanded to the M rows, per layer [D].
- log-probs (kernels/logprobs.py). The Triton kernel (CUDA): no vocabulary-sized tensor in the forward,
  and one dz chunk [C, V] in the backward, C = 2^28 / V rows [D]. The PyTorch reference (the CPU, or
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
memory the check reads), allocator fragmentation, cuBLAS, Triton and NCCL workspaces. `MARGIN_FRACTION` and
`MARGIN_BYTES` are there for these. A measured CUDA peak against this plan is still pending
(docs/BENCHMARKS.md, `bench/step.py --plan`).

The check (`fit_to_memory`, --memory-check): the plan of the configured run against the device's free
memory (CUDA: torch.cuda.mem_get_info; CPU: MemAvailable from /proc/meminfo, capped by a cgroup's limit)
less the margin. 'fit' chooses --micro-batch and --model.activation-checkpointing so that the run fits and
prints one line saying so; 'refuse' raises, naming the flags that fit; 'off' skips it. GRPO, PPO and CPT
are planned; SFT and DPO are not (their targets' lengths are only known when a step tokenizes its rows).
Devices other than CUDA and the CPU give no figure: the run starts unchecked, with a note.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

GiB = 1024**3

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# kernels/logprobs.py: the Triton backward's dz chunk (elements); the reference's float32 chunk and the
# largest log-softmax it keeps for the backward. Copied, not imported: importing kernels imports triton.
TRITON_CHUNK_ELEMS = 1 << 28
TORCH_CHUNK_ELEMS = 1 << 22
TORCH_KEEP_ELEMS = 1 << 25
TORCH_TILES = 3  # [C, V] float32 tiles the reference holds at once

# What the check leaves free: 10% of the free memory for the allocator's fragmentation and the plan's
# approximations (the parts it does not count grow with the batch), and 1 GiB for what does not grow with it
# (cuBLAS / Triton / NCCL workspaces on a GPU; on the CPU, what the graders and tokenizer allocate later).
MARGIN_FRACTION = 0.10
MARGIN_BYTES = 1 * GiB


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
    """The vocabulary-sized tensors of one micro-batch's log-probs (kernels/logprobs.py)."""
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
        "activations": activation_bytes(c, s),
        "log-probs": logprob_bytes(c, s),
        "autocast weight copies": n * s.dtype_bytes if full and s.dtype_bytes < 4 else 0,
        "LM head gradient": c["vocab_size"] * c["hidden_size"] * 4 if full else 0,
    }
    resident = parts["weights"] + parts["trained state"] + parts["reference"]
    sampling = resident + parts["KV cache"] + parts["packed sampling weights"]
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


# ------------------------------------------------------------------------------------------- free memory


def usable(available: int) -> int:
    """What the plan may take of `available` bytes: less MARGIN_FRACTION of it and MARGIN_BYTES."""
    return int(available * (1 - MARGIN_FRACTION)) - MARGIN_BYTES


MEMINFO = "/proc/meminfo"
# (limit, usage) files of the process's memory cgroup: v2, then v1
CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def host_available() -> int | None:
    """Bytes the host can still give this process: MemAvailable (MEMINFO), capped by the memory cgroup's
    limit less its usage where one is set; where MEMINFO cannot be read, the free pages (sysconf, which
    leaves out the page cache the kernel would give back: lower); None when neither can be read."""
    avail = None
    try:
        for line in Path(MEMINFO).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024  # kB
                break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            return None
    for limit_file, usage_file in CGROUP_FILES:
        try:
            limit, used = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and used.isdigit() and int(limit) < 1 << 60:  # 'max' or a huge number: no limit
            avail = min(avail, max(0, int(limit) - int(used)))
        break
    return avail


def available_memory(device) -> tuple[int, str] | None:
    """(bytes free for this run on `device`, a sentence saying so with {} for the amount), or None when
    unknown."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free), f"{device} has {{}} free"
    avail = host_available() if device.type == "cpu" else None  # other devices: no figure here
    return None if avail is None else (avail, "the host has {} available (MemAvailable)")


# ----------------------------------------------------------------------------------------------- fitting


def micro_batches(s: Step) -> list[int]:
    """Micro-batches worth trying, largest first: whole groups that split the batch evenly (k x G, k
    dividing P), then the divisors of G (part of one group; its prompt then runs once per micro-batch)."""
    whole = {k * s.group for k in range(1, s.prompts + 1) if s.prompts % k == 0}
    part = {d for d in range(1, s.group + 1) if s.group % d == 0}
    return sorted(whole | part, reverse=True)


def fit(c: dict, s: Step, budget: int, fsdp_ranks: int = 0, keep_micro: bool = False) -> Step | None:
    """The fastest setting of s that fits in `budget` bytes, or None: the largest whole-group micro-batch
    without activation checkpointing (unless s already has it), else the largest micro-batch with it.
    keep_micro: s.micro_batch stays, only checkpointing may be turned on."""
    sizes = [s.micro_batch] if keep_micro else micro_batches(s)
    tries = [] if s.checkpointing else [(m, False) for m in sizes if keep_micro or m >= min(s.group, s.rows)]
    tries += [(m, True) for m in sizes]
    for m, ck in tries:
        t = replace(s, micro_batch=m, checkpointing=ck)
        if plan_of(c, t, fsdp_ranks).peak <= budget:
            return t
    return None


def flags(s: Step) -> str:
    """The flags of s's micro-batch and checkpointing, as a user types them."""
    return f"--micro-batch {s.micro_batch}" + (" --model.activation-checkpointing" if s.checkpointing else "")


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def _numbers(p: Plan) -> str:
    return f"{_gib(p.peak)} (sampling {_gib(p.sampling)}, training {_gib(p.training)})"


def run_step(
    cfg, device, dtype, prompt_len: int, new_tokens: int | None = None, world: int = 1
) -> Step | None:
    """The Step of a TrainConfig on `device` in `dtype`, with prompts of `prompt_len` tokens (CPT: the
    windows' context, and new_tokens their trained tokens); None for the stages the plan does not model
    (SFT, DPO). `world`: ranks the prompts are split over."""
    if cfg.algo not in ("grpo", "ppo", "cpt"):
        return None
    import torch

    import kernels
    from nanogrpo.model.packed import packing_supported
    from nanogrpo.policy import needs_reference

    cuda = device.type == "cuda"
    backend = cfg.model.kernels if cfg.model.kernels != "auto" else kernels.get_backend()
    triton = kernels.HAS_TRITON and backend != "torch" and (cuda or backend == "triton")
    group = {"grpo": cfg.grpo.group_size, "ppo": cfg.ppo.samples_per_prompt, "cpt": 1}[cfg.algo]
    weights = dtype if cfg.lora.r > 0 else torch.float32
    return Step(
        prompts=max(1, cfg.prompts_per_step // world),
        group=group,
        prompt_len=prompt_len,
        new_tokens=new_tokens if new_tokens is not None else cfg.sampling.max_new_tokens,
        micro_batch=cfg.micro_batch,
        checkpointing=cfg.model.activation_checkpointing,
        lora_r=cfg.lora.r,
        lora_targets=tuple(cfg.lora.targets),
        reference=needs_reference(cfg),
        samples=cfg.algo != "cpt",
        dtype_bytes=dtype.itemsize,
        device=device.type,
        logprobs="triton" if triton else "torch",
        cpu_packing=not cuda and packing_supported(torch.empty(0, dtype=weights)),
    )


def lengths(cfg, rows: list[dict]) -> tuple[int, int | None]:
    """(longest prompt, longest completion or None for --sampling.max-new-tokens) of the training rows."""
    if cfg.algo == "cpt":
        return max((len(r["_ctx"]) for r in rows), default=0), max((len(r["_ids"]) for r in rows), default=1)
    return max((len(r.get("_prompt_ids", ())) for r in rows), default=0), None


def fit_to_memory(cfg, device, dtype, rows: list[dict]):
    """--memory-check: cfg as it should run on `device` (the module docstring). Called once the training
    rows are tokenized (their longest prompt sizes the plan) and before the model loads and config.json is
    written, so the chosen flags are what the run folder records and a --resume finds.

    'fit': a run that does not fit gets the largest micro-batch of whole groups that fits without activation
    checkpointing, else the largest that fits with it, and one printed line says so. A --micro-batch other
    than 0 (a flag, a preset or --config) is kept as given: only activation checkpointing may be turned on
    for it (it changes no number, only time); when that is not enough the run is refused, naming the flags
    that fit. 'refuse' refuses instead of choosing. A run that fits is left alone, silently. --resume changes
    nothing (that would not resume exactly): a note says when the plan exceeds the free memory. Under
    torchrun every rank plans with the smallest free memory among them, so all choose alike; CPU ranks
    share the host's memory. SFT and DPO are not planned: they pass unchecked."""
    from nanogrpo.infra import dist
    from nanogrpo.policy import parallel_mode

    if cfg.memory_check == "off":
        return cfg
    world = dist.world()
    prompt_len, new_tokens = lengths(cfg, rows)
    s = run_step(cfg, device, dtype, prompt_len, new_tokens, world)
    if s is None:
        return cfg
    found = available_memory(device)
    avail, where = found if found is not None else (-1, "")
    if world > 1:  # every rank plans with the smallest free memory (-1: unknown somewhere), so all agree
        avail = -int(dist.max_floats({"m": -float(avail)})["m"])
    if avail < 0:
        if dist.is_main():
            print(f"note: --memory-check skipped: no figure of the free memory on {device}")
        return cfg
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if device.type == "cpu" else 1
    budget = usable(avail) // max(1, procs)  # CPU ranks of one host share its memory
    ranks = world if parallel_mode(cfg) == "fsdp" else 0
    c = model_config(cfg.model.path)
    now = plan_of(c, s, ranks)
    if now.peak <= budget:
        return cfg
    per = f" per rank ({procs} on this host)" if procs > 1 else ""
    have = f"{where.format(_gib(avail))} ({_gib(budget)}{per} after the 10% + 1 GiB margin)"
    given = f"--micro-batch {cfg.micro_batch}" + (" (all at once)" if cfg.micro_batch == 0 else "")
    given += " with" if s.checkpointing else " without"
    need = f"the memory plan (nanogrpo/infra/memory.py) needs {_numbers(now)} at {given} activation checkpointing"
    if cfg.resume:
        if dist.is_main():
            print(
                f"note: {need}, but {have}; --resume keeps the run's settings (others would not resume "
                "exactly), so it may run out of memory: free some, or start a new run from its config"
            )
        return cfg
    explicit = cfg.micro_batch > 0
    fitted = fit(c, s, budget, ranks, keep_micro=explicit) if cfg.memory_check == "fit" else None
    if fitted is not None:
        if dist.is_main():
            print(
                f"memory: {need}, but {have}: running with {flags(fitted)} "
                f"({_gib(plan_of(c, fitted, ranks).peak)}; --memory-check off keeps the flags as given)"
            )
        return replace(
            cfg,
            micro_batch=fitted.micro_batch,
            model=replace(cfg.model, activation_checkpointing=fitted.checkpointing),
        )
    best = fit(c, s, budget, ranks)  # the flags that fit, whatever the given micro-batch
    why = f"{need}, but {have}"
    if best is not None:
        kept = " --micro-batch is kept as given;" if explicit and cfg.memory_check == "fit" else ""
        raise ValueError(
            f"{why}:{kept} {flags(best)} fits ({_gib(plan_of(c, best, ranks).peak)}); pass it, or "
            "--memory-check off to run as configured"
        )
    least = replace(s, micro_batch=min(micro_batches(s)), checkpointing=True)
    p = plan_of(c, least, ranks)
    top = sorted(((v, k) for k, v in p.parts.items() if v), reverse=True)[:3]
    lora = ", train LoRA adapters (--lora.r 16) rather than every weight" if s.lora_r == 0 else ""
    raise ValueError(
        f"{why}: nothing fits, even {flags(least)} needs {_numbers(p)}, mostly "
        f"{', '.join(f'{k} {_gib(v)}' for v, k in top)}; lower --prompts-per-step or "
        f"--sampling.max-new-tokens{lora}, use a smaller model or free some memory, or pass --memory-check "
        "off to run anyway"
    )
