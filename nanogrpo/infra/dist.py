"""torchrun helpers: rank, world size, all-reduce of counts and metric sums.

Under `torchrun --nproc-per-node N train.py`, each rank samples and scores its own share of the step's
prompts (whole groups stay on one rank) and the loss is normalised by counts summed over all ranks, so
the update equals the single-process update on the same global batch. Without torchrun every function
here is a no-op and world() == 1.
"""

from __future__ import annotations

import os
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from nanogrpo.config import TrainConfig


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def backend_for(device_type: str) -> str:
    """The process group's backends: gloo for CPU tensors everywhere, plus NCCL for CUDA tensors on GPUs.

    NCCL has no CPU all_reduce, and the trainer reduces its counts and metrics as CPU tensors: a group
    with NCCL alone fails at the first metric. One group with a backend per device type serves both.
    """
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def init(device_type: str) -> None:
    """Join the process group when launched by torchrun (WORLD_SIZE set); see backend_for."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not is_distributed():
        if device_type == "cuda":
            torch.cuda.set_device(local_rank())
        dist.init_process_group(backend=backend_for(device_type), timeout=timedelta(minutes=30))


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def _reduce_floats(values: dict[str, float], op) -> dict[str, float]:
    if not is_distributed():
        return dict(values)
    keys = sorted(values)
    # the same keys on every rank, or the reduction would add up different metrics (or hang on a length
    # mismatch): compare a checksum of the names first, as its max and its negated min
    crc = float(zlib.crc32("\0".join(keys).encode()))
    check = torch.tensor([crc, -crc], dtype=torch.float64)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    if check[0] != -check[1]:
        raise AssertionError(
            f"rank {rank()}: metric keys differ between ranks (this rank has {keys}); every rank must "
            "report the same keys, e.g. with a 0 and a count where it has no value"
        )
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)  # CPU: gloo
    dist.all_reduce(t, op=op)
    return dict(zip(keys, t.tolist()))


def sum_floats(values: dict[str, float]) -> dict[str, float]:
    """Sum a dict of Python floats over ranks in one collective (the keys must match on every rank)."""
    return _reduce_floats(values, dist.ReduceOp.SUM)


def max_floats(values: dict[str, float]) -> dict[str, float]:
    """Max of a dict of Python floats over ranks in one collective (the keys must match on every rank)."""
    return _reduce_floats(values, dist.ReduceOp.MAX)


def gather_objects(obj) -> list:
    """Every rank's object, on every rank (for samples and eval rows; small)."""
    if not is_distributed():
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group together: a rank that tears down while rank 0 still writes its plots and
    run page can abort (gloo) instead of exiting cleanly."""
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()


def parallel_mode(cfg: TrainConfig) -> str:
    """'ddp', 'fsdp', or 'none' (one process): how the policy is wrapped under torchrun."""
    if world() == 1:
        return "none"
    mode = cfg.model.parallel
    if mode == "auto":
        mode = "ddp" if cfg.lora.r > 0 else "fsdp"
    if mode == "fsdp" and cfg.lora.r > 0:
        raise ValueError("--model.parallel fsdp shards full fine-tunes (--lora.r 0); LoRA runs with ddp")
    if mode == "fsdp" and cfg.algo == "ppo":
        raise ValueError(
            "--algo ppo does not shard its value head with FSDP: use --model.parallel ddp (a full fine-tune "
            "that fits on one device), or LoRA (--lora.r > 0)"
        )
    if mode == "fsdp" and cfg.optim.name != "adamw":
        raise ValueError(
            f"--optim.name {cfg.optim.name} works on whole matrices, FSDP holds shards of them: "
            "use --optim.name adamw or --model.parallel ddp"
        )
    return mode
