"""What this CPU can do, found out once per process: the one place nanogrpo asks.

CPUs differ (seen: a Xeon with AMX; an AMD EPYC with AVX512-BF16; an AMD EPYC with AVX2 only), and two
choices depend on it: the dtype that `--model.dtype auto` picks (bf16 only where the CPU multiplies bf16
natively; elsewhere bf16 matmuls are emulated and several times slower than float32), and how the sampler
packs its weights (packed.py): bf16 ones for oneDNN; float32 ones for MKL's packed sgemm on Intel CPUs and
for oneDNN on the others. MKL picks its fastest code by the CPU's vendor: on an AMD EPYC its packed sgemm
is slower than oneDNN's for the decode step's matmuls (and than its own plain sgemm), on a Xeon a little
faster (docs/BENCHMARKS.md).

Why a probe and not the flags alone: /proc/cpuinfo says what the silicon has, not what oneDNN will run.
oneDNN's bf16 path needs avx_ne_convert or AVX512 (bw, vl, dq): on an AVX2-only CPU its bf16 weight reorder
raises "bf16 path needs the cpu support ...", and ONEDNN_MAX_CPU_ISA caps it below what the flags say. So
the packed path is decided by packing a tiny bf16 weight and running one linear on it; when that raises,
everything runs on the plain path; oneDNN's and MKL's float32 packing are tried the same way. The ISA
level is the one torch's own kernels run at, so it honours ATEN_CPU_CAPABILITY too:
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2` makes any Intel x86 machine
behave as an AVX2-only one (float32 by default, no bf16 packing, AVX2 matmuls), which is how the tests check
that machine's paths. All three are needed for its speed: without the last, MKL's float32 matmuls still
run AVX512 code.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

BF16_ISAS = ("AMX", "AVX512-BF16")  # native bf16 dot products


@dataclass(frozen=True)
class CpuCapability:
    isa: str
    """'AMX', 'AVX512-BF16', 'AVX512', 'AVX2', or torch's name for anything else ('DEFAULT', 'SVE256', ...)."""
    bf16_units: bool
    """The CPU multiplies bf16 natively (AMX or AVX512-BF16)."""
    onednn_bf16: bool
    """oneDNN's bf16 weight packing and linear run here (tried once on a tiny weight)."""
    mkl_packed_fp32: bool
    """MKL's packed float32 sgemm runs here (tried once on a tiny weight; torch builds without MKL lack it)."""
    onednn_fp32: bool
    """oneDNN's float32 weight packing and linear run here (tried once on a tiny weight)."""
    vendor: str
    """The CPU's vendor string ('GenuineIntel', 'AuthenticAMD', ...), '' where the OS does not tell."""

    @property
    def bf16(self) -> bool:
        """bf16 is the fast compute dtype here: native bf16 units, and oneDNN's bf16 path runs on them."""
        return self.bf16_units and self.onednn_bf16

    @property
    def fp32_packing(self) -> str | None:
        """Who packs the sampler's float32 weights: NANOGRPO_PACKED_FP32=mkl|onednn where set (to compare the
        two on one machine), else `default_fp32_packing`."""
        asked = os.environ.get("NANOGRPO_PACKED_FP32", "")
        if not asked:
            return self.default_fp32_packing
        runs = {"onednn": self.onednn_fp32, "mkl": self.mkl_packed_fp32}
        if asked not in runs:
            raise ValueError(f"NANOGRPO_PACKED_FP32={asked!r}: use one of {sorted(runs)}, or unset it")
        if not runs[asked]:
            raise ValueError(f"NANOGRPO_PACKED_FP32={asked}: it does not run on this CPU ({self}); unset it")
        return asked

    @property
    def default_fp32_packing(self) -> str | None:
        """'mkl' on Intel CPUs and 'onednn' on the others (MKL's packed sgemm is tuned for Intel's), or
        whichever of the two runs where only one does; None where neither does."""
        order = ("mkl", "onednn") if self.vendor == "GenuineIntel" else ("onednn", "mkl")
        runs = {"onednn": self.onednn_fp32, "mkl": self.mkl_packed_fp32}
        return next((name for name in order if runs[name]), None)

    def __str__(self) -> str:
        yes = lambda b: "yes" if b else "no"
        packer = {"onednn": "oneDNN", "mkl": "MKL", None: "none"}[self.default_fp32_packing]
        return (
            f"{self.isa} (bf16 units: {yes(self.bf16_units)}, oneDNN bf16: {yes(self.onednn_bf16)}, "
            f"float32 packing: {packer}; {self.vendor or 'vendor unknown'})"
        )


@functools.cache
def cpu_capability() -> CpuCapability:
    """This CPU's capability, detected on the first call and kept for the process."""
    isa = torch.backends.cpu.get_cpu_capability()  # 'AVX512', 'AVX2', ...: what ATen dispatches to
    if isa == "AVX512":  # ATen does not tell the bf16 extensions apart: cpuinfo (through torch) does
        if _flag("_is_amx_tile_supported"):
            isa = "AMX"
        elif _flag("_is_avx512_bf16_supported"):
            isa = "AVX512-BF16"
    return CpuCapability(
        isa,
        isa in BF16_ISAS,
        _onednn_runs(torch.bfloat16),
        _mkl_packed_fp32_runs(),
        _onednn_runs(torch.float32),
        _vendor(),
    )


def _flag(name: str) -> bool:
    """One of torch.cpu's feature checks (private helpers over cpuinfo); False where this torch lacks it."""
    check = getattr(torch.cpu, name, None)
    return bool(check()) if check is not None else False


def _onednn_runs(dtype: torch.dtype) -> bool:
    """Pack a tiny weight of `dtype` for oneDNN and apply it, as packed.PackedLinear does; False if either
    raises (bf16 on an AVX2-only CPU: "bf16 path needs the cpu support avx_ne_convert or avx512bw, ...")
    or the result is wrong."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return _tiny_linear_runs(
        dtype,
        lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 2),
        lambda x, packed, w: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    )


def _vendor() -> str:
    """The CPU's vendor string: /proc/cpuinfo's vendor_id on Linux, the one platform.processor() ends with
    on Windows ('... GenuineIntel'); '' elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    words = platform.processor().split()
    return words[-1] if words and words[-1] in ("GenuineIntel", "AuthenticAMD") else ""


def _mkl_packed_fp32_runs() -> bool:
    """Pack a tiny float32 weight with MKL's packed sgemm and apply it, as packed.MklPackedLinear does;
    False if this torch has no MKL (ARM builds), either step raises, or the result is wrong."""
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")):
        return False
    return _tiny_linear_runs(
        torch.float32,
        lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, 2),
        lambda x, packed, w: torch.ops.mkl._mkl_linear(x, packed, w, None, 2),
    )


def _tiny_linear_runs(dtype: torch.dtype, pack, apply) -> bool:
    """`apply(x, pack(w), w)` on a (16, 32) weight of ones and 2 rows of ones: True if neither raises and
    every output is 32."""
    w = torch.ones(16, 32, dtype=dtype)  # (out, in)
    x = torch.ones(2, 32, dtype=dtype)  # (rows, in)
    try:
        y = apply(x, pack(w), w)  # (rows, out)
    except RuntimeError:
        return False
    return y.shape == (2, 16) and bool((y == 32).all())


def packing_supported(weight: torch.Tensor) -> bool:
    """Packing applies to this weight: on the CPU, not switched off by NANOGRPO_PACKED=0, and either bf16
    where oneDNN's bf16 reorder and linear run, or float32 where oneDNN's or MKL's float32 packing runs
    (each tried once by `cpu_capability()`, not read from flags)."""
    if weight.device.type != "cpu" or os.environ.get("NANOGRPO_PACKED", "1") == "0":
        return False
    cap = cpu_capability()
    return (weight.dtype == torch.bfloat16 and cap.onednn_bf16) or (
        weight.dtype == torch.float32 and cap.fp32_packing is not None
    )
