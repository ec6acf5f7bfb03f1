"""nanogrpo_kernels.cosine against F.cosine_similarity: plain and baseline-adjusted (Shaping Explanations),
zero vectors included.

Without CUDA, importing `nanogrpo_kernels` turns on Triton's interpreter, so the kernel runs here on the CPU.
"""

import pytest
import torch
import torch.nn.functional as F

import nanogrpo_kernels
from nanogrpo_kernels.cosine import adjusted_cosine, cosine, cosine_torch, cosine_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_HERE = nanogrpo_kernels.HAS_TRITON and (DEV == "cuda" or nanogrpo_kernels.interpreting())
IMPLS = [cosine_torch] + ([cosine_triton] if TRITON_HERE else [])


def data(n=9, d=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    gen, ref, base = (
        torch.randn(n, d, generator=g),
        torch.randn(n, d, generator=g),
        torch.randn(d, generator=g),
    )
    ref[1] = gen[1] * 3  # same direction: 1
    ref[2] = -gen[2]  # opposite: -1
    gen[3] = 0  # zero vectors: 0 by definition
    ref[4] = 0
    gen[5] = ref[5] + 0.5 * base  # leans to the baseline
    return gen, ref, base


@pytest.mark.parametrize("impl", IMPLS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("d", [100, 2048])  # under and over the kernel's 1024-wide block
def test_cosine_matches_torch(impl, d):
    gen, ref, base = data(d=d)
    want = F.cosine_similarity(gen.double(), ref.double(), dim=-1)
    got = impl(gen.to(DEV) if impl is cosine_triton else gen, ref.to(DEV) if impl is cosine_triton else ref)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=1e-6)
    assert got[3] == 0 and got[4] == 0


@pytest.mark.parametrize("impl", IMPLS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("per_row_baseline", [False, True])
def test_adjusted_cosine_matches_formula(impl, per_row_baseline):
    gen, ref, base = data()
    if per_row_baseline:
        base = base.expand(gen.shape[0], -1).clone()
        base[6] = 0  # a zero baseline subtracts nothing
    b64 = base.double() if per_row_baseline else base.double()[None]
    want = (
        4
        * (
            F.cosine_similarity(gen.double(), ref.double(), dim=-1)
            - F.cosine_similarity(gen.double(), b64, dim=-1)
        )
    ).clamp(0, 1)
    dev = DEV if impl is cosine_triton else "cpu"
    got = impl(gen.to(dev), ref.to(dev), base.to(dev), scale=4.0, clip=True)
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=4e-6)
    assert ((got >= 0) & (got <= 1)).all()
    assert want[1] == 1 or want[1] > 0.99  # a copy of the reference scores (near) full marks


def test_public_functions_and_bf16():
    gen, ref, base = data()
    torch.testing.assert_close(cosine(gen, ref), F.cosine_similarity(gen, ref, dim=-1), rtol=0, atol=1e-6)
    one_ref = cosine(gen, ref[0])  # a single reference vector broadcast over rows
    torch.testing.assert_close(one_ref, F.cosine_similarity(gen, ref[:1], dim=-1), rtol=0, atol=1e-6)
    adj = adjusted_cosine(gen.bfloat16(), ref.bfloat16(), base.bfloat16(), c=4.0)
    assert adj.dtype == torch.float32 and ((adj >= 0) & (adj <= 1)).all()
    with pytest.raises(ValueError, match="does not match"):
        cosine(gen, ref[:, :5])
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        cosine(gen[0], ref[0])
