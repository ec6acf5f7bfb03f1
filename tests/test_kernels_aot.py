"""bench/kernels_aot.py: every Triton kernel, in the launch configs the code picks, compiled ahead of time for
sm_80, sm_89 and sm_90 (no GPU needed) fits each GPU's shared memory with no register spills.

The compile runs in a subprocess: this process has the kernels under Triton's interpreter, which cannot
compile them. Restricted to what bounds the rest (fp16 compiles as bf16; the LCS row at its largest block
and the tiled kernel) to stay fast; `python bench/kernels_aot.py` checks everything.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ptxas() -> Path | None:
    """Triton's bundled ptxas, found without importing triton here (that would turn off the interpreter)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.exists() else None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the dev extra)")
@pytest.mark.skipif(_ptxas() is None, reason="this triton build ships no ptxas (triton/backends/nvidia/bin)")
def test_kernels_fit_sm80_sm89_sm90_without_spills(tmp_path):
    out = tmp_path / "aot.json"
    cmd = [sys.executable, "bench/kernels_aot.py", "--quick", "--dtypes", "bf16,fp32", "--json", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["arch"] for r in rows} == {80, 89, 90}
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"logprobs fwd", "logprobs bwd", "logprobs bwd +entropy", "lcs", "cosine"}, kernels
    assert {r["config"].split()[0] for r in rows if r["kernel"] == "lcs"} == {"rows", "tiled"}
    for r in rows:
        where = f"{r['kernel']} {r['dtype']} {r['config']} on sm_{r['arch']}: {r['verdict']}\n{res.stdout}"
        assert r["shared"] is not None and r["shared"] <= r["limit"], where
        assert r["registers"] is not None and r["registers"] <= 255, where
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, where
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
