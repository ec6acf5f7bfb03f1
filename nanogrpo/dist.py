"""torchrun helpers: rank, world size, all-reduce of counts and metric sums.

Under `torchrun --nproc-per-node N train.py`, each rank samples and scores its own share of the step's
prompts (whole groups stay on one rank) and the loss is normalised by counts summed over all ranks, so
the update equals the single-process update on the same global batch. Without torchrun every function
here is a no-op and world() == 1.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def init(device_type: str) -> None:
    """Join the process group when launched by torchrun (WORLD_SIZE set); NCCL on GPU, gloo on CPU."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not is_distributed():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
        if device_type == "cuda":
            torch.cuda.set_device(local_rank())


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place, and returned); identity on one process."""
    if is_distributed():
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def sum_floats(values: dict[str, float], device: torch.device | str = "cpu") -> dict[str, float]:
    """Sum a dict of Python floats over ranks in one collective (keys must match on every rank)."""
    if not is_distributed():
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    all_reduce_sum(t)
    return dict(zip(keys, t.tolist()))


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
