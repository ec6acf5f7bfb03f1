"""Batched longest-common-subsequence lengths over token ids (ROUGE-L, keyword chains).

`lcs_lengths(a, b)` takes a batch of sequence pairs, as lists of int lists or as padded integer tensors
with lengths, and returns the LCS length of each pair. It is the one function the graders call.

- CPU (`lcs_rapidfuzz`, the reference): rapidfuzz's LCSseq, a bit-parallel LCS in C++ that accepts any
  hashable items, run over the batch with `process.cpdist` on all cores.
- GPU (`_lcs_fwd_kernel`): one program per pair keeps one DP row L[i, :] in registers and walks the
  shorter side. The textbook recurrence
      L[i, j] = L[i-1, j-1] + 1 if a_i == b_j else max(L[i-1, j], L[i, j-1])
  is, row by row, an elementwise step and a prefix max: with X[j] = L[i-1, j-1] + 1 where a_i == b_j
  and L[i-1, j] elsewhere (a match never loses, as L[i-1, j] <= L[i-1, j-1] + 1), L[i, :] = cummax(X).
  So each of the len(a) sequential steps is data-parallel over b: O(len(a)) depth, O(len(b)) registers,
  no DP table in memory. The diagonal L[i-1, j-1] is the previous row shifted by one; a scan of pairs
  gives it with the row (a row is non-decreasing, so its shift is the max of the entries before each),
  which needs no `tl.gather` (a gather across warps stages the row through shared memory, 4 bytes an
  id; Triton 3.6 has `tl.gather`, older versions do not). Bit-parallel LCS (what rapidfuzz does on the CPU) needs carries across 64-bit
  words and a per-symbol match table; the row form is simpler and keeps the kernel short.
- GPU, b longer than `LCS_MAX_BLOCK` ids (`_lcs_tiled_kernel`): the row lives in global memory, two
  copies per pair (read row i, write row i + 1), walked in tiles with the prefix max carried from tile
  to tile; any length, at one block barrier per step of a.
"""

import numpy as np
import torch

from nanogrpo_kernels import get_backend, interpreting, tl, triton, use_triton

Seqs = list[list[int]]


def lcs_rapidfuzz(a: Seqs, b: Seqs, workers: int = -1) -> list[int]:
    """LCS length of each pair (a[k], b[k]) with rapidfuzz; workers=-1 uses every core."""
    if len(a) != len(b):
        raise ValueError(f"lcs_lengths needs as many sequences in a as in b (got {len(a)} and {len(b)})")
    if not a:
        return []
    from rapidfuzz import process  # imported here: GPU-only environments may lack it
    from rapidfuzz.distance import LCSseq

    # cpdist scores pairs element-wise (cdist would score every a against every b)
    return process.cpdist(a, b, scorer=LCSseq.similarity, workers=workers, dtype=np.int32).tolist()


@triton.jit
def _max_combine(x, y):
    return tl.maximum(x, y)


@triton.jit
def _max_shift_combine(m1, e1, m2, e2):
    # (M, E) of a run of elements: its max, and its max without its last element. Scanned, E at j is the
    # max of x[:j] (0 at j = 0), which for a prefix max row is the row shifted right by one.
    return tl.maximum(m1, m2), tl.maximum(m1, e2)


@triton.jit
def _lcs_fwd_kernel(
    a_ptr, a_len_ptr, b_ptr, b_len_ptr, out_ptr,  # a (P, La), b (P, Lb) padded ids; lengths (P,); out (P,)
    stride_a, stride_b,
    BLOCK_B: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    len_a = tl.load(a_len_ptr + pair)
    len_b = tl.load(b_len_ptr + pair)
    offs = tl.arange(0, BLOCK_B)
    valid = offs < len_b
    b = tl.load(b_ptr + pair * stride_b + offs, mask=valid, other=0)  # (BLOCK_B,)
    # row[j] = L[i, j + 1]: LCS of a[:i] and b[:j + 1]; diag[j] = L[i, j] (L[i, 0] = 0). The shift comes
    # out of the same scan as the row (no gather: it would stage the row through shared memory).
    row = tl.zeros([BLOCK_B], dtype=tl.int32)
    diag = tl.zeros([BLOCK_B], dtype=tl.int32)
    zero = tl.zeros([BLOCK_B], dtype=tl.int32)
    for i in range(0, len_a):
        a_i = tl.load(a_ptr + pair * stride_a + i)
        x = tl.where(valid & (b == a_i), diag + 1, row)  # L[i-1, j-1] + 1 where a_i == b_j
        row, diag = tl.associative_scan((x, zero), 0, _max_shift_combine)  # prefix max along b, and shifted
    tl.store(out_ptr + pair, tl.max(row, axis=0))


@triton.jit
def _lcs_tiled_kernel(
    a_ptr, a_len_ptr, b_ptr, b_len_ptr, rows_ptr, out_ptr,  # a, b, lengths, out as above; rows (P, 2, W)
    stride_a, stride_b, stride_rows, width,
    BLOCK_B: tl.constexpr,
):  # fmt: skip
    """Long b: the DP row lives in global memory (two copies of W >= Lb ints per pair: step i reads L[i, :]
    from one and writes L[i + 1, :] to the other), walked in BLOCK_B tiles; the prefix max carries over
    from tile to tile. Rows must start zeroed (L[0, :] = 0)."""
    pair = tl.program_id(0).to(tl.int64)
    len_a = tl.load(a_len_ptr + pair)
    len_b = tl.load(b_len_ptr + pair)
    offs = tl.arange(0, BLOCK_B)
    base = rows_ptr + pair * stride_rows
    for i in range(0, len_a):
        a_i = tl.load(a_ptr + pair * stride_a + i)
        src = base + (i % 2) * width  # src[j] = L[i, j + 1]
        dst = base + ((i + 1) % 2) * width
        carry = tl.full([], 0, dtype=tl.int32)  # L[i + 1, j0]: the new row's max left of this tile
        for j0 in range(0, len_b, BLOCK_B):
            offs_j = j0 + offs
            valid = offs_j < len_b
            b = tl.load(b_ptr + pair * stride_b + offs_j, mask=valid, other=0)  # (BLOCK_B,)
            # .cg: straight from L2, never a stale L1 line (other threads wrote this row)
            old = tl.load(src + offs_j, mask=valid, other=0, cache_modifier=".cg")  # L[i, j + 1]
            diag = tl.load(src + offs_j - 1, mask=valid & (offs_j > 0), other=0, cache_modifier=".cg")
            x = tl.where(valid & (b == a_i), diag + 1, old)
            new = tl.maximum(tl.associative_scan(x, 0, _max_combine), carry)  # (BLOCK_B,) L[i + 1, j + 1]
            tl.store(dst + offs_j, new, mask=valid)
            carry = tl.max(new, axis=0)
        # the next step reads this row shifted by one, and writes over the one just read: all threads
        # must be done with both
        tl.debug_barrier()
    last = base + (len_a % 2) * width + len_b - 1  # L[len_a, len_b]
    tl.store(out_ptr + pair, tl.load(last, mask=len_b > 0, other=0, cache_modifier=".cg"))


# b of up to LCS_MAX_BLOCK ids keeps its DP row in registers: 8 ids a thread at 16 warps, ~85 registers
# (16 ids a thread, at 8192, spill on sm_80-90). Longer b goes to the tiled kernel, LCS_TILE ids at a time
# through a scratch row in global memory, pairs in batches whose scratch stays under LCS_SCRATCH_BYTES.
# bench/kernels_aot.py checks every block size for spills.
LCS_MAX_BLOCK = 4096
LCS_TILE = 4096
LCS_SCRATCH_BYTES = 1 << 28


def lcs_launch_config(length: int, max_block: int = LCS_MAX_BLOCK) -> dict:
    """Kernel ('rows' or 'tiled'), BLOCK_B and num_warps for a padded b of `length` ids on the GPU."""
    block = max(16, triton.next_power_of_2(max(length, 1)))
    kernel = "rows" if block <= max_block else "tiled"
    if kernel == "tiled":
        block = min(LCS_TILE, max_block)
    return dict(kernel=kernel, BLOCK_B=block, num_warps=max(1, min(16, block // 256)))


def lcs_triton(
    a: torch.Tensor, a_len: torch.Tensor, b: torch.Tensor, b_len: torch.Tensor, max_block: int = LCS_MAX_BLOCK
) -> torch.Tensor:
    """LCS lengths [P] (int32) of padded id tensors a [P, La], b [P, Lb] with lengths [P], on a's device.
    max_block: the longest b kept in registers (tests lower it to run the tiled kernel on small inputs)."""
    if a.shape[1] > b.shape[1]:  # LCS is symmetric: walk the shorter side, keep the longer in registers
        a, a_len, b, b_len = b, b_len, a, a_len
    n_pairs = a.shape[0]
    out = torch.zeros(n_pairs, dtype=torch.int32, device=a.device)
    if n_pairs == 0:
        return out
    a, b = a.to(torch.int32).contiguous(), b.to(torch.int32).contiguous()
    a_len, b_len = a_len.to(a.device, torch.int32), b_len.to(a.device, torch.int32)
    cfg = lcs_launch_config(b.shape[1], max_block)
    warps = 1 if interpreting() else cfg["num_warps"]
    if cfg["kernel"] == "rows":
        _lcs_fwd_kernel[(n_pairs,)](
            a, a_len, b, b_len, out, a.stride(0), b.stride(0), BLOCK_B=cfg["BLOCK_B"], num_warps=warps
        )
        return out
    width = b.shape[1]
    batch = max(1, LCS_SCRATCH_BYTES // (2 * width * 4))
    for s in range(0, n_pairs, batch):
        e = min(n_pairs, s + batch)
        rows = torch.zeros(e - s, 2, width, dtype=torch.int32, device=a.device)  # (P', 2, W) DP rows
        _lcs_tiled_kernel[(e - s,)](
            a[s:e], a_len[s:e], b[s:e], b_len[s:e], rows, out[s:e], a.stride(0), b.stride(0),
            rows.stride(0), width, BLOCK_B=cfg["BLOCK_B"], num_warps=warps,
        )  # fmt: skip
    return out


def _pad(seqs: Seqs, device) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int32)  # (P,)
    ids = torch.zeros(len(seqs), max([1] + [len(s) for s in seqs]), dtype=torch.int32)  # (P, L)
    for k, s in enumerate(seqs):
        ids[k, : len(s)] = torch.as_tensor(s, dtype=torch.int32)
    return ids.to(device), lengths.to(device)


def _unpad(ids: torch.Tensor, lengths: torch.Tensor | None) -> Seqs:
    rows = ids.tolist()
    return rows if lengths is None else [r[:n] for r, n in zip(rows, lengths.tolist())]


def lcs_lengths(
    a: Seqs | torch.Tensor,
    b: Seqs | torch.Tensor,
    a_lengths: torch.Tensor | None = None,
    b_lengths: torch.Tensor | None = None,
) -> list[int] | torch.Tensor:
    """LCS length of each pair (a[k], b[k]).

    Lists of int lists give a list of ints; padded id tensors [P, L] (with `a_lengths`/`b_lengths` [P], or
    full rows without) give a long tensor [P] on their device. CUDA tensors run the Triton kernel, the
    rest rapidfuzz; with the backend forced to 'triton', lists and CPU tensors run the kernel too.
    """
    if len(a) != len(b):
        raise ValueError(f"lcs_lengths needs as many sequences in a as in b (got {len(a)} and {len(b)})")
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        raise ValueError("lcs_lengths takes two lists of id lists or two padded id tensors, not one of each")
    if isinstance(a, torch.Tensor):
        full = lambda x: torch.full((x.shape[0],), x.shape[1], dtype=torch.int32, device=x.device)
        a_len = full(a) if a_lengths is None else a_lengths
        b_len = full(b) if b_lengths is None else b_lengths
        if use_triton(a, b):
            return lcs_triton(a, a_len, b, b_len.to(a.device)).long()
        out = lcs_rapidfuzz(_unpad(a, a_lengths), _unpad(b, b_lengths))
        return torch.tensor(out, dtype=torch.long, device=a.device)
    if get_backend() == "triton":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        (pa, la), (pb, lb) = _pad(a, device), _pad(b, device)
        return lcs_triton(pa, la, pb, lb).tolist()
    return lcs_rapidfuzz(a, b)
