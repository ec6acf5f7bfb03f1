"""The policy: the trained model with its tokenizer, reference and wrapping, how it is loaded, and its
checkpoint files. What trains it is train.grpo_update (GRPO) and optim.update (the other stages).

Under torchrun the policy is wrapped in DDP (LoRA, small full fine-tunes) or sharded with FSDP2 (full
fine-tunes, nanogrpo/infra/fsdp.py); `--model.parallel` picks. With FSDP the KL reference is sharded the same way.

`--lora.init-from ADAPTER` (GRPO after SFT) merges that adapter into the base weights and trains a fresh
adapter on top, so the KL reference (adapters off) is the SFT model, as in the papers' pipelines; the
final adapter is saved stacked with the SFT one (`stack_adapters`), so it loads on the original base.

`--algo ppo` adds a value head (logprobs.ValueHead) to the LogprobHead: trained with the adapters (AdamW),
saved as `value_head.safetensors` in every checkpoint and next to the final adapter or model, and restored
on --resume. The other stages have none, and their files are what they always were.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nanogrpo.config import TrainConfig
from nanogrpo.infra import dist
from nanogrpo.infra.checkpoint import load_full_weights, save_full_weights, write_full_weights
from nanogrpo.infra.dist import parallel_mode
from nanogrpo.model import lora
from nanogrpo.model.fast.shared_prompt import FastLogprobHead
from nanogrpo.model.hf_config import ModelArgs
from nanogrpo.model.hf_model import general_positions, load_model, model_impl
from nanogrpo.model.logprobs import Batch, LogprobHead, ValueHead, completion_logprobs
from nanogrpo.model.memory import needs_reference
from nanogrpo.model.paths import plain
from nanogrpo.model.transformer import Transformer
from nanogrpo.model.zoo import load_tokenizer, resolve_model
from nanogrpo_base.files import save_tensors

VALUE_HEAD = "value_head.safetensors"  # PPO's value head, next to the adapter or model weights


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Transformer inside a LogprobHead, itself maybe inside DDP (FSDP keeps the module in place)."""
    model = model.module if hasattr(model, "module") else model
    return model.model if isinstance(model, LogprobHead) else model


@dataclass
class Policy:
    """The trained model and what goes with it."""

    model: torch.nn.Module  # LogprobHead(Transformer): what the loss calls; in DDP or FSDP under torchrun
    tokenizer: object
    ref_model: torch.nn.Module | None  # full fine-tune with KL: a frozen copy (FSDP: sharded); LoRA: None
    pad_id: int
    eos_ids: list[int]
    autocast: torch.dtype | None  # forward autocast dtype for a full fine-tune in bf16
    use_lora: bool
    model_dir: Path
    fsdp: bool = False  # model (and ref_model) sharded with FSDP2
    init_from: str = ""  # the SFT adapter merged into the base weights ('' = none)

    @property
    def core(self) -> Transformer:
        return unwrap(self.model)

    def gathered(self) -> contextlib.AbstractContextManager:
        """Around calls of `core` outside the wrapped forward (the sampler, evaluation). With FSDP it
        all-gathers the weights, so every rank must enter it, outside inference_mode; else it does nothing."""
        if not self.fsdp:
            return contextlib.nullcontext()
        from nanogrpo.infra.fsdp import gathered

        return gathered(self.model)

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a micro-batch's forward and backward: under DDP, gradients are all-reduced only with the
        last micro-batch of a pass (they add up locally until then); a no-op otherwise."""
        if last or not hasattr(self.model, "no_sync") or self.fsdp:
            return contextlib.nullcontext()
        return self.model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-batch's loss. The loss is normalised by counts summed over all ranks, so
        the right gradient is the SUM over ranks; DDP's all-reduce and FSDP's reduce-scatter both
        average, hence the factor world()."""
        (loss * dist.world()).backward()

    def step(self, opt, sched, grad_clip: float) -> float:
        """Clip, step, schedule, zero; returns the grad norm before clipping (the full norm on every rank)."""
        params = lora.trainable_parameters(self.model)
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP: a replicated DTensor, already reduced over the shards
            norm = norm.full_tensor()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    @property
    def value_head(self) -> ValueHead | None:
        """PPO's value head (inside the wrapped forward), or None."""
        head = self.model.module if hasattr(self.model, "module") else self.model
        return getattr(head, "value_head", None)

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """log pi_ref of the completion tokens: the model with LoRA disabled, or the frozen copy.

        The same path as the policy's log-probs (same weights' dtype, autocast, kernels and batch), so a
        policy equal to its reference has a KL of exactly 0, not rounding noise."""
        if self.use_lora:
            with lora.disabled(self.core):
                return completion_logprobs(logprob_head(self.core), batch, temperature, self.autocast)[0]
        assert self.ref_model is not None, "KL needs a reference model"
        return completion_logprobs(logprob_head(self.ref_model), batch, temperature, self.autocast)[0]

    @torch.no_grad()
    def trainer_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """log pi of the completion tokens on the trainer's path, without grad (dropout off): the policy's
        side of a KL in the reward, computed as the reference's side is."""
        return self._eval_forward(batch, temperature)[0]

    @torch.no_grad()
    def trainer_entropy(self, batch: Batch, temperature: float) -> torch.Tensor:
        """The entropy of pi at each completion token (N, Tc), as trainer_logprobs computes it."""
        return self._eval_forward(batch, temperature)[1]

    def _eval_forward(self, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        was_training = self.model.training
        self.model.eval()
        try:
            return completion_logprobs(self.model, batch, temperature, self.autocast)
        finally:
            self.model.train(was_training)

    def save_weights(self, folder: Path) -> None:
        """The trainable weights (not for FSDP: see checkpoint_parts), and PPO's value head."""
        if self.use_lora:
            lora.save_adapter(self.core, folder, base_model_name_or_path=str(self.model_dir))
        else:
            save_full_weights(self.core, folder)
        self._save_value_head(folder)

    def _save_value_head(self, folder: Path) -> None:
        if self.value_head is not None:
            tensors = {
                n: p.detach().float().contiguous().cpu() for n, p in self.value_head.named_parameters()
            }
            save_tensors(tensors, folder / VALUE_HEAD, metadata={"format": "pt"})

    def _load_value_head(self, folder: Path) -> None:
        if self.value_head is None:
            return
        if not (folder / VALUE_HEAD).is_file():
            raise ValueError(
                f"{folder} has no {VALUE_HEAD}: it was not saved by an --algo ppo run, so its value head "
                "cannot be restored; resume it with the --algo it was trained with, or start a new run"
            )
        from safetensors.torch import load_file

        tensors = load_file(str(folder / VALUE_HEAD))
        with torch.no_grad():
            for n, p in self.value_head.named_parameters():
                p.copy_(tensors[n])

    def load_weights(self, folder: Path) -> None:
        self._load_value_head(folder)
        if self.use_lora:
            lora.load_adapter(self.core, folder)
        elif self.fsdp:
            from safetensors.torch import load_file

            from nanogrpo.infra.fsdp import load_full_state_dict

            load_full_state_dict(self.model, load_file(str(folder / "model.safetensors")))
        else:
            load_full_weights(self.core, folder)

    def checkpoint_parts(self, opt) -> tuple[Callable[[Path], None], dict]:
        """What a checkpoint holds: a function that writes the weights into a folder, and the optimizer
        state. Every rank calls it: with FSDP it gathers the full tensors to rank 0, which writes them."""
        if not self.fsdp:
            return self.save_weights, opt.state_dict()
        from nanogrpo.infra.fsdp import full_state_dict, optimizer_state

        tensors = full_state_dict(self.model)
        return (lambda folder: write_full_weights(tensors, folder)), optimizer_state(self.model, opt)

    def load_checkpoint(self, folder: Path, opt, optimizer_state: dict) -> None:
        """Weights and optimizer state back from a checkpoint; every rank calls it (and reads the files)."""
        self.load_weights(folder)
        if self.fsdp:
            from nanogrpo.infra.fsdp import load_optimizer_state

            load_optimizer_state(self.model, opt, optimizer_state)
        else:
            opt.load_state_dict(optimizer_state)

    def save_final(self, folder: Path) -> None:
        """The adapter (PEFT layout), or the full model as an HF folder (weights, config.json,
        generation_config.json), plus the tokenizer, and PPO's value head (value_head.safetensors: w and b
        of V(s) = w . h + b on the final-normed hidden state). Every rank calls it; rank 0 writes.

        With init_from the adapter is the SFT adapter stacked with the one trained here, so it loads on
        the original base model like any adapter (see stack_adapters)."""
        tensors = None
        if self.fsdp:
            from nanogrpo.infra.fsdp import full_state_dict

            tensors = full_state_dict(self.model)  # collective
        if not dist.is_main():
            return
        folder.mkdir(parents=True, exist_ok=True)
        if self.use_lora:
            self.save_weights(folder)
            if self.init_from:
                lora.stack_adapters(Path(self.init_from), folder)
        else:
            if tensors is not None:
                write_full_weights(tensors, folder)
            else:
                save_full_weights(self.core, folder)
            self._save_value_head(folder)
            for name in ("config.json", "generation_config.json"):  # what from_pretrained reads
                if (self.model_dir / name).is_file():
                    shutil.copyfile(self.model_dir / name, folder / name)
        self.tokenizer.save_pretrained(str(folder))


def prompt_limit(cfg: TrainConfig) -> tuple[int, int]:
    """(the longest prompt the run allows, the model's positions), from the model folder's config.json:
    --data.max-prompt-tokens, at most the positions less --sampling.max-new-tokens (with --env, less the
    episode's budget --env.max-tokens)."""
    positions = model_positions(resolve_model(cfg.model.path), cfg.model.impl)
    room = positions - cfg.completion_tokens
    if room < 1:
        what = (
            f"--env.max-tokens {cfg.completion_tokens} (an episode's budget: --env.max-turns "
            f"{cfg.env.max_turns} x (--sampling.max-new-tokens + 64) unless given)"
            if cfg.env.on
            else f"--sampling.max-new-tokens {cfg.completion_tokens}"
        )
        fix = "lower --env.max-turns or --env.max-tokens" if cfg.env.on else "lower it"
        raise ValueError(f"{what} leaves no room for a prompt in the model's {positions} positions; {fix}")
    return (min(room, cfg.data.max_prompt_tokens) if cfg.data.max_prompt_tokens > 0 else room), positions


def model_positions(model_dir, impl: str = "auto") -> int:
    """The positions a model folder's config.json allows (its context), checked to be an architecture nanogrpo
    runs (--model.impl); on nanogrpo's own model, at most the sliding window, where it is exact (gemma3.py)."""
    if model_impl(model_dir, impl) == "transformers":
        return general_positions(model_dir)
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    args = ModelArgs.from_hf(hf)  # unknown architecture: fail first
    return min(int(hf.get("max_position_embeddings") or 1 << 30), args.sliding_window or 1 << 30)


def load_policy(cfg: TrainConfig, device: torch.device, dtype: torch.dtype, tokenizer=None) -> Policy:
    """The policy of a run; `tokenizer`: the one prompt_budget loaded already (None: load it here)."""
    model_dir = resolve_model(cfg.model.path)
    model_impl(model_dir, cfg.model.impl)  # an architecture no model runs: fail first
    tok = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
    use_lora, parallel = cfg.lora.r > 0, parallel_mode(cfg)
    # LoRA: frozen base in the compute dtype. Full fine-tune: float32 weights, bf16 compute by autocast.
    w_dtype = dtype if use_lora else torch.float32
    model = load_model(model_dir, cfg.model.impl, w_dtype, device, cfg.model.attn)
    model.activation_checkpointing = cfg.model.activation_checkpointing
    autocast = None if use_lora or dtype == torch.float32 else dtype
    if cfg.lora.init_from:  # GRPO after SFT: the SFT model becomes the base, and so the KL reference
        lora.load_adapter(model, cfg.lora.init_from)
        lora.merge_into_base(model)
    ref_model = None
    if use_lora:
        lora.inject_lora(
            model, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout, targets=cfg.lora.targets
        )
    else:  # every weight trains; a KL needs a frozen copy
        ref_model = full_finetune(model, cfg, parallel, device, dtype)
    eos_ids, pad_id = eos_and_pad(model.config, tok)
    # PPO's critic shares the trunk and its adapters: one forward gives the log-probs and the values
    value_head = ValueHead(model.config.hidden_size).to(device) if cfg.algo == "ppo" else None
    head = logprob_head(model, value_head)
    if parallel != "none":  # torchrun: DDP or FSDP2
        head, ref_model = wrap_for_ranks(head, ref_model, parallel, device, dtype)
    fsdp = parallel == "fsdp"
    return Policy(
        head, tok, ref_model, pad_id, eos_ids, autocast, use_lora, model_dir, fsdp, cfg.lora.init_from
    )


def logprob_head(model: torch.nn.Module, value_head: ValueHead | None = None) -> torch.nn.Module:
    """The model's log-prob forward: LogprobHead, the plain pass, under --plain; FastLogprobHead (each
    shared prompt once, the chunked LM head) otherwise. A head (maybe wrapped) is returned as it is."""
    if isinstance(getattr(model, "module", model), LogprobHead):
        return model
    return LogprobHead(model, value_head) if plain() else FastLogprobHead(model, value_head)


def eos_and_pad(model_config, tokenizer) -> tuple[list[int], int]:
    """(the ids that end a completion, the pad id) the sampler is given: the EOS ids of the model's
    config.json, then the tokenizer's; its pad token, else the first EOS id (0 when there is none). Pads are
    masked and cut off when decoding, so the pad id never changes a completion."""
    eos = [*(getattr(model_config, "eos_token_ids", None) or ())]
    if tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    eos = list(dict.fromkeys(eos))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    return eos, pad


def full_finetune(model: Transformer, cfg: TrainConfig, parallel: str, device, dtype) -> Transformer | None:
    """A full fine-tune: every weight trainable; the frozen reference copy when the run needs one (a KL)."""
    for p in model.parameters():
        p.requires_grad_(True)
    if not needs_reference(cfg):
        return None
    # the reference runs the policy's path: float32 weights under the same autocast (a bf16 copy would differ
    # by rounding at step 0: |log pi - log ref| ~ 1e-2 a token). Under FSDP on a GPU the policy computes with
    # bf16 all-gathered weights, so a bf16 copy is the same path there.
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    if parallel == "fsdp" and device.type == "cuda" and dtype != torch.float32:
        ref_model.to(dtype)
    return ref_model


def wrap_for_ranks(
    head: LogprobHead, ref_model, parallel: str, device, dtype
) -> tuple[torch.nn.Module, object]:
    """torchrun: the policy (and the reference) sharded with FSDP2, or the policy replicated with DDP."""
    if parallel == "fsdp":
        from nanogrpo.infra import fsdp

        # GPU: float32 master weights, all-gathered in bf16 for compute; CPU (gloo): float32 throughout
        compute = dtype if device.type == "cuda" and dtype != torch.float32 else None
        if ref_model is not None:  # sharded first: its full copy is freed before the policy's goes
            ref_model = fsdp.shard(logprob_head(ref_model), compute, frozen=True)
        return fsdp.shard(head, compute), ref_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(head, device_ids=[device.index] if device.type == "cuda" else None), ref_model
