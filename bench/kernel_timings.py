"""Benchmarks of nanogrpo_kernels/: log-probs (naive vs ours vs Liger), LCS (ours vs rapidfuzz), cosine,
and the GPU's ceilings (copy bandwidth, bf16 matmul rate). Prints a table last; --out DIR writes kernels.json.

    python bench/kernel_timings.py              # GPU: the sizes of the targets (docs/BENCHMARKS.md)
    python bench/kernel_timings.py --cpu        # CPU-sized shapes (the numbers in docs/BENCHMARKS.md)
    python bench/kernel_timings.py --cpu-smoke  # tiny shapes: checks that the script runs (seconds; the LCS
                                                # kernel in Triton's interpreter)

Times are medians of repeated runs after warm-up (CUDA events on the GPU). Peak memory is what the
measured call allocated on top of its inputs: torch.cuda.max_memory_allocated on the GPU, the process's
peak RSS (VmHWM, reset through /proc/self/clear_refs) on the CPU.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import nanogrpo_kernels  # noqa: E402
from nanogrpo_kernels import logprobs as lp_mod  # noqa: E402
from nanogrpo_kernels.cosine import adjusted_cosine, cosine_torch  # noqa: E402
from nanogrpo_kernels.lcs import lcs_lengths, lcs_rapidfuzz  # noqa: E402
from nanogrpo_kernels.logprobs_tiles import CONFIG_OVERRIDE, gpu_config  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def sync():
    if CUDA:
        torch.cuda.synchronize()


def timeit(fn, reps=5, warmup=2) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def peak_bytes(fn, child_args: list[str] | None = None) -> int | None:
    """Memory the call allocates beyond what is live before it.

    GPU: the caching allocator's peak. CPU: freed memory stays in the C allocator, so the call runs once
    in a fresh process (`child_args` rebuild its inputs there) and its peak RSS (VmHWM) is read.
    """
    sync()
    if CUDA:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        sync()
        return torch.cuda.max_memory_allocated() - base
    if child_args is None:
        return None
    out = subprocess.run([sys.executable, __file__, *child_args], capture_output=True, text=True)
    return int(out.stdout.split()[-1]) if out.returncode == 0 else None


def _peak_child(method: str, n: int, v: int, hdim: int, dtype: str) -> None:
    """In a fresh process: build the inputs, run fwd+bwd once, print the bytes of peak RSS it added."""
    h, w, y = lp_inputs(n, v, hdim, getattr(torch, dtype))
    fn = {"naive": naive_logprobs, "ours": ours_logprobs}[method]
    base = _rss_kib("VmRSS")
    hh = h.detach().requires_grad_()
    fn(hh, w, y)[0].sum().backward()
    print((_rss_kib("VmHWM") - base) * 1024)


# ----------------------------------------------------------------------------------------------------
def bench_ceilings(res: dict) -> None:
    if not CUDA:
        return
    n = 1 << 30  # 2 GiB bf16 per buffer: several times the L2
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    t = timeit(lambda: y.copy_(x), reps=10)
    res["copy_GBps"] = 2 * x.numel() * 2 / t / 1e9  # bytes read + written
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t = timeit(lambda: a @ b, reps=10, warmup=3)
    res["matmul_bf16_TFLOPs"] = 2 * 8192**3 / t / 1e12
    props = torch.cuda.get_device_properties(0)
    res["device"] = props.name
    res["sms"] = props.multi_processor_count


def naive_logprobs(h, w, y, temperature=1.0):
    """What most trainers do: float32 logits [N, V], log_softmax, gather (plus the entropy metric)."""
    logits = (h @ w.T).float() / temperature  # (N, V)
    logsm = logits.log_softmax(-1)  # (N, V)
    logp = logsm.gather(1, y[:, None]).squeeze(1)
    with torch.no_grad():
        entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def ours_logprobs(h, w, y, temperature=1.0):
    return lp_mod.token_logprobs(h, w, y, temperature)


def liger_grpo_fn():
    """Liger's fused linear GRPO loss as a (h, w, y) -> loss callable, or None when it is not installed."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return None
    loss_mod = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False)

    def run(h, w, y):
        t = 1024  # sequences of 1024 tokens
        mask = torch.ones(h.shape[0] // t, t, device=h.device)
        adv = torch.ones(h.shape[0] // t, device=h.device)
        out = loss_mod(h.view(-1, t, h.shape[1]), w, y.view(-1, t), mask, adv)
        return out[0] if isinstance(out, tuple) else out

    return run


def lp_inputs(n: int, v: int, hdim: int, dtype):
    g = torch.Generator(device=DEV).manual_seed(0)
    h = torch.randn(n, hdim, device=DEV, dtype=dtype, generator=g)
    w = (torch.randn(v, hdim, device=DEV, dtype=dtype, generator=g) / hdim**0.5 * 4).to(dtype)
    y = torch.randint(0, v, (n,), device=DEV, generator=g)
    return h, w, y


def bench_logprobs(res: dict, n: int, v: int, hdim: int, dtype, reps: int) -> None:
    h, w, y = lp_inputs(n, v, hdim, dtype)
    shape = dict(N=n, V=v, H=hdim, dtype=str(dtype).replace("torch.", ""))
    res["shape"] = shape

    def fwd_bwd(fn):
        def run():
            hh = h.detach().requires_grad_()  # LoRA: the LM head is frozen, the hidden states need a grad
            out = fn(hh, w, y)
            loss = out[0].sum() if isinstance(out, tuple) else out
            loss.backward()

        return run

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn(h, w, y)

        return run

    methods = {"naive": naive_logprobs, "ours": ours_logprobs}
    liger = liger_grpo_fn() if CUDA else None
    res["liger"] = "measured" if liger else "not installed"
    for name, fn in methods.items():
        try:
            r = res.setdefault(name, {})
            r["fwd_s"] = timeit(fwd(fn), reps=reps)
            r["fwd_bwd_s"] = timeit(fwd_bwd(fn), reps=reps)
            child = ["--peak-child", name, *map(str, (n, v, hdim)), str(dtype).replace("torch.", "")]
            r["fwd_bwd_peak_bytes"] = peak_bytes(fwd_bwd(fn), child)
        except torch.OutOfMemoryError as e:
            res[name] = {"error": f"out of memory: {e}"[:200]}
        if CUDA:
            torch.cuda.empty_cache()
    if liger:
        try:
            res["liger_grpo"] = {
                "fwd_bwd_s": timeit(fwd_bwd(liger), reps=reps),
                "fwd_bwd_peak_bytes": peak_bytes(fwd_bwd(liger)),
            }
        except Exception as e:  # an API change in Liger must not sink the other numbers
            res["liger_grpo"] = {"error": repr(e)[:300]}
    # agreement with the naive path on these inputs (bf16 logits there: differences of ~1e-2 expected)
    with torch.no_grad():
        a, b = naive_logprobs(h[:4096], w, y[:4096]), ours_logprobs(h[:4096], w, y[:4096])
    res["max_abs_diff_logp_vs_naive"] = (a[0] - b[0]).abs().max().item()
    res["max_abs_diff_entropy_vs_naive"] = (a[1] - b[1]).abs().max().item()
    if "error" not in res.get("naive", {}) and "error" not in res.get("ours", {}):
        res["ours_over_naive_time"] = res["ours"]["fwd_bwd_s"] / res["naive"]["fwd_bwd_s"]
        if res["naive"]["fwd_bwd_peak_bytes"] and res["ours"]["fwd_bwd_peak_bytes"] is not None:
            res["ours_over_naive_memory"] = (
                res["ours"]["fwd_bwd_peak_bytes"] / res["naive"]["fwd_bwd_peak_bytes"]
            )


def tune_logprobs(res: dict, n: int, v: int, hdim: int) -> None:
    """Time the forward kernel in a few tile shapes; the fastest is used for the rest of the run (through
    nanogrpo_kernels.logprobs_tiles.CONFIG_OVERRIDE). The first is the shipped one for this GPU
    (nanogrpo_kernels.logprobs_tiles.gpu_config), which compiles without spills (bench/kernels_aot.py); the
    others may spill on some GPUs."""
    h = torch.randn(n, hdim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, hdim, device="cuda", dtype=torch.bfloat16) / hdim**0.5
    y = torch.randint(0, v, (n,), device="cuda")
    shipped = gpu_config("fwd", torch.bfloat16, torch.cuda.get_device_capability())
    configs = [shipped]
    for cfg in (
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3),
        dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=16, num_stages=3),
        dict(BLOCK_N=128, BLOCK_V=64, BLOCK_H=64, num_warps=8, num_stages=3),
        dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3),
    ):
        if cfg not in configs:
            configs.append(cfg)
    timings = []
    for cfg in configs:
        CONFIG_OVERRIDE["fwd"] = cfg
        try:
            t = timeit(lambda: lp_mod._logprobs_fwd_triton(h, w, y, 1.0), reps=3, warmup=1)
        except Exception as e:  # e.g. out of shared memory for this tile shape
            t = float("inf")
            cfg = dict(cfg, error=repr(e)[:120])
        timings.append((t, cfg))
    best_t, best = min(timings, key=lambda x: x[0])
    if best_t < float("inf") and best != shipped:
        CONFIG_OVERRIDE["fwd"] = best
    else:
        CONFIG_OVERRIDE.pop("fwd", None)
    res["tried"] = [dict(c, fwd_s=t) for t, c in timings]
    res["shipped"] = shipped
    res["chosen"] = dict(CONFIG_OVERRIDE.get("fwd", shipped))


def lcs_dp(a: list[int], b: list[int]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def bench_lcs(res: dict, pairs: int, length: int, vocab: int, reps: int, interpret: bool = False) -> None:
    """rapidfuzz on the CPU against the Triton kernel: on CUDA, or (interpret, for --cpu-smoke) in Triton's
    interpreter on CPU tensors, through the same calls and the same table rows."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, vocab, (pairs, length), generator=g)
    b = torch.randint(0, vocab, (pairs, length), generator=g)
    la, lb = a.tolist(), b.tolist()
    res["shape"] = dict(pairs=pairs, length=length, vocab=vocab, cores=os.cpu_count())
    try:
        want = lcs_rapidfuzz(la, lb)
        res["rapidfuzz_all_cores_s"] = timeit(lambda: lcs_rapidfuzz(la, lb, workers=-1), reps=reps, warmup=1)
        res["rapidfuzz_1_core_s"] = timeit(
            lambda: lcs_rapidfuzz(la, lb, workers=1), reps=max(1, reps // 2), warmup=0
        )
    except ImportError:
        res["rapidfuzz"] = "not installed"
        want = None
    if not nanogrpo_kernels.HAS_TRITON or not (CUDA or (interpret and nanogrpo_kernels.interpreting())):
        return
    res["triton_device"] = "cuda" if CUDA else "interpreter"
    old = nanogrpo_kernels.get_backend()
    nanogrpo_kernels.set_backend("triton")  # CPU tensors go to the kernel too (in the interpreter)
    try:
        ad, bd = a.to(DEV), b.to(DEV)
        got = lcs_lengths(ad, bd).tolist()
        # rapidfuzz on every pair, or a plain DP on the first few when rapidfuzz is missing
        res["triton_matches"] = (
            got == want if want else got[:4] == [lcs_dp(x, y) for x, y in zip(la[:4], lb[:4])]
        )
        res["triton_s"] = timeit(lambda: lcs_lengths(ad, bd), reps=reps, warmup=1)
        res["triton_from_lists_s"] = timeit(lambda: lcs_triton_from_lists(la, lb), reps=reps, warmup=0)
    finally:
        nanogrpo_kernels.set_backend(old)
    if "rapidfuzz_all_cores_s" in res:
        res["speedup_vs_rapidfuzz_all_cores"] = res["rapidfuzz_all_cores_s"] / res["triton_s"]


def lcs_triton_from_lists(la, lb):
    """End to end from Python lists: padding, host-to-device copy, kernel, result back."""
    a = torch.tensor(la, dtype=torch.int32).to(DEV, non_blocking=True)
    b = torch.tensor(lb, dtype=torch.int32).to(DEV, non_blocking=True)
    return lcs_lengths(a, b).tolist()


def bench_cosine(res: dict, n: int, d: int, reps: int) -> None:
    gen, ref, base = torch.randn(n, d, device=DEV), torch.randn(n, d, device=DEV), torch.randn(d, device=DEV)
    res["shape"] = dict(N=n, D=d)
    res["torch_s"] = timeit(lambda: cosine_torch(gen, ref, base, 4.0, True), reps=reps)
    res["dispatch_s"] = timeit(lambda: adjusted_cosine(gen, ref, base), reps=reps)
    res["backend"] = "triton" if nanogrpo_kernels.use_triton(gen) else "torch"


# ----------------------------------------------------------------------------------------------------
def fmt_s(x):
    return "-" if x is None else f"{x * 1e3:.2f} ms"


def fmt_b(x):
    return "-" if x is None else f"{x / 2**30:.2f} GiB" if x >= 2**28 else f"{x / 2**20:.1f} MiB"


def table(results: dict) -> str:
    rows = [("what", "value"), ("command", results["command"]), ("date", results["date"])]
    c = results.get("ceilings", {})
    if "device" in c:
        rows += [("device", c["device"]), ("copy bandwidth", f"{c['copy_GBps']:.0f} GB/s")]
        rows += [("bf16 matmul 8192^3", f"{c['matmul_bf16_TFLOPs']:.0f} TFLOP/s")]
    lp = results.get("logprobs", {})
    if "shape" in lp:
        s = lp["shape"]
        rows.append(("log-probs shape", f"N={s['N']} V={s['V']} H={s['H']} {s['dtype']}"))
        for name in ("naive", "ours", "liger_grpo"):
            r = lp.get(name)
            if r and "error" not in r:
                rows.append(
                    (f"  {name} fwd+bwd", f"{fmt_s(r['fwd_bwd_s'])}, peak {fmt_b(r['fwd_bwd_peak_bytes'])}")
                )
                if "fwd_s" in r:
                    rows.append((f"  {name} fwd (no grad)", fmt_s(r["fwd_s"])))
            elif r:
                rows.append((f"  {name}", r["error"][:60]))
        if "ours_over_naive_time" in lp:
            rows.append(("  ours / naive time", f"{lp['ours_over_naive_time']:.2f}x (target <= 1.15x)"))
        if "ours_over_naive_memory" in lp:
            rows.append(("  ours / naive memory", f"{lp['ours_over_naive_memory']:.3f}x (target <= 0.25x)"))
        if "max_abs_diff_logp_vs_naive" in lp:
            rows.append(("  max |logp ours - naive|", f"{lp['max_abs_diff_logp_vs_naive']:.2e}"))
    lcs = results.get("lcs", {})
    if "rapidfuzz_1_core_s" in lcs:
        s = lcs["shape"]
        rows.append(("LCS shape", f"{s['pairs']} pairs x {s['length']} tokens, {s['cores']} cores"))
        rows.append(("  rapidfuzz all cores", fmt_s(lcs["rapidfuzz_all_cores_s"])))
        rows.append(("  rapidfuzz 1 core", fmt_s(lcs["rapidfuzz_1_core_s"])))
        if "triton_s" in lcs:
            where = lcs.get("triton_device", "cuda")
            rows.append(
                (f"  triton ({where})", f"{fmt_s(lcs['triton_s'])} (matches: {lcs['triton_matches']})")
            )
            if "speedup_vs_rapidfuzz_all_cores" in lcs:
                rows.append(("  speedup", f"{lcs['speedup_vs_rapidfuzz_all_cores']:.1f}x (target >= 10x)"))
    cos = results.get("cosine", {})
    if "dispatch_s" in cos:
        rows.append(("cosine (adjusted)", f"N={cos['shape']['N']} D={cos['shape']['D']}"))
        rows.append(("  torch reference", fmt_s(cos["torch_s"])))
        rows.append((f"  dispatch ({cos['backend']})", fmt_s(cos["dispatch_s"])))
    for name in ("ceilings", "tune", "logprobs", "lcs", "cosine"):
        if "error" in results.get(name, {}) or "skipped" in results.get(name, {}):
            rows.append((f"{name} NOT MEASURED", results[name].get("error") or results[name]["skipped"]))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a.ljust(width)}  {b}" for a, b in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="CPU-sized shapes")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, to check that the script runs")
    ap.add_argument("--out", default="", help="folder for kernels.json")
    ap.add_argument("--only", default="ceilings,tune,logprobs,lcs,cosine", help="comma-separated sections")
    ap.add_argument(
        "--budget-s", type=float, default=420.0, help="skip the sections left after this many seconds"
    )
    ap.add_argument("--peak-child", nargs=5, help=argparse.SUPPRESS)  # internal: CPU peak memory
    args = ap.parse_args()
    if args.peak_child:
        method, n, v, hdim, dtype = args.peak_child
        return _peak_child(method, int(n), int(v), int(hdim), dtype)
    if args.cpu_smoke:
        # LCS: few short pairs, as the Triton kernel runs in the interpreter here
        sizes = dict(lp=(256, 4097, 128, torch.float32), lcs=(8, 24, 50), cos=(256, 384), reps=2)
    elif args.cpu or not CUDA:
        sizes = dict(lp=(2048, 49152, 576, torch.bfloat16), lcs=(1024, 512, 2000), cos=(4096, 384), reps=3)
    else:
        sizes = dict(
            lp=(32768, 151936, 1536, torch.bfloat16), lcs=(1024, 512, 2000), cos=(65536, 384), reps=5
        )
    wanted = args.only.split(",")
    results = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        command=" ".join([Path(sys.executable).name] + sys.argv),
        machine=dict(
            cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), torch=torch.__version__
        ),
        backend=nanogrpo_kernels.get_backend(),
    )
    if nanogrpo_kernels.HAS_TRITON:
        import triton

        results["machine"]["triton"] = triton.__version__
    t_start = time.time()
    sections = [
        ("ceilings", lambda r: bench_ceilings(r)),
        (
            "tune",
            lambda r: tune_logprobs(r, *sizes["lp"][:3]) if CUDA and nanogrpo_kernels.HAS_TRITON else None,
        ),
        ("logprobs", lambda r: bench_logprobs(r, *sizes["lp"], reps=sizes["reps"])),
        ("lcs", lambda r: bench_lcs(r, *sizes["lcs"], reps=sizes["reps"], interpret=args.cpu_smoke)),
        ("cosine", lambda r: bench_cosine(r, *sizes["cos"], reps=sizes["reps"])),
    ]
    for name, fn in sections:
        if name not in wanted:
            continue
        if time.time() - t_start > args.budget_s:
            results[name] = {"skipped": "time budget spent"}
            continue
        r = results.setdefault(name, {})
        t0 = time.time()
        try:
            fn(r)
        except Exception as e:  # one failing section must not lose the others' numbers
            r["error"] = repr(e)[:500]
        r["section_s"] = round(time.time() - t0, 1)
        print(f"[{name}] done in {r['section_s']} s", file=sys.stderr, flush=True)
        if args.out:  # write as we go: a run cut short keeps what it measured
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "kernels.json").write_text(json.dumps(results, indent=2, default=str))
    print(table(results))


if __name__ == "__main__":
    main()
