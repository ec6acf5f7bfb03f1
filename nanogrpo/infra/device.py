"""Where a run computes and how: the device and the compute dtype, and the seeds.

Precision: frozen weights run in the compute dtype (bfloat16 on a GPU or on a CPU with bf16 matmul units
that oneDNN's bf16 path runs on, see nanogrpo.infra.cpu; float32 elsewhere); trained weights are float32 master
copies (LoRA adapters always; a full fine-tune keeps float32 weights and runs the forward under autocast).
Log-softmax and the loss are float32.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from nanogrpo.config import ModelConfig
from nanogrpo.infra import dist
from nanogrpo.infra.cpu import cpu_capability


def _parse_device(value: str, flag: str) -> torch.device:
    """The device flag's value as a device nanogrpo runs on (a CPU, a visible CUDA GPU, or an out-of-tree
    backend registered under its own name, as the tests' stand-in device is), checked before any model
    loads: anything else (a type this build has no backend for, 'tpu', 'mps', a typo, 'cuda:x', a GPU index
    past the visible ones) is a ValueError that names what works, not torch's traceback at the first use."""
    try:
        device = torch.device(value)
    except RuntimeError:
        device = None  # a type torch does not know ('tpu', 'foo'), or no device string ('cuda:x', '')
    registered = torch._C._get_privateuse1_backend_name()  # 'privateuseone' unless a backend renamed it
    if device is None or device.type not in (
        "cpu",
        "cuda",
        *(() if registered == "privateuseone" else (registered,)),
    ):
        raise ValueError(f"{flag} {value!r} is not a device nanogrpo runs on; use cpu, cuda, cuda:N or auto")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {value!r} but no GPU is visible; use {flag} cpu")
        n = torch.cuda.device_count()
        if device.index is not None and device.index >= n:
            visible = (
                "1 GPU is visible; use cuda:0"
                if n == 1
                else f"{n} GPUs are visible; use cuda:0 to cuda:{n - 1}"
            )
            raise ValueError(f"{flag} {value!r} but {visible} (numbered from 0 after CUDA_VISIBLE_DEVICES)")
    return device


def resolve_device_dtype(cfg: ModelConfig, flag: str = "--model.device") -> tuple[torch.device, torch.dtype]:
    """The device and compute dtype of `cfg` (`flag`: how the command spells the device flag, for its errors)."""
    import nanogrpo_kernels

    if cfg.kernels != "auto":  # 'auto' leaves NANOGRPO_KERNELS in charge
        nanogrpo_kernels.set_backend(cfg.kernels)  # once, before the first kernel call
    if cfg.device == "auto":
        device = torch.device(f"cuda:{dist.local_rank()}" if torch.cuda.is_available() else "cpu")
    else:
        device = _parse_device(cfg.device, flag)
    if cfg.dtype != "auto":
        return device, getattr(torch, cfg.dtype)
    if device.type == "cuda":
        # float32 matmuls (LoRA adapters, the value head, a --model.dtype float32 run) on tensor cores (TF32)
        torch.set_float32_matmul_precision("high")
        return device, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # bf16 only where it is fast: native bf16 units that oneDNN's bf16 path runs on (tried, see cpu.py)
    return device, torch.bfloat16 if cpu_capability().bf16 else torch.float32


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
