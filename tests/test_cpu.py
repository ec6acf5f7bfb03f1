"""CPU capability detection and the paths that depend on it: on a CPU where oneDNN's bf16 path raises (an
AVX2-only CPU) a bf16 model still samples, on its plain weights, and 'auto' picks float32, whose weights
are packed for MKL's sgemm on Intel CPUs and for oneDNN's float32 matmul on the others."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanogrpo.config import ModelConfig
from nanogrpo.infra import cpu
from nanogrpo.infra.device import resolve_device_dtype
from nanogrpo.model.fast.packed import packing_supported
from nanogrpo.model.fast.sampler import generate
from nanogrpo.model.transformer import Transformer

ROOT = Path(__file__).resolve().parent.parent
ONEDNN_AVX2_ERROR = (
    "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl "
    "and avx512dq"
)
BF16 = torch.zeros(1, dtype=torch.bfloat16)


@pytest.fixture
def fresh_detection():
    """Detection runs again inside the test, and again after it (the cached answer is this machine's)."""
    cpu.cpu_capability.cache_clear()
    yield
    cpu.cpu_capability.cache_clear()


def test_capability_is_consistent():
    cap = cpu.cpu_capability()
    assert cap is cpu.cpu_capability(), "detected once per process"
    assert cap.bf16_units == (cap.isa in ("AMX", "AVX512-BF16"))
    assert cap.bf16 == (cap.bf16_units and cap.onednn_bf16)
    assert cap.isa in str(cap)
    device, dtype = resolve_device_dtype(ModelConfig(dtype="auto", device="cpu"))
    assert dtype == (torch.bfloat16 if cap.bf16 else torch.float32)


def test_bf16_model_samples_where_onednn_bf16_raises(monkeypatch, fresh_detection, tiny_model_dir):
    """oneDNN's bf16 reorder raising, as on an AVX2-only CPU: no packing, a bf16 model's generate() runs on
    the plain path, and 'auto' is float32."""

    def reorder(*args, **kwargs):
        raise RuntimeError(ONEDNN_AVX2_ERROR)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", reorder)
    model = Transformer.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    out = generate(model, [[5, 6, 7], [8, 9]], group_size=2, max_new_tokens=4, temperature=1.0, pad_id=0)
    assert out.completion_ids.shape[0] == 4 and torch.isfinite(out.logp).all()
    assert not cpu.cpu_capability().onednn_bf16 and not cpu.cpu_capability().bf16
    assert not packing_supported(BF16)
    assert resolve_device_dtype(ModelConfig(dtype="auto", device="cpu"))[1] == torch.float32


def caps(vendor: str, onednn: bool = True, mkl: bool = True) -> cpu.CpuCapability:
    """An AVX2 CPU of this vendor where oneDNN's and MKL's float32 packing run or not."""
    return cpu.CpuCapability("AVX2", False, False, mkl, onednn, vendor)


def test_float32_packing_follows_the_vendor(monkeypatch):
    """MKL's packed sgemm on Intel CPUs, oneDNN's float32 packing on the others (MKL's was 1.5-2x slower
    on an AMD EPYC) and where the vendor is unknown; the one that runs where only one does; none where
    neither does. NANOGRPO_PACKED_FP32 overrides it, with an error naming the fix for a bad value."""
    monkeypatch.delenv("NANOGRPO_PACKED_FP32", raising=False)
    assert caps("GenuineIntel").fp32_packing == "mkl"
    assert caps("AuthenticAMD").fp32_packing == "onednn" and caps("").fp32_packing == "onednn"
    assert caps("GenuineIntel", mkl=False).fp32_packing == "onednn"
    assert caps("AuthenticAMD", onednn=False).fp32_packing == "mkl"
    assert caps("AuthenticAMD", onednn=False, mkl=False).fp32_packing is None
    assert "float32 packing: oneDNN; AuthenticAMD" in str(caps("AuthenticAMD"))
    assert "float32 packing: none; vendor unknown" in str(caps("", onednn=False, mkl=False))
    monkeypatch.setenv("NANOGRPO_PACKED_FP32", "mkl")
    assert caps("AuthenticAMD").fp32_packing == "mkl"
    assert "float32 packing: oneDNN" in str(caps("AuthenticAMD")), "the line names the CPU's own choice"
    with pytest.raises(ValueError, match="does not run on this CPU"):
        _ = caps("AuthenticAMD", mkl=False).fp32_packing
    monkeypatch.setenv("NANOGRPO_PACKED_FP32", "openblas")
    with pytest.raises(ValueError, match=r"use one of \['mkl', 'onednn'\]"):
        _ = caps("GenuineIntel").fp32_packing


def test_vendor_is_read_from_the_os():
    """Linux names the vendor in /proc/cpuinfo, and the capability carries it."""
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo")
    ids = {line.split(":")[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")}
    assert cpu.cpu_capability().vendor in ids | ({""} if not ids else set())


def test_packed_off_by_environment(monkeypatch):
    monkeypatch.setenv("NANOGRPO_PACKED", "0")
    assert not packing_supported(BF16) and not packing_supported(torch.zeros(1))


AVX2_CHECK = """
import torch
from nanogrpo.config import ModelConfig
from nanogrpo.infra.cpu import cpu_capability
from nanogrpo.model.transformer import Transformer
from nanogrpo.model.zoo import resolve_model
from nanogrpo.model.fast.packed import packing_supported
from nanogrpo.infra.device import resolve_device_dtype
from nanogrpo.model.fast.sampler import generate

cap = cpu_capability()
dtype = resolve_device_dtype(ModelConfig(dtype="auto", device="cpu"))[1]
model = Transformer.from_pretrained(resolve_model("tiny"), dtype=torch.bfloat16)
out = generate(model, [[5, 6, 7]], group_size=2, max_new_tokens=3, temperature=1.0, pad_id=0)
fp32 = Transformer.from_pretrained(resolve_model("tiny"), dtype=torch.float32)
kw = dict(group_size=3, max_new_tokens=6, temperature=1.0, pad_id=0)
packed = generate(fp32, [[5, 6, 7], [9]], generator=torch.Generator().manual_seed(0), **kw)
import os; os.environ["NANOGRPO_PACKED"] = "0"
plain = generate(fp32, [[5, 6, 7], [9]], generator=torch.Generator().manual_seed(0), **kw)
same = torch.equal(packed.completion_ids, plain.completion_ids)
print(cap.isa, cap.onednn_bf16, packing_supported(model.lm_head_weight), cap.fp32_packing, same, dtype, tuple(out.completion_ids.shape))
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 ISA caps only")
def test_avx2_only_machine_emulated(tiny_model_dir):
    """ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 (MKL_ENABLE_INSTRUCTIONS=AVX2 on Intel CPUs): oneDNN
    raises on bf16 as on an AVX2-only EPYC. The capability says so, 'auto' is float32, a bf16 model samples,
    and a float32 model samples on packed weights (this CPU's float32 packing) the tokens of the plain
    path."""
    env = dict(
        os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2"
    )
    out = subprocess.run(
        [sys.executable, "-c", AVX2_CHECK], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    isa, onednn, packed, fp32_packing, same, dtype, shape = out.stdout.strip().split(maxsplit=6)
    assert isa not in ("AMX", "AVX512-BF16", "AVX512"), out.stdout
    assert (onednn, packed, dtype, shape) == ("False", "False", "torch.float32", "(2, 3)"), out.stdout
    assert fp32_packing == str(cpu.cpu_capability().fp32_packing) and same == "True", out.stdout
