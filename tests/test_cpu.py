"""CPU capability detection and the paths that depend on it: on a CPU where oneDNN's bf16 path raises (an
AVX2-only CPU) a bf16 model still samples, on its plain weights, and 'auto' picks float32, whose weights
are packed for MKL's sgemm."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanogrpo import cpu
from nanogrpo.config import ModelConfig
from nanogrpo.device import resolve_device_dtype
from nanogrpo.model import Transformer
from nanogrpo.packed import packing_supported
from nanogrpo.sampling import generate

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


def test_packed_off_by_environment(monkeypatch):
    monkeypatch.setenv("NANOGRPO_PACKED", "0")
    assert not packing_supported(BF16) and not packing_supported(torch.zeros(1))


AVX2_CHECK = """
import torch
from nanogrpo.config import ModelConfig
from nanogrpo.cpu import cpu_capability
from nanogrpo.model import Transformer
from nanogrpo.model_zoo import resolve_model
from nanogrpo.packed import packing_supported
from nanogrpo.device import resolve_device_dtype
from nanogrpo.sampling import generate

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
print(cap.isa, cap.onednn_bf16, packing_supported(model.lm_head_weight), cap.mkl_packed_fp32, same, dtype, tuple(out.completion_ids.shape))
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 ISA caps only")
def test_avx2_only_machine_emulated(tiny_model_dir):
    """ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 (MKL_ENABLE_INSTRUCTIONS=AVX2 on Intel CPUs): oneDNN
    raises on bf16 as on an AVX2-only EPYC. The capability says so, 'auto' is float32, a bf16 model samples,
    and a float32 model samples on MKL-packed weights (where this torch has MKL) the tokens of the plain
    path."""
    env = dict(
        os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2"
    )
    out = subprocess.run(
        [sys.executable, "-c", AVX2_CHECK], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    isa, onednn, packed, mkl, same, dtype, shape = out.stdout.strip().split(maxsplit=6)
    assert isa not in ("AMX", "AVX512-BF16", "AVX512"), out.stdout
    assert (onednn, packed, dtype, shape) == ("False", "False", "torch.float32", "(2, 3)"), out.stdout
    assert mkl == str(torch.backends.mkl.is_available()) and same == "True", out.stdout
