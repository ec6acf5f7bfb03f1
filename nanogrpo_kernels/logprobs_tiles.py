"""The launch configs of nanogrpo_kernels/logprobs.py's Triton kernels: tile sizes per kernel, input width
and GPU generation, the interpreter's tiles, and the backward's chunk size.

The kernels and their PyTorch reference are in nanogrpo_kernels/logprobs.py; bench/kernels_aot.py compiles
these configs for each GPU generation without a GPU and bench/kernel_timings.py times other tiles through
`CONFIG_OVERRIDE`.
"""

import torch

from nanogrpo_kernels import interpreting

# Tile sizes, per kernel, input width and GPU generation, chosen at launch from the device's compute
# capability. Each one compiles with no register spills and within the shared memory of every GPU it
# may meet (sm_80: 163 KiB per block, sm_86/89: 99 KiB, sm_90: 227 KiB) with Triton 3.6 and 3.9:
# bench/kernels_aot.py compiles them for sm_80, sm_89 and sm_90 without a GPU and checks (table in
# docs/BENCHMARKS.md). Why these:
# - 16-bit forward on sm_90: 128 x 128 logits tiles, 64-wide steps over H, 3 stages (96 KiB of shared
#   memory, ~212 registers a thread). On sm_8x that tile hits the 255-register cap and spills at 8 warps
#   (at 16 warps too, with Triton 3.9); 128 x 64 needs ~180 registers and 48 KiB.
# - 16-bit backward: 128 x 128 x 64 at 8 warps everywhere (~150 registers on sm_8x, ~180 with the entropy
#   gradient; 64 KiB of shared memory, 96 KiB on sm_90).
# - float32 (IEEE products, twice the bytes per operand): 128 x 128 x 64 needs 128 KiB of shared memory
#   (over sm_89's 99 KiB) and spills in the forward. Forward 64 x 128 x 16 (24 KiB, ~200 registers: the
#   float32 dot keeps more operands in registers than a bf16 one), backward 64 x 128 x 32 (48 KiB, 128).
# Generations after sm_90 (sm_100; sm_120: 99 KiB) take the sm_90 tiles; those before it the sm_80 ones.
# Triton specialises the loads for a hidden size that is a multiple of 16 (all released models); other
# sizes compile without vectorised loads and spill: correct, slower.
_TILE16 = dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3)
GPU_CONFIGS = {  # (kernel, input width, GPU generation) -> launch config
    ("fwd", "16bit", "sm80"): dict(_TILE16, BLOCK_V=64),
    ("fwd", "16bit", "sm90"): _TILE16,
    ("bwd", "16bit", "sm80"): _TILE16,
    ("bwd", "16bit", "sm90"): _TILE16,
    ("fwd", "fp32", "sm80"): dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=16, num_warps=8, num_stages=3),
    ("fwd", "fp32", "sm90"): dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=16, num_warps=8, num_stages=3),
    ("bwd", "fp32", "sm80"): dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=32, num_warps=8, num_stages=3),
    ("bwd", "fp32", "sm90"): dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=32, num_warps=8, num_stages=3),
}
# The interpreter: small tiles, so that tests stay fast.
CPU_CONFIG = dict(BLOCK_N=16, BLOCK_V=128, BLOCK_H=32)
# bench/kernel_timings.py tries other tiles by putting a config here under 'fwd' or 'bwd' (unchecked: it may
# spill).
CONFIG_OVERRIDE: dict[str, dict] = {}
# Triton backward: at most this many dz entries per chunk (2**28 = 512 MiB in bf16).
TRITON_CHUNK_ELEMS = 1 << 28


def gpu_config(kernel: str, dtype: torch.dtype, capability: tuple[int, int]) -> dict:
    """The launch config of `kernel` ('fwd' or 'bwd') for inputs of `dtype` on a GPU of compute capability
    `capability` (major, minor), as torch.cuda.get_device_capability gives it."""
    width = "fp32" if dtype == torch.float32 else "16bit"
    generation = "sm90" if capability[0] >= 9 else "sm80"
    return dict(GPU_CONFIGS[kernel, width, generation])


def launch_args(hidden: torch.Tensor, kernel: str) -> dict:
    """The launch config of `kernel` ('fwd' or 'bwd') for these inputs: the interpreter's small tiles, a
    bench override, or the shipped tiles of this GPU; with the dtype flags the kernels read."""
    interp = interpreting()
    if interp:
        cfg = dict(CPU_CONFIG)
    elif kernel in CONFIG_OVERRIDE:
        cfg = dict(CONFIG_OVERRIDE[kernel])
    else:
        cfg = gpu_config(kernel, hidden.dtype, torch.cuda.get_device_capability(hidden.device))
    cfg.update(DOT_F32=interp, IEEE=hidden.dtype == torch.float32)
    return cfg
