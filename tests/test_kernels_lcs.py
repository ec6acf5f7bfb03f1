"""nanogrpo_kernels.lcs: rapidfuzz (CPU) and the Triton row-DP kernel against a plain dynamic programme.

Without CUDA, importing `nanogrpo_kernels` turns on Triton's interpreter, so the kernel runs here on the CPU.
"""

import random

import pytest
import torch

import nanogrpo_kernels
from nanogrpo_kernels import lcs as lcs_mod
from nanogrpo_kernels.lcs import lcs_lengths, lcs_rapidfuzz, lcs_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_HERE = nanogrpo_kernels.HAS_TRITON and (DEV == "cuda" or nanogrpo_kernels.interpreting())
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason="Triton kernels cannot run in this process")


def lcs_dp(a: list[int], b: list[int]) -> int:
    """The textbook O(len(a) * len(b)) table."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def cases() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(0)
    named = [
        ([], []),  # both empty
        ([], [1, 2]),  # one empty
        ([3, 1, 4], []),
        ([1, 2, 3, 4], [1, 2, 3, 4]),  # identical
        ([1, 2, 3], [4, 5, 6]),  # disjoint
        ([7, 7, 7, 7, 7], [7, 7]),  # repeated token
        ([1, 2, 1, 2, 1, 2], [2, 1, 2, 1]),  # repeats in both
        ([1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1]),  # reversed: 1
        ([0, 0, 5], [5, 0, 0]),  # the padding id is a real token too
        ([151935, 2**31 - 1, 9], [9, 151935, 2**31 - 1]),  # large ids
    ]
    rand = [
        (
            [rng.randint(0, 4) for _ in range(rng.randint(0, 40))],
            [rng.randint(0, 4) for _ in range(rng.randint(0, 40))],
        )
        for _ in range(12)
    ]
    a, b = zip(*(named + rand))
    return list(a), list(b)


def test_rapidfuzz_matches_dp():
    a, b = cases()
    assert lcs_rapidfuzz(a, b) == [lcs_dp(x, y) for x, y in zip(a, b)]
    assert lcs_rapidfuzz([], []) == []


@needs_triton
def test_triton_kernel_matches_dp_and_rapidfuzz():
    a, b = cases()
    want = [lcs_dp(x, y) for x, y in zip(a, b)]
    old = nanogrpo_kernels._backend
    nanogrpo_kernels.set_backend("triton")
    try:
        got = lcs_lengths(a, b)  # lists padded to tensors, the kernel, back to a list
    finally:
        nanogrpo_kernels._backend = old
    assert got == want == lcs_rapidfuzz(a, b)


@needs_triton
def test_triton_padded_tensors_with_garbage_padding():
    """Padding must not count, whatever value it holds, and either side may be the longer one."""
    a = [[1, 2, 3, 9], [5], [], [4, 4, 4]]
    b = [[9, 1, 3], [5, 5, 5, 5, 5, 5], [1], [4]]
    pa = torch.full((4, 6), 5, dtype=torch.long)  # pad with a token that occurs in b
    pb = torch.full((4, 8), 4, dtype=torch.long)
    for k in range(4):
        pa[k, : len(a[k])] = torch.tensor(a[k], dtype=torch.long)
        pb[k, : len(b[k])] = torch.tensor(b[k], dtype=torch.long)
    la = torch.tensor([len(x) for x in a])
    lb = torch.tensor([len(x) for x in b])
    want = [lcs_dp(x, y) for x, y in zip(a, b)]
    assert lcs_triton(pa.to(DEV), la.to(DEV), pb.to(DEV), lb.to(DEV)).tolist() == want
    assert lcs_triton(pb.to(DEV), lb.to(DEV), pa.to(DEV), la.to(DEV)).tolist() == want
    # the public function on CPU tensors goes to rapidfuzz (auto backend) and returns a tensor
    got = lcs_lengths(pa, pb, la, lb)
    assert isinstance(got, torch.Tensor) and got.tolist() == want


@needs_triton
def test_tiled_kernel_matches_dp():
    """b longer than the register row walks a DP row in global memory, tile by tile: forced here with
    16-id tiles, so that rows of up to 40 ids span three tiles (and prefix maxima cross tile edges)."""
    a, b = cases()
    want = [lcs_dp(x, y) for x, y in zip(a, b)]
    (pa, la), (pb, lb) = lcs_mod._pad(a, DEV), lcs_mod._pad(b, DEV)
    assert lcs_triton(pa, la, pb, lb, max_block=16).tolist() == want


def test_long_inputs_go_to_the_tiled_kernel():
    config, longest, tile = lcs_mod.lcs_launch_config, lcs_mod.LCS_MAX_BLOCK, lcs_mod.LCS_TILE
    assert config(100)["kernel"] == "rows" and config(longest)["kernel"] == "rows"
    assert config(longest + 1)["kernel"] == "tiled" and config(longest + 1)["BLOCK_B"] == tile
    assert config(1 << 20)["BLOCK_B"] == tile  # any length, the same tile


def test_full_rows_without_lengths_and_errors():
    a = torch.tensor([[1, 2, 3], [3, 2, 1]])
    b = torch.tensor([[1, 3], [1, 2]])
    assert lcs_lengths(a, b).tolist() == [2, 1]
    with pytest.raises(ValueError, match="as many"):
        lcs_lengths([[1]], [[1], [2]])
    with pytest.raises(ValueError, match="not one of each"):
        lcs_lengths(a, [[1], [2]])
