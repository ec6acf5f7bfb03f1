"""Setting up a run: device and dtype, seeds, the policy (model + tokenizer + LoRA + reference), and the
optimizer step.

Precision: frozen weights run in the compute dtype (bfloat16 on a GPU or a CPU with bf16 matmul units,
float32 elsewhere); trained weights are float32 master copies (LoRA adapters always; a full fine-tune
keeps float32 weights and runs the forward under autocast). Log-softmax and the loss are float32.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import dist, lora
from .checkpoint import load_full_weights, save_full_weights
from .config import ModelConfig, TrainConfig
from .model import ModelArgs, Transformer
from .model_zoo import resolve_model
from .policy import Batch, LogprobHead, completion_logprobs


def cpu_has_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX): then bf16 is several times faster."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device_dtype(cfg: ModelConfig) -> tuple[torch.device, torch.dtype]:
    import kernels

    if cfg.kernels != "auto":  # 'auto' leaves NANOGRPO_KERNELS in charge
        kernels.set_backend(cfg.kernels)  # once, before the first kernel call
    if cfg.device == "auto":
        device = torch.device(f"cuda:{dist.local_rank()}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--model.device cuda but no GPU is visible; use --model.device cpu")
    if cfg.dtype != "auto":
        return device, getattr(torch, cfg.dtype)
    if device.type == "cuda":
        return device, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return device, torch.bfloat16 if cpu_has_bf16() else torch.float32


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def micro_slices(n: int, micro: int) -> list[slice]:
    """Row slices of at most `micro` rows (0 = one slice with everything)."""
    micro = n if micro <= 0 else micro
    return [slice(i, min(i + micro, n)) for i in range(0, n, micro)]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Transformer inside a LogprobHead, itself maybe inside DDP."""
    model = model.module if hasattr(model, "module") else model
    return model.model if isinstance(model, LogprobHead) else model


@dataclass
class Policy:
    """The trained model and what goes with it."""

    model: torch.nn.Module  # LogprobHead(Transformer): what the loss calls; inside DDP under torchrun
    tokenizer: object
    ref_model: torch.nn.Module | None  # frozen copy for a full fine-tune with KL; None with LoRA
    pad_id: int
    eos_ids: list[int]
    autocast: torch.dtype | None  # forward autocast dtype for a full fine-tune in bf16
    use_lora: bool
    model_dir: Path

    @property
    def core(self) -> Transformer:
        return unwrap(self.model)

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """log pi_ref of the completion tokens: the model with LoRA disabled, or the frozen copy."""
        if self.use_lora:
            with lora.disabled(self.core):
                return completion_logprobs(self.core, batch, temperature)[0]
        assert self.ref_model is not None, "KL needs a reference model"
        return completion_logprobs(self.ref_model, batch, temperature, self.autocast)[0]

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-batch's loss. The loss is normalised by counts summed over all ranks, so
        the right gradient is the SUM over ranks; DDP averages, hence the factor world()."""
        (loss * dist.world()).backward()

    def step(self, opt, sched, grad_clip: float) -> float:
        """Clip, step, schedule, zero; returns the grad norm before clipping."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    def save_weights(self, folder: Path) -> None:
        if self.use_lora:
            lora.save_adapter(self.core, folder, base_model_name_or_path=str(self.model_dir))
        else:
            save_full_weights(self.core, folder)

    def load_weights(self, folder: Path) -> None:
        if self.use_lora:
            lora.load_adapter(self.core, folder)
        else:
            load_full_weights(self.core, folder)

    def save_final(self, folder: Path) -> None:
        """The adapter (PEFT layout), or the full model as an HF folder, plus the tokenizer."""
        folder.mkdir(parents=True, exist_ok=True)
        self.save_weights(folder)
        self.tokenizer.save_pretrained(str(folder))


def load_policy(cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> Policy:
    from transformers import AutoTokenizer

    model_dir = resolve_model(cfg.model.path)
    ModelArgs.from_hf(json.loads((model_dir / "config.json").read_text()))  # unknown architecture: fail first
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    use_lora = cfg.lora.r > 0
    # LoRA: frozen base in the compute dtype. Full fine-tune: float32 weights, bf16 compute by autocast.
    model = Transformer.from_pretrained(
        model_dir, dtype=dtype if use_lora else torch.float32, device=device, attn=cfg.model.attn
    )
    model.activation_checkpointing = cfg.model.activation_checkpointing
    autocast = None if use_lora or dtype == torch.float32 else dtype
    ref_model = None
    if use_lora:
        lora.inject_lora(
            model, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout, targets=cfg.lora.targets
        )
        if cfg.lora.init_from:
            lora.load_adapter(model, cfg.lora.init_from)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
        if cfg.algo == "grpo" and cfg.grpo.kl_placement != "none":
            ref_model = copy.deepcopy(model).eval().requires_grad_(False)
            if dtype != torch.float32:
                ref_model.to(dtype)
    eos_ids = list(
        dict.fromkeys(
            [*model.config.eos_token_ids, *([tok.eos_token_id] if tok.eos_token_id is not None else [])]
        )
    )
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    head = LogprobHead(model)
    if dist.world() > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        head = DDP(head, device_ids=[device.index] if device.type == "cuda" else None)
    return Policy(head, tok, ref_model, pad_id, eos_ids, autocast, use_lora, model_dir)
