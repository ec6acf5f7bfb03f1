"""A stand-in accelerator for the CPU suite: a device named `standin` whose tensors hold CPU data but
refuse, as CUDA does, to be combined with CPU tensors.

    with standin_device() as dev:          # torch.device("standin:0")
        main(replace(cfg, model=replace(cfg.model, device="standin")))

Why: every CPU test runs with the model, the sampler and the data on one device, so a tensor left on the
CPU and then combined with the model's (`torch.cat` of prompt ids and completion ids, a loss against a
CPU mask, a generator of the wrong device) passes here and crashes on the first CUDA step. Under this
device the real training paths run unchanged, with real numbers, and any such mix raises the error CUDA
would raise ("Expected all tensors to be on the same device").

How: PyTorch's PrivateUse1 slot, renamed `standin` (once per process), with Python hooks; each standin
tensor is a wrapper subclass around a CPU tensor, and a dispatch mode runs every op on the CPU tensors
after checking the devices. What CUDA allows is allowed: 0-dim CPU tensors as scalars, copies between
devices (`.to`, `copy_`), CPU index tensors. `.numpy()` raises, as on CUDA (`.cpu()` first); `.tolist()`
and `.item()` work, as on CUDA. `torch.Generator(device="standin")` gives a CPU generator that reports
the standin device; the device of a generator handed to an op is not checked (an op sees a new Python
object for it), so `StandInGenerator.made` records the device of every generator made, for tests to check.

What it does not model: CUDA-only branches (`device.type == "cuda"`: Triton kernels, SDPA backends,
memory queries), which have their own tests; speed (every op pays a Python call: keep runs tiny).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

NAME = "standin"
_RealGenerator = torch.Generator
aten = torch.ops.aten
# ops that may take tensors of two devices on CUDA too: moves (the result goes where the op says, else stays)
# and copies (the destination keeps its device)
_MOVES = {aten._to_copy, aten.to, aten.lift_fresh}
_COPIES = {aten.copy_: 0, aten._copy_from: 1, aten._copy_from_and_resize: 1}  # -> the destination argument
# ops whose CPU index tensors CUDA accepts (advanced indexing moves them)
_INDEXING = {
    aten.index.Tensor,
    aten.index_put_.default,
    aten.index_put.default,
    aten._index_put_impl_.default,
}


class _Backend:
    """torch.standin: what PyTorch asks of a device module (seeding, autocast dtypes, availability)."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        pass

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]


def _register() -> None:
    """Once per process (PyTorch renames its PrivateUse1 slot only once): import this module in a process
    of its own, as tests/test_standin.py does, since an accelerator then reports as available."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(NAME, backend_module=_Backend())


_register()
DEVICE = torch.device(NAME, 0)


class StandIn(torch.Tensor):
    """A tensor on the standin device: `elem` holds its data on the CPU."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> StandIn:
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=DEVICE, requires_grad=elem.requires_grad,
        )  # fmt: skip
        r.elem = elem
        return r

    def __repr__(self) -> str:  # type: ignore[override]
        return f"StandIn({self.elem!r})"

    def tolist(self):  # CUDA tensors have it (a copy to the host)
        return self.elem.tolist()

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert standin:0 device type tensor to numpy. Use Tensor.cpu() first.")

    def __reduce_ex__(self, proto):  # torch.save: the data, as a CPU tensor
        return self.elem.__reduce_ex__(proto)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


class StandInGenerator(_RealGenerator):
    """`torch.Generator(device="standin")`: a CPU generator that reports the standin device."""

    made: list[torch.device] = []  # the device asked for, for each generator made under standin_device()

    def __new__(cls, device="cpu"):
        on = torch.device(device).type == NAME
        cls.made.append(torch.device(device))
        g = _RealGenerator.__new__(cls, "cpu" if on else device)
        g._standin = on
        return g

    def __init__(self, device="cpu"):
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return DEVICE if self._standin else _RealGenerator.device.__get__(self)


def _overload(name: str):
    base, _, over = name.partition(".")
    return getattr(getattr(aten, base), over or "default")


def _on_standin(x) -> bool:
    return isinstance(x, StandIn) or (isinstance(x, torch.device) and x.type == NAME)


def _run(func, args, kwargs):
    """One op: its standin tensors unwrapped to CPU, the devices checked as CUDA would, the result wrapped."""
    flat = []
    tree_map(flat.append, (args, kwargs))
    on = any(_on_standin(x) for x in flat) or any(
        isinstance(v, (str, torch.device)) and str(v).startswith(NAME)
        for k, v in kwargs.items()
        if k == "device"
    )
    packet = func.overloadpacket
    if on and packet not in _MOVES and packet not in _COPIES:
        cpu = [x for x in flat if type(x) is torch.Tensor and x.device.type == "cpu" and x.dim() > 0]
        if func in _INDEXING:  # the index list: CPU index tensors are fine, CPU values are not
            cpu = [x for x in cpu if x.dtype not in (torch.long, torch.int, torch.bool)]
        if cpu:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, standin:0 and "
                f"cpu! (when checking arguments for {func}: a CPU tensor of shape {tuple(cpu[0].shape)})"
            )
    wrappers = {}

    def unwrap(x):
        if isinstance(x, StandIn):
            wrappers[id(x.elem)] = x
            return x.elem
        if isinstance(x, torch.device) and x.type == NAME:
            return torch.device("cpu")
        if isinstance(x, str) and x.startswith(NAME):
            return "cpu"
        return x

    a, k = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    out = func(*a, **k)
    if packet in _COPIES:
        return args[_COPIES[packet]]
    if packet in _MOVES:
        dest = [x for x in (*args[1:], kwargs.get("device")) if isinstance(x, torch.device)]
        on = dest[0].type == NAME if dest else isinstance(args[0], StandIn)
        if not on and isinstance(args[0], StandIn) and out is args[0].elem:
            out = out.clone()  # to the host: a copy, never the device tensor's own memory
    if not on:
        return out

    def wrap(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, StandIn):
            mine = wrappers.get(id(x))  # an in-place op returns its own input
            return StandIn(x) if mine is None else mine
        return x

    return tree_map(wrap, out)


class _Mode(TorchDispatchMode):
    """Catches factory calls (`torch.zeros(..., device="standin")`) and every other op, for `_run`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _load_file(filename, device="cpu"):
    """safetensors' load_file, which knows no standin device: onto the CPU, then moved as a device read would."""
    out = _real_load_file(filename, device="cpu")
    if torch.device(device).type == NAME:
        out = {k: v.to(DEVICE) for k, v in out.items()}
    return out


@contextlib.contextmanager
def standin_device() -> Iterator[torch.device]:
    """Inside: every op goes through `_run`, `torch.Generator(device="standin")` works, and safetensors'
    load_file (wherever it was imported) can load onto the standin device."""
    import sys

    import safetensors.torch

    global _real_load_file
    _real_load_file = safetensors.torch.load_file
    users = [m for m in list(sys.modules.values()) if getattr(m, "load_file", None) is _real_load_file]
    torch.Generator = StandInGenerator  # type: ignore[misc]
    for m in users:
        m.load_file = _load_file
    try:
        with _Mode():
            yield DEVICE
    finally:
        torch.Generator = _RealGenerator  # type: ignore[misc]
        for m in users:
            m.load_file = _real_load_file


# ------------------------------------------------------------------------ kernels at the device's keys
# Ops that reach the device's own dispatch key, below Python's (the tensor constructors exclude Python
# dispatch: `torch.tensor(data, device=...)` allocates with empty_strided and copies into it).
_KERNELS = (
    "empty_strided",
    "empty.memory_format",
    "copy_",
    "_copy_from",
    "_copy_from_and_resize",
    "_to_copy",
)
# Autocast on the device, as CUDA's: the floating inputs of these ops cast (to the autocast dtype, or to
# float32), above autograd so the backward sees the casts; every other op passes through.
_LOWER = ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "einsum", "scaled_dot_product_attention")
_FP32 = ("exp", "log", "rsqrt", "softmax.int", "log_softmax.int", "logsumexp", "cumsum", "layer_norm")


def _autocast_kernel(name: str, lower: bool):
    op = _overload(name)

    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype(NAME) if lower else torch.float32
        cast = lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
        with torch._C._DisableAutocast():
            return op(*tree_map(cast, args), **tree_map(cast, kwargs))

    return kernel


_libs = [torch.library.Library("aten", "IMPL"), torch.library.Library("_", "IMPL")]
for _name in _KERNELS:
    _libs[0].impl(_name, lambda *args, _n=_name, **kwargs: _run(_overload(_n), args, kwargs), "PrivateUse1")
for _name in _LOWER + _FP32:
    _libs[0].impl(_name, _autocast_kernel(_name, _name in _LOWER), "AutocastPrivateUse1")
_libs[1].fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")


# ------------------------------------------------------------------------------ the training paths on it
def stage_configs(root) -> dict:
    """The runs tests/test_standin.py makes on the standin device: every stage and the paths that place or
    combine tensors differently (dynamic sampling, the KL reference, a full fine-tune, the final eval)."""
    from dataclasses import replace
    from pathlib import Path

    from nanogrpo.recipes.presets import PRESETS

    root = Path(root)
    t = PRESETS["tiny"][1]
    pairs = root / "pairs.jsonl"
    pairs.write_text(
        '{"prompt": "Capital of France?", "options": ["Paris", "Rome", "Madrid"], "answer": "Paris"}\n'
        '{"prompt": "The opposite of hot?", "chosen": "cold", "rejected": "warm and sunny"}\n'
    )
    text = root / "text.txt"
    text.write_text(" ".join(["the river runs past the old mill and the quiet town"] * 12))

    def cfg(name, dtype="float32", **kw):
        model = replace(t.model, device=NAME, dtype=dtype)
        # no plots: they read the run's files, not its tensors
        return replace(t, out_dir=str(root / name), steps=2, model=model, plots=False, **kw)

    return {
        "grpo": cfg("grpo", eval_prompts=3),  # + the final base-vs-trained eval on the demo task
        "grpo-dynamic": cfg(
            "grpo-dynamic", grpo=replace(t.grpo, dynamic_sampling=True, max_resample_rounds=2)
        ),
        "grpo-kl-reward": cfg("grpo-kl-reward", grpo=replace(t.grpo, kl_placement="reward", beta=0.1)),
        "grpo-full-kl-loss": cfg(  # float32 masters under bf16 autocast: the sampler samples under it too
            "grpo-full-kl-loss",
            dtype="bfloat16",
            lora=replace(t.lora, r=0),
            grpo=replace(t.grpo, kl_placement="loss", beta=0.1),
        ),
        "grpo-mu2-truncated": cfg(
            "grpo-mu2-truncated", grpo=replace(t.grpo, num_iterations=2, mask_truncated=True)
        ),
        "ppo": cfg("ppo", algo="ppo"),
        "dpo": cfg("dpo", algo="dpo", data=replace(t.data, train=str(pairs))),
        "sft": cfg("sft", algo="sft"),
        "cpt": cfg("cpt", algo="cpt", data=replace(t.data, train=str(text), seq_len=16, overlap=4)),
    }


def self_check() -> dict:
    """What the device itself must do, as CUDA does: {case: True when it behaved}."""
    cpu = torch.ones(3)
    out = {}
    with standin_device() as dev:
        x = torch.arange(3.0, device=dev)
        out["factory on the device"] = isinstance(x, StandIn) and x.device == dev
        out["a moved tensor"] = isinstance(cpu.to(dev), StandIn) and type(x.cpu()) is torch.Tensor
        out["0-dim CPU tensor as a scalar"] = isinstance(x * torch.tensor(2.0), StandIn)
        out["CPU index tensor"] = x[torch.tensor([0, 2])].tolist() == [0.0, 2.0]
        out["host values"] = x.sum().item() == 3.0 and bool((x > 1).any())
        for case, fn in {
            "cat with a CPU tensor raises": lambda: torch.cat([x, cpu]),
            "add of a CPU tensor raises": lambda: x + cpu,
            "numpy() raises": lambda: x.numpy(),
        }.items():
            try:
                fn()
                out[case] = False
            except (RuntimeError, TypeError):
                out[case] = True
    return out


def run_stages(root) -> dict:
    """Every run of `stage_configs` on the standin device, then a resume of the GRPO run: {name: "ok" or the
    error's last line}. Runs in this process (it must be one of its own: see `_register`)."""
    import traceback
    from dataclasses import replace

    import nanogrpo.model.fast.grouped
    from train import main

    caches = []  # the KV cache's dtype of each sampler call: the sampler's compute dtype
    prefill = nanogrpo.model.fast.grouped.prefill_grouped

    def spy(*args, **kwargs):
        out = prefill(*args, **kwargs)
        caches.append(str(out[1].k.dtype))
        return out

    nanogrpo.model.fast.grouped.prefill_grouped = spy
    results = {"_self_check": self_check()}
    cfgs = stage_configs(root)
    cfgs["grpo-resume"] = replace(cfgs["grpo"], steps=3, resume=True, eval_prompts=0)
    for name, cfg in cfgs.items():
        StandInGenerator.made.clear()
        caches.clear()
        try:
            with standin_device():
                main(cfg)
            gens = sorted({str(d) for d in StandInGenerator.made})
            results[name] = {"ok": True, "generators": gens, "kv_cache": sorted(set(caches))}
        except Exception as e:  # the test prints the error; the traceback goes to stderr
            traceback.print_exc()
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    return results


if __name__ == "__main__":  # python tests/standin.py ROOT: the runs, and ROOT/results.json
    import json
    import sys
    from pathlib import Path

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(run_stages(out), indent=1))
