"""Ahead-of-time compile of every Triton kernel in nanogrpo_kernels/ for sm_80, sm_89 and sm_90, without a
GPU: the shared memory, registers and register spills of each launch config the code picks, against each GPU's
limits. Prints a table; exits 1 when a kernel spills, overflows shared memory or does not compile.

    python bench/kernels_aot.py                         # every kernel, dtype and config, on the three GPUs
    python bench/kernels_aot.py --arch 80 --only logprobs --json aot.json

The configs are the ones the kernels choose at launch: `nanogrpo_kernels.logprobs_tiles.gpu_config` for each
input dtype and compute capability (forward, backward, backward with the entropy gradient), every block size
`nanogrpo_kernels.lcs.lcs_launch_config` can return (the register row and the tiled kernel), and the cosine kernel
at its largest block. Pointers are compiled as 16-byte aligned and the log-probs hidden size and row
strides as multiples of 16: the specialisation Triton gives them at run time for any hidden size that is a
multiple of 16 (all released models). Other hidden sizes compile without vectorised loads or pipelining
and spill: correct, slower.

Triton compiles each kernel to PTX and a cubin for `GPUTarget("cuda", arch, 32)` (no driver needed);
`metadata.shared` is the shared memory the launch asks for, and the log of Triton's own ptxas run (same
ptxas and flags as at run time) gives the registers and spill bytes. The numbers belong to the Triton
version that compiled them (printed first): run this with the Triton the GPU machine will run.
"""

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile the kernels, even on a machine without CUDA
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from nanogrpo_kernels import HAS_TRITON  # noqa: E402
from nanogrpo_kernels import cosine as cos_mod  # noqa: E402
from nanogrpo_kernels import lcs as lcs_mod  # noqa: E402
from nanogrpo_kernels import logprobs as lp_mod  # noqa: E402
from nanogrpo_kernels.logprobs_tiles import gpu_config  # noqa: E402

# Largest dynamic shared memory a block may opt into (CUDA programming guide, compute capabilities table).
SHARED_LIMIT = {80: 166_912, 89: 101_376, 90: 232_448}
ARCHS = tuple(SHARED_LIMIT)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Case:
    """One kernel specialisation to compile: its signature types, constexprs and launch options."""

    kernel: str
    dtype: str
    config: str
    fn: object
    types: dict  # argument name -> Triton type ('*bf16', 'i32', 'fp32', ...); the rest are constexprs
    constexprs: dict
    aligned: tuple  # arguments compiled as multiples of 16 (pointers: 16-byte aligned)
    num_warps: int
    num_stages: int = 3


@dataclass
class Row:
    kernel: str
    dtype: str
    config: str
    arch: int
    shared: int | None = None
    limit: int = 0
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    verdict: str = ""


def logprobs_cases(arch: int, dtypes: list[str]) -> list[Case]:
    """Forward, backward and backward with the entropy gradient, in the config each dtype gets on sm_<arch>."""
    cases = []
    for dt in dtypes:
        for kernel, ent in (("fwd", None), ("bwd", False), ("bwd", True)):
            cfg = gpu_config(kernel, DTYPES[dt], (arch // 10, arch % 10))
            tile = {k: cfg[k] for k in ("BLOCK_N", "BLOCK_V", "BLOCK_H")}
            consts = dict(tile, DOT_F32=False, IEEE=dt == "fp32")
            warps, stages = cfg["num_warps"], cfg["num_stages"]
            label = "x".join(str(v) for v in tile.values()) + f" w{warps} s{stages}"
            if kernel == "fwd":
                fn, title = lp_mod._logprobs_fwd_kernel, "logprobs fwd"
                types = dict(h_ptr=f"*{dt}", w_ptr=f"*{dt}", tgt_ptr="*i64", part_ptr="*fp32")
                types.update(N="i32", V="i32", H="i32", stride_h="i32", stride_w="i32")
                types.update(inv_temp="fp32", tiles_per_split="i32")
                aligned = ("h_ptr", "w_ptr", "tgt_ptr", "part_ptr", "H", "stride_h", "stride_w")
            else:
                fn, title = lp_mod._logprobs_bwd_kernel, "logprobs bwd" + (" +entropy" if ent else "")
                types = dict(h_ptr=f"*{dt}", w_ptr=f"*{dt}", tgt_ptr="*i64", lse_ptr="*fp32", dz_ptr=f"*{dt}")
                types.update(ent_ptr="*fp32", a_ptr="*fp32", b_ptr="*fp32", C="i32", V="i32", H="i32")
                types.update(stride_h="i32", stride_w="i32", stride_dz="i32", inv_temp="fp32")
                consts["ENT_GRAD"] = ent
                ints = ("H", "stride_h", "stride_w", "stride_dz")
                aligned = tuple(k for k in types if k.endswith("_ptr")) + ints
            cases.append(Case(title, dt, label, fn, types, consts, aligned, warps, stages))
    return cases


def lcs_cases(quick: bool) -> list[Case]:
    """Every block size the LCS launch can pick (quick: the largest register row and the tiled kernel, which
    bound the others: smaller blocks hold at most as many ids per thread)."""
    lengths = [1 << k for k in range(4, lcs_mod.LCS_MAX_BLOCK.bit_length())] + [lcs_mod.LCS_MAX_BLOCK + 1]
    if quick:
        lengths = lengths[-2:]
    cases = []
    for length in lengths:
        cfg = lcs_mod.lcs_launch_config(length)
        types = dict(a_ptr="*i32", a_len_ptr="*i32", b_ptr="*i32", b_len_ptr="*i32")
        if cfg["kernel"] == "tiled":
            fn = lcs_mod._lcs_tiled_kernel
            types.update(rows_ptr="*i32", out_ptr="*i32", stride_a="i32", stride_b="i32")
            types.update(stride_rows="i32", width="i32")
        else:
            fn = lcs_mod._lcs_fwd_kernel
            types.update(out_ptr="*i32", stride_a="i32", stride_b="i32")
        aligned = tuple(k for k in types if k.endswith("_ptr"))
        label = f"{cfg['kernel']} B={cfg['BLOCK_B']} w{cfg['num_warps']}"
        cases.append(
            Case("lcs", "i32", label, fn, types, dict(BLOCK_B=cfg["BLOCK_B"]), aligned, cfg["num_warps"])
        )
    return cases


def cosine_cases(dtypes: list[str]) -> list[Case]:
    cases = []
    for name in dtypes:
        types = dict(g_ptr=f"*{name}", r_ptr=f"*{name}", b_ptr=f"*{name}", out_ptr="*fp32")
        types.update(D="i32", stride_g="i32", stride_r="i32", stride_b="i32", scale="fp32")
        consts = dict(HAS_BASELINE=True, CLIP=True, BLOCK_D=cos_mod.MAX_BLOCK_D)
        aligned = tuple(k for k in types if k.endswith("_ptr"))
        label = f"D={cos_mod.MAX_BLOCK_D} w{cos_mod.NUM_WARPS}"
        cases.append(
            Case("cosine", name, label, cos_mod._cosine_fwd_kernel, types, consts, aligned, cos_mod.NUM_WARPS)
        )
    return cases


_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_log(compiled, arch: int) -> str:
    """ptxas -v on the kernel's PTX, for a Triton whose own ptxas log could not be captured."""
    import triton

    try:  # the ptxas Triton itself runs for this arch (some versions ship a second one for newer GPUs)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = Path(get_ptxas(arch).path)
    except (ImportError, AttributeError):
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(compiled.asm["ptx"])
        out = subprocess.run(
            [str(ptxas), "-v", f"--gpu-name={gpu}", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    return out.stdout + out.stderr


def compile_case(case: Case, arch: int) -> Row:
    """Compile one case for sm_<arch> and read its shared memory, registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = Row(case.kernel, case.dtype, case.config, arch, limit=SHARED_LIMIT[arch])
    names = case.fn.arg_names
    missing = [n for n in names if n not in case.types and n not in case.constexprs]
    if missing:
        raise ValueError(f"{case.kernel}: no type for {missing}: update bench/kernels_aot.py with the kernel")
    signature = {n: case.types.get(n, "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in case.aligned}
    src = ASTSource(case.fn, signature, case.constexprs, attrs)
    options = dict(num_warps=case.num_warps, num_stages=case.num_stages)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # Triton prints its ptxas log there (dump_ptxas_log)
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as e:  # a compile failure is a verdict, not a crash: the other rows still print
        row.verdict = f"COMPILE ERROR {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        return row
    text = log.getvalue()
    if not _USED.search(text):
        text = _ptxas_log(compiled, arch)
    row.shared = int(compiled.metadata.shared)
    used, spill = _USED.search(text), _SPILL.search(text)
    row.registers = int(used.group(1)) if used else None
    row.spill_stores, row.spill_loads = (int(spill.group(1)), int(spill.group(2))) if spill else (None, None)
    problems = []
    if row.shared > row.limit:
        problems.append(f"shared {row.shared} > {row.limit}")
    if row.spill_stores is None or row.registers is None:
        problems.append("no ptxas report")
    elif row.spill_stores or row.spill_loads:
        problems.append("SPILLS")
    row.verdict = "ok" if not problems else "; ".join(problems)
    return row


def _arch_rows(arch: int, only: list[str], dtypes: list[str], quick: bool) -> list[Row]:
    """Every case compiled for one arch (one worker process)."""
    import triton

    # Triton's own ptxas run prints its -v report; always compile, so that a cached kernel still reports
    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True
    cases = []
    if "logprobs" in only:
        cases += logprobs_cases(arch, dtypes)
    if "lcs" in only:
        cases += lcs_cases(quick)
    if "cosine" in only:
        cases += cosine_cases([d for d in dtypes if d != "fp16"])
    return [compile_case(c, arch) for c in cases]


def run(
    archs=ARCHS, only=("logprobs", "lcs", "cosine"), dtypes=("bf16", "fp16", "fp32"), quick=False, jobs=1
):
    """Compile every case for every arch, one arch per worker process; the rows in table order."""
    args = [(arch, list(only), list(dtypes), quick) for arch in archs]
    if jobs <= 1 or len(archs) == 1:
        parts = [_arch_rows(*a) for a in args]
    else:  # fork: the workers inherit the imported kernels (compiled, not interpreted)
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(min(jobs, len(archs)), mp_context=ctx) as pool:
            parts = list(pool.map(_arch_rows, *zip(*args)))
    return [row for part in parts for row in part]


def table(rows: list[Row]) -> str:
    head = ("kernel", "dtype", "config", "arch", "shared B", "limit B", "regs", "spill st/ld B", "verdict")
    lines = [head]
    for r in rows:
        spill = "-" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        lines.append(
            (r.kernel, r.dtype, r.config, f"sm_{r.arch}", str(r.shared if r.shared is not None else "-"),
             str(r.limit), str(r.registers if r.registers is not None else "-"), spill, r.verdict)
        )  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default=",".join(map(str, ARCHS)), help="compute capabilities, e.g. 80,89,90")
    ap.add_argument("--only", default="logprobs,lcs,cosine", help="comma-separated kernels")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32", help="input dtypes of log-probs and cosine")
    ap.add_argument("--quick", action="store_true", help="LCS: only the block sizes that bound the others")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (one arch each)")
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args()
    if not HAS_TRITON:
        print("bench/kernels_aot.py needs triton: pip install triton (or the dev extra)", file=sys.stderr)
        return 2
    import triton

    archs = [int(a) for a in args.arch.split(",")]
    unknown = [a for a in archs if a not in SHARED_LIMIT]
    if unknown:
        print(f"unknown arch {unknown}: use some of {', '.join(map(str, ARCHS))}", file=sys.stderr)
        return 2
    t0 = time.time()
    rows = run(archs, args.only.split(","), args.dtypes.split(","), args.quick, args.jobs)
    print(f"triton {triton.__version__}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"{time.time() - t0:.0f} s: {' '.join([Path(sys.executable).name] + sys.argv)}")  # fmt: skip
    print(table(rows))
    bad = [r for r in rows if r.verdict != "ok"]
    print(f"{len(rows) - len(bad)} of {len(rows)} fit" + (f"; {len(bad)} do not" if bad else ""))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
