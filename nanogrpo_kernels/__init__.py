"""Triton kernels, each beside its PyTorch reference, and the switch between them.

Backend (resolved once, on first use): `set_backend(name)` or the environment variable
NANOGRPO_KERNELS, one of
- 'auto'   (default): CUDA tensors go to the Triton kernels when Triton imports, everything else to the
           PyTorch reference;
- 'torch': always the PyTorch reference;
- 'triton': always the kernels. CPU tensors then run in Triton's interpreter (slow: tests and debugging).

Triton has no CPU back end: on a machine without CUDA the kernels can only run in Triton's interpreter,
so importing this package there sets TRITON_INTERPRET=1 (unless already set, or triton was imported
first) before triton is imported. Under the interpreter every kernel is interpreted, CUDA tensors
included; the tests use it to check the kernels on the CPU.

Triton is optional (the `dev` extra; the GPU wheels ship it): without it the references run and the
kernel definitions stay inert.
"""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # a CPU-only install: the PyTorch references do all the work

    class _NoTriton:
        """Stands in for `triton` and `triton.language` so the kernel files import without Triton."""

        constexpr = int

        @staticmethod
        def jit(fn=None, **kwargs):
            return None if fn is not None else (lambda f: None)

    triton = tl = _NoTriton()
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch")
_backend: str | None = None


def set_backend(name: str) -> None:
    """Choose the kernel backend for this process: 'auto', 'triton' or 'torch'."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}: use one of {', '.join(BACKENDS)}")
    if name == "triton" and not HAS_TRITON:
        raise ValueError("kernel backend 'triton' needs the triton package: pip install triton")
    _backend = name


def get_backend() -> str:
    """The backend in force; the first call reads NANOGRPO_KERNELS (default 'auto')."""
    if _backend is None:
        name = os.environ.get("NANOGRPO_KERNELS", "auto").strip().lower() or "auto"
        if name not in BACKENDS:
            raise ValueError(f"NANOGRPO_KERNELS={name!r}: use one of {', '.join(BACKENDS)}")
        set_backend(name)
    return _backend


def interpreting() -> bool:
    """Whether the Triton kernels run in the interpreter (then bf16 dots are computed in float32)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when these tensors should go to a Triton kernel under the current backend."""
    backend = get_backend()
    if backend == "torch" or not HAS_TRITON:
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "triton" and not on_cuda and not interpreting():
        raise ValueError(
            "kernel backend 'triton' got CPU tensors but Triton is compiling for the GPU: set "
            "TRITON_INTERPRET=1 before anything imports triton, or use backend 'torch' for CPU tensors"
        )
    return backend == "triton" or on_cuda
