"""Which SDPA kernel training-shaped attention gets, and what it costs: grouped-query attention over
left-padded rows (a boolean mask), the old call (mask + enable_gqa) against nanogrpo's
(`nanogrpo.model.attention.gqa_sdpa`: k/v repeated to the query heads unless torch's checks take the call as
it is), each under every SDPA backend alone and under SDPA's own choice.

    python bench/attention.py                      # the GPU: Qwen2.5-1.5B's heads (12 / 2, dim 128), bf16
    python bench/attention.py --batch 16 --seq 1024
    python bench/attention.py --cpu-smoke          # tiny shapes on the CPU: checks that the script runs

Per call and backend: ok, or why SDPA refused it (it raises when no enabled kernel takes the call); the
kernel that ran (the profiler's name of SDPA's op); median ms of forward + backward; the peak memory the
call allocated above its inputs (CUDA only). The `default` rows are what training gets. On the CPU the
efficient and cuDNN kernels do not exist and FLASH_ATTENTION is a CPU kernel: the table says so. The last
block printed is the table; its first line starts with `attention `, its last is the command.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nanogrpo.model.attention import fused_takes, gqa_sdpa  # noqa: E402

BACKENDS = {
    "default": None,
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def inputs(a, dev: torch.device):
    """q (B, nh, T, D), k/v (B, n_kv, T, D) requiring grad, and the model's mask (B, 1, T, T): causal,
    row i left-padded by i * pad * T / (B - 1) tokens, each query seeing itself (pad rows never empty)."""
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, a.dtype)
    make = lambda h: torch.randn(a.batch, h, a.seq, a.head_dim, generator=g).to(dev, dt).requires_grad_()
    q, k, v = make(a.heads), make(a.kv_heads), make(a.kv_heads)
    T = a.seq
    pads = [int(i * a.pad * T / max(a.batch - 1, 1)) for i in range(a.batch)]
    real = torch.stack([torch.arange(T) >= p for p in pads])  # (B, T)
    pos = torch.arange(T)
    mask = ((pos[None, :] <= pos[:, None])[None, None] & real[:, None, None, :]) | torch.eye(
        T, dtype=torch.bool
    )
    return q, k, v, mask.to(dev), pads  # mask (B, 1, T, T)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def kernel_of(run) -> str:
    """The SDPA op that ran the forward, as the profiler names it (e.g. efficient_attention, math)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    prefix = "aten::_scaled_dot_product_"
    found = {e.key[len(prefix) :] for e in prof.key_averages() if e.key.startswith(prefix)}
    return ",".join(sorted(n for n in found if "backward" not in n)) or "?"


def measure(call, backend, q, k, v, mask, dev, repeat: int) -> dict:
    """One call under one backend (None: SDPA's choice): status, kernel, ms fwd+bwd, peak MiB."""
    w = torch.randn(q.shape[0], q.shape[1], q.shape[2], q.shape[3], device=dev, dtype=q.dtype)

    def run():
        y = call(q, k, v, mask)  # (B, nh, T, D)
        y.backward(w)
        q.grad = k.grad = v.grad = None

    try:
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            kernel = kernel_of(run)  # also the warm-up
            sync(dev)
            peak = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                run()
                sync(dev)
                peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
            times = []
            for _ in range(repeat):
                sync(dev)
                t0 = time.perf_counter()
                run()
                sync(dev)
                times.append(time.perf_counter() - t0)
    except RuntimeError as e:  # no enabled kernel takes the call (or the kernel is not built here)
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"status": "refused", "why": why[:60]}
    return {"status": "ok", "kernel": kernel, "ms": 1e3 * statistics.median(times), "peak": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, to check the script")
    ap.add_argument("--batch", type=int, default=16, help="rows (a micro-batch of completions)")
    ap.add_argument("--seq", type=int, default=512, help="T = S: prompt + completion tokens")
    ap.add_argument("--heads", type=int, default=12, help="query heads (Qwen2.5-1.5B: 12)")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (Qwen2.5-1.5B: 2)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--pad", type=float, default=0.5, help="the last row's left padding, a fraction of T")
    ap.add_argument("--repeat", type=int, default=10, help="timed runs per cell (median)")
    a = ap.parse_args()
    if a.cpu_smoke:
        a.device, a.batch, a.seq, a.heads, a.kv_heads, a.head_dim, a.dtype, a.repeat = (
            "cpu", 3, 32, 4, 2, 16, "float32", 2,
        )  # fmt: skip
    dev = torch.device(a.device)
    q, k, v, mask, pads = inputs(a, dev)
    calls = {
        "old": lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
        "new": lambda q, k, v, m: gqa_sdpa(q, k, v, m, False),
    }
    repeats = not fused_takes(q, k, v, mask, False)
    rows = []
    for name, call in calls.items():
        for bname, backend in BACKENDS.items():
            r = measure(call, backend, q, k, v, mask, dev, a.repeat)
            rows.append((name, bname, r))
            print(f"{name} {bname}: {r}", file=sys.stderr, flush=True)

    where = f"{dev.type} ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "cpu"
    B, nh, T, D = q.shape
    item = q.element_size()
    lines = [
        f"attention  B={B} nh={nh} n_kv={a.kv_heads} T=S={T} D={D} {a.dtype} on {where}, torch "
        f"{torch.__version__}; left padding {pads[0]}..{pads[-1]} tokens",
        f"{'call':<5} {'backend':<10} {'status':<8} {'kernel':<28} {'ms f+b':>9} {'peak MiB':>9}",
    ]
    for name, bname, r in rows:
        if r["status"] == "ok":
            peak = f"{r['peak']:9.1f}" if r["peak"] is not None else f"{'-':>9}"
            lines.append(f"{name:<5} {bname:<10} {'ok':<8} {r['kernel']:<28} {r['ms']:9.2f} {peak}")
        else:
            lines.append(f"{name:<5} {bname:<10} {'refused':<8} {r['why']}")
    lines += [
        "old: SDPA(q, k, v, mask, enable_gqa=True); new: nanogrpo.model.attention.gqa_sdpa, which here "
        + (
            "repeats k/v to the query heads (no fused kernel takes the call as it is)"
            if repeats
            else "passes the call as it is (a fused kernel takes it)"
        ),  # fmt: skip
        f"the new call's k/v copy: {2 * B * nh * T * D * item / 2**20:.1f} MiB per layer; one (B, nh, T, S) "
        f"score tensor in {a.dtype}: {B * nh * T * T * item / 2**20:.1f} MiB (the math kernel keeps several)",
    ]
    if dev.type != "cuda":
        lines.append(
            "on the CPU SDPA's efficient and cuDNN kernels do not exist (refused above) and 'flash' is its "
            "CPU kernel: the GPU's kernel choice needs a GPU run"
        )
    cmd = "python bench/attention.py --cpu-smoke" if a.cpu_smoke else (
        f"python bench/attention.py --device {a.device} --batch {a.batch} --seq {a.seq} --heads {a.heads} "
        f"--kv-heads {a.kv_heads} --head-dim {a.head_dim} --dtype {a.dtype} --pad {a.pad} --repeat {a.repeat}"
    )  # fmt: skip
    lines.append(f"command: {cmd}")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
