"""FSDP2 for full fine-tuning under torchrun: shard the policy (and the KL reference) across ranks.

With `torchrun --nproc-per-node N` and `--lora.r 0`, every parameter, gradient and AdamW moment lives on
one rank only (1/N of each tensor). `torch.distributed.fsdp.fully_shard` (the per-parameter DTensor API)
is applied to each decoder block, then to the LogprobHead that owns the embeddings, the final norm and the
LM head (tied or not, they sit in one root group). In the forward and backward each block is all-gathered
just before it runs and freed after; gradients are reduce-scattered (averaged over ranks, in float32).

On a GPU the parameters stay float32 (the master copy the optimizer updates) and are all-gathered in
bfloat16 for compute (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`); on the CPU (gloo,
the tests) everything is float32.

Outside a forward the parameters are sharded DTensors, but the sampler calls the Transformer's blocks and
reads `lm_head_weight` directly. `gathered(root)` all-gathers every block and the root once for the whole
sampling call (decoding then runs at single-GPU speed, with no communication per token) and frees them
after: during sampling a rank holds the full model in the compute dtype, plus its KV cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0, on the CPU


def shard(head: nn.Module, compute_dtype: torch.dtype | None = None, frozen: bool = False) -> nn.Module:
    """fully_shard each decoder block of `head.model` (a Transformer or an HFModel), then `head` itself (the root).

    compute_dtype: all-gather float32 parameters in this dtype for the forward (None = as stored).
    frozen: a reference model (no backward): the root also frees its parameters after each forward.
    """
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # every rank must run its blocks as many times (each run all-gathers them): one group of completion
    # rows per forward, not as many as this rank's lengths call for (shared_prompt.length_buckets)
    head.bucket_lengths = False
    for block in decoder_layers(head.model):
        fully_shard(block, mp_policy=mp)
    fully_shard(head, mp_policy=mp)
    # FSDP makes the first module that runs a forward its root; the sampler runs the blocks before the
    # head ever does, so settle the root now (the same lazy init the head's first forward would do)
    head._get_fsdp_state()._lazy_init()
    if frozen:  # the root keeps its weights after forward for the backward; a frozen model has none
        head.set_reshard_after_forward(True)
    return head


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks FSDP shards one by one: nanogrpo's model's, or transformers' (its backbone's)."""
    core = getattr(model, "backbone", None) or model.model  # HFModel (model/hf_model.py), or a Transformer
    if not isinstance(getattr(core, "layers", None), nn.ModuleList):
        raise ValueError(
            f"--model.parallel fsdp shards each decoder block, and {type(core).__name__} keeps its blocks under "
            "another name than `layers`: use --model.parallel ddp"
        )
    return core.layers


@contextlib.contextmanager
def gathered(root: nn.Module) -> Iterator[None]:
    """Inside: every parameter of `root` is a full (unsharded) tensor on every rank. All ranks must enter.

    Enter it outside torch.inference_mode: the first all-gather allocates FSDP's unsharded buffers, and
    buffers made in inference mode could not be written by a later training forward.
    """
    mods = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)  # a block's forward must not free it mid-decode
    for m in mods:
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
        for m in mods:  # back to the training layout: blocks free after forward, the root keeps its own
            m.set_reshard_after_forward(m is not root, recurse=False)


def full_state_dict(head: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of the sharded model under HF names, gathered to rank 0 (on the CPU); {} on the
    other ranks. Collective: every rank must call it. A tied LM head is stored once, as the embedding."""
    sd = get_model_state_dict(head, options=FULL)
    out = {k.removeprefix("model."): v for k, v in sd.items()}  # LogprobHead.model -> Transformer names
    if head.model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_full_state_dict(head: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load HF-named full tensors (as full_state_dict wrote them) into the sharded model; every rank
    passes the whole dict and keeps its own shard."""
    sd = {"model." + k: v for k, v in tensors.items()}
    if head.model.config.tie_word_embeddings:
        sd["model.lm_head.weight"] = sd["model.model.embed_tokens.weight"]
    set_model_state_dict(head, sd, options=StateDictOptions(full_state_dict=True))


def optimizer_state(head: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The optimizer's state with full (unsharded) tensors keyed by parameter name, on rank 0. Collective."""
    return get_optimizer_state_dict(head, opt, options=FULL)


def load_optimizer_state(head: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """Inverse of optimizer_state: every rank passes the full state and keeps its shard."""
    set_optimizer_state_dict(head, opt, state, options=StateDictOptions(full_state_dict=True))
