"""Sampling weights for the CPU: every linear layer's weight with its LoRA update folded in, packed once per
call to `generate`, q|k|v and gate|up fused. bf16 weights are packed into oneDNN's blocked layout; float32
weights into MKL's packed sgemm layout on Intel CPUs and into oneDNN's on the others (`cpu.py` says why;
NANOGRPO_PACKED_FP32=mkl|onednn picks one).

Why: on a CPU, a decode step is a few dozen small matmuls (M = the batch) per layer. A plain `F.linear`
re-lays out the weight on every call; a pre-packed weight skips that (docs/BENCHMARKS.md, "Numbers behind
the CPU paths", has the gains per dtype and CPU), folding the LoRA update
into the temporary copy removes the two low-rank matmuls per projection, and fusing the projections that
read the same input saves a few percent more. The packed modules are swapped in for the model's own and
put back on the way out; the copies, the LM head's included, live only for the duration of the `with`
block; the trained weights are untouched, so the sampler's model is the trained model up to the rounding of
W + BA in the weights' dtype.

Memory: glibc keeps freed memory in its heaps, and the packed copies of one call and the training pass's
activations around it do not fit into each other's holes, so a GRPO step peaked well above its live
memory when the LM head's packed copy was kept across steps. So the block packs the head at every call, and hands
glibc's free pages back to the system as it opens (the training pass's) and as it closes (the sampler's):
the step then peaks where the unpacked one does, for the page faults of everything the next pass touches
again. A process that keeps its freed memory (heap.keep_freed_memory, as a CPU run does from its start-up) trades
the other way: no trims, a slightly higher peak, a shorter step.

oneDNN's packed weight serves any number of rows. MKL's packed float32 weight serves one row count:
a call with fewer rows, but more than half, is padded up to it (at those sizes no slower than the plain
sgemm); any other call (the prefill's P x L rows) runs the original modules; when the sampler drops
ended rows and the batch falls to half the packed size or less, `Packed.shrunk` packs again for it if
enough decode steps are left to repay the packing.

The GPU path does not use this: there the copy would cost as much memory as the model, and cuBLAS needs
no packing. `packed_weights(model)` is a no-op unless the model's weights are bf16 on a CPU where oneDNN's
bf16 path runs, or float32 on a CPU where oneDNN's or MKL's float32 packing runs: `nanogrpo.infra.cpu` tries
each once per process, because the CPU flags do not tell (on an AVX2-only CPU oneDNN's bf16 reorder
raises; a build of torch without MKL, as on ARM, has no packed sgemm), and elsewhere the model samples on
its plain weights.
NANOGRPO_PACKED=0 turns packing off.

`folded_lora(model)` is the fold without the packing, for every other case (a GPU, NANOGRPO_PACKED=0, a
CPU that packs nothing): each enabled LoRA layer is swapped for a plain linear layer whose weight is
W + (alpha / r) B A in W's dtype, so a projection is one matmul instead of the adapter's three plus the add
and scale. It costs one copy of the adapted weights in their dtype (on a GPU, 2 bytes a parameter of every
adapted projection in bf16) for the duration of the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogrpo.infra.cpu import cpu_capability, packing_supported
from nanogrpo.infra.heap import release_free_heap
from nanogrpo.model.lora import LoraLinear

# The packed matmuls as opaque custom ops for torch.compile (--sampling.decode compiled): inductor cannot lower oneDNN's
# or MKL's packed weights itself, so a compiled decode step calls these as it calls any matmul; eager calls
# the ATen ops directly. Defined with torch.library.Library, not the custom_op decorator, whose Python
# wrapper costs more per call (docs/BENCHMARKS.md, "The decode step as a CUDA graph").
_LIB = torch.library.Library("nanogrpo", "DEF")
_LIB.define("onednn_linear(Tensor x, Tensor packed, Tensor? bias, int out) -> Tensor")
_LIB.define("mkl_linear(Tensor x, Tensor packed, Tensor w, Tensor? bias, int rows) -> Tensor")


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out: int
) -> torch.Tensor:
    """(n, in) @ a oneDNN-packed (out, in) weight + bias -> (n, out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _mkl_linear(x, packed, w, bias, rows: int) -> torch.Tensor:
    """(rows, in) @ an MKL-packed (out, in) weight (`w`: its shape) + bias -> (rows, out)."""
    return torch.ops.mkl._mkl_linear(x, packed, w, bias, rows)


_LIB.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")
_LIB.impl("mkl_linear", _mkl_linear, "CompositeExplicitAutograd")
torch.library.register_fake(
    "nanogrpo::onednn_linear", lambda x, packed, bias, out: x.new_empty(x.shape[0], out)
)
torch.library.register_fake(
    "nanogrpo::mkl_linear", lambda x, packed, w, bias, rows: x.new_empty(rows, w.shape[0])
)
onednn_linear = torch.ops.nanogrpo.onednn_linear.default
mkl_linear = torch.ops.nanogrpo.mkl_linear.default


class PackedLinear(nn.Module):
    """y = x @ W^T + b with a bf16 or float32 W pre-packed for oneDNN; `batch_hint` is the expected number of
    rows (any number works).

    A module without parameters (the packed copy is a plain attribute): swapped in for a projection while
    the sampler runs, it adds nothing to the state dict or the optimizer."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int):
        super().__init__()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)
        self.packed_bias = None if bias is None else bias.to(weight.dtype)

    def shrunk(self, rows: int, steps_left: int) -> None:
        """Nothing to do: oneDNN's packed weight serves any number of rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # (..., in)
        x2 = x.reshape(-1, shape[-1])  # (n, in)
        if torch.compiler.is_compiling():
            y = onednn_linear(x2, self.packed, self.packed_bias, self.out_features)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.packed_bias, "none", [], "")
        return y.view(*shape[:-1], self.out_features)  # (..., out)


# Packing again for a smaller batch pays only when enough decode steps are left to repay the packing
# (on SmolLM2 in float32, about 8: docs/BENCHMARKS.md)
REPACK_MIN_STEPS = 8


class MklPackedLinear(nn.Module):
    """y = x @ W^T + b with a float32 W pre-packed by MKL's packed sgemm for exactly `rows` rows.

    `weight_of()` gives the weight to pack (W, or W + BA, q|k|v concatenated) and is called again when the
    batch shrinks; `plain(x)` is the unpacked computation (the original modules), run for row counts the
    packed copy does not serve. Only the packed copy is kept, not the folded weight it came from."""

    def __init__(
        self,
        weight_of: Callable[[], torch.Tensor],
        bias: torch.Tensor | None,
        rows: int,
        plain: Callable[[torch.Tensor], torch.Tensor],
    ):
        super().__init__()
        self.weight_of, self.plain, self.bias = weight_of, plain, bias
        self.rows = 0
        self.rebatch(rows)

    def rebatch(self, rows: int) -> None:
        """Pack the weight for `rows` rows (nothing to do if it already is)."""
        if rows == self.rows:
            return
        self.packed = None  # free the old copy before the new one is made
        w = self.weight_of().contiguous()  # (out, in)
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
        # _mkl_linear wants the unpacked weight too, which it reads only when the rows differ from the
        # packed count; forward never calls it then, so a stand-in of the right shape and no data is enough
        self.shape_of_w = w.new_empty(1).expand_as(w)
        self.out_features, self.rows = w.shape[0], rows

    def shrunk(self, rows: int, steps_left: int) -> None:
        """The batch is down to `rows` for at most `steps_left` more decode steps: pack again when padding
        up to the packed count would waste more than half of it (a single row is a matrix-vector product
        either way) and enough steps are left to repay the packing (REPACK_MIN_STEPS)."""
        if 2 <= rows and 2 * rows <= self.rows and steps_left >= REPACK_MIN_STEPS:
            self.rebatch(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # (..., in)
        x2 = x.reshape(-1, shape[-1])  # (n, in)
        n = x2.shape[0]
        if not self.rows < 2 * n <= 2 * self.rows:
            return self.plain(x)  # (..., out) the prefill's P x L rows, or half the packed count or less
        if n < self.rows:
            x2 = F.pad(x2, (0, 0, 0, self.rows - n))  # (rows, in) zero rows, dropped below
        if torch.compiler.is_compiling():
            y = mkl_linear(x2, self.packed, self.shape_of_w, self.bias, self.rows)  # (rows, out)
        else:
            y = torch.ops.mkl._mkl_linear(x2, self.packed, self.shape_of_w, self.bias, self.rows)
        return y[:n].view(*shape[:-1], self.out_features)  # (..., out)


def folds_adapter(m: nn.Module) -> bool:
    """The layer's weight now is W + (alpha / r) B A: an enabled LoRA adapter, not merged into W."""
    return isinstance(m, LoraLinear) and m.enabled and not m.merged


def effective_weight(m: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight the layer applies now: W, or W + (alpha / r) B A for an enabled, unmerged adapter; written
    into `out` (float32, W's shape) when given."""
    if folds_adapter(m):
        return m.merged_weight(out=out)
    w = m.base_layer.weight if isinstance(m, LoraLinear) else m.weight
    return w if out is None else out.copy_(w)


class Scratch:
    """One float32 buffer that every float32 projection's effective weight is written into before MKL packs
    it: no temporary copy per projection (W + BA, then q|k|v concatenated), only the packed copies are
    allocated: a temporary per projection raised the step's peak."""

    def __init__(self):
        self.buf = torch.empty(0)

    def stacked(self, mods: list[nn.Module]) -> torch.Tensor:
        """The effective weights of `mods` stacked (sum of outs, in), in the buffer; a lone projection
        without an active adapter is its own weight (no copy)."""
        if len(mods) == 1 and not folds_adapter(mods[0]):
            return effective_weight(mods[0])
        rows, cols = sum(m.out_features for m in mods), mods[0].in_features
        if self.buf.numel() < rows * cols:
            self.buf = torch.empty(rows * cols)
        out = self.buf[: rows * cols].view(rows, cols)  # (sum of outs, in)
        i = 0
        for m in mods:
            effective_weight(m, out=out[i : i + m.out_features])
            i += m.out_features
        return out


def _fused(
    mods: list[nn.Module], dtype: torch.dtype, batch_hint: int, scratch: Scratch | None = None
) -> PackedLinear | MklPackedLinear:
    """One packed matmul for the projections in `mods` that read the same input (q|k|v, gate|up), or for a
    lone projection: oneDNN's packing for bf16, MKL's for float32 (then the original modules serve the row
    counts the packed copy does not)."""
    biases = [m.bias for m in mods]
    bias = None
    if any(b is not None for b in biases):
        like = next(b for b in biases if b is not None)
        bias = torch.cat([like.new_zeros(m.out_features) if b is None else b for m, b in zip(mods, biases)])
    if dtype == torch.bfloat16:
        weights = [effective_weight(m) for m in mods]
        return PackedLinear(torch.cat(weights) if len(mods) > 1 else weights[0], bias, batch_hint)
    scratch = scratch or Scratch()
    if cpu_capability().fp32_packing == "onednn":  # oneDNN copies the folded weight out of the buffer
        return PackedLinear(scratch.stacked(mods), bias, batch_hint)
    plain = mods[0] if len(mods) == 1 else (lambda x: torch.cat([m(x) for m in mods], -1))
    return MklPackedLinear(
        lambda: scratch.stacked(mods), None if bias is None else bias.float(), batch_hint, plain
    )


def _packed_head(head: torch.Tensor, batch_hint: int) -> PackedLinear | MklPackedLinear:
    """The LM head, packed for this call. Not kept across calls even when frozen (as under LoRA): the kept
    copy (113 MB for SmolLM2 in float32) stayed live through the training pass and raised its peak."""
    if head.dtype == torch.bfloat16 or cpu_capability().fp32_packing == "onednn":
        return PackedLinear(head, None, batch_hint)
    return MklPackedLinear(lambda: head, None, batch_hint, lambda h: h @ head.T)


@dataclass
class Packed:
    """What `packed_weights` swapped in: the LM head's packed copy and the layers' packed projections (None
    and empty once the block has closed: the caller may still hold this, the copies are freed anyway)."""

    head: PackedLinear | MklPackedLinear | None
    projections: list[PackedLinear | MklPackedLinear]

    def shrunk(self, rows: int, steps_left: int) -> None:
        """The sampler dropped ended rows and decodes `rows` for at most `steps_left` more steps (MKL's
        float32 copies may pack again for it; oneDNN's serve any count)."""
        for m in [self.head, *self.projections]:
            m.shrunk(rows, steps_left)

    def drop(self) -> None:
        """Free the copies."""
        self.head = None
        self.projections.clear()


class FoldedLinear(nn.Module):
    """y = x @ W^T + b with W = W + (alpha / r) B A of a LoRA layer, computed once (no parameters: the
    weight is a plain attribute, swapped in while the sampler runs)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # (..., out) as nn.Linear, autocast included


@contextlib.contextmanager
def folded_lora(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Inside the block every enabled, unmerged LoRA layer is a FoldedLinear of its effective weight (in
    W's dtype); on the way out the LoRA layers are put back, their weights untouched. Yields how many
    layers were folded (0 when `enabled` is False or the model has no active adapter)."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, name, original)
    try:
        if enabled:
            with torch.no_grad():
                for name, m in list(model.named_modules()):
                    if folds_adapter(m):
                        parent_name, _, child = name.rpartition(".")
                        parent = model.get_submodule(parent_name) if parent_name else model
                        swapped.append((parent, child, m))
                        setattr(parent, child, FoldedLinear(m.merged_weight(), m.bias))
        yield len(swapped)
    finally:
        for parent, name, original in reversed(swapped):
            setattr(parent, name, original)


@contextlib.contextmanager
def packed_weights(model: nn.Module, batch_hint: int) -> Iterator[Packed | None]:
    """Inside the block the model's projections are swapped for packed copies of their effective weights
    (o_proj and down_proj one each; q|k|v and gate|up fused into one, in the layers' `packed_qkv` /
    `packed_gate_up` slots); on the way out the original modules are put back. Yields what was packed,
    the LM head included (None when packing does not apply: then nothing changes).
    """
    head = model.lm_head_weight
    if not packing_supported(head):
        yield None
        return
    swapped: list[tuple[nn.Module, str, nn.Module | None]] = []  # (parent, name, original)

    def swap(parent: nn.Module, name: str, new: nn.Module) -> None:
        swapped.append((parent, name, getattr(parent, name)))
        setattr(parent, name, new)

    packed, scratch = None, Scratch()
    release_free_heap()  # the training pass's freed memory: the packed copies are made in fresh pages
    try:
        with torch.no_grad():
            for layer in model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                fused = lambda mods: _fused(mods, head.dtype, batch_hint, scratch)  # noqa: E731
                swap(attn, "packed_qkv", fused([attn.q_proj, attn.k_proj, attn.v_proj]))
                swap(mlp, "packed_gate_up", fused([mlp.gate_proj, mlp.up_proj]))
                for parent, name in ((attn, "o_proj"), (mlp, "down_proj")):
                    swap(parent, name, fused([getattr(parent, name)]))
            projections = [getattr(parent, name) for parent, name, _ in swapped]
            packed = Packed(_packed_head(head, batch_hint), projections)
        yield packed
    finally:
        for parent, name, original in reversed(swapped):
            setattr(parent, name, original)
        if packed is not None:
            packed.drop()  # the caller may still hold `packed`: free the copies now
        swapped.clear()
        scratch = None  # and the buffer the weights were folded in
        release_free_heap()  # the copies' pages: the training pass starts from the live memory
