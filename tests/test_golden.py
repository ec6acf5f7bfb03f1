"""The four golden runs (tests/golden_runs.py) give the outputs recorded before the code last moved: on the CPU
class they were recorded on, the same metrics (timings aside), samples and adapter bytes; on another class, whose
float32 kernels round differently, the first step's metrics within 1e-4 (relative) or 1e-6 (absolute)."""

import json
import math

import pytest
from golden_runs import GOLDEN, RUNS, run


def close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) or (math.isnan(a) and math.isnan(b))
    return a == b


@pytest.mark.parametrize("name", list(RUNS))
def test_golden_run(name, tmp_path):
    want = json.loads((GOLDEN / f"{name}.json").read_text())
    got = run(name, tmp_path / name)
    if got["cpu_class"] == want["cpu_class"]:
        assert got["metrics"] == want["metrics"]
        assert got["samples"] == want["samples"]
        assert got["adapter_sha256"] == want["adapter_sha256"]
    else:
        first, ref = got["metrics"][0], want["metrics"][0]
        assert first.keys() == ref.keys()
        assert [k for k in ref if not close(first[k], ref[k])] == []
        assert [m["step"] for m in got["metrics"]] == [m["step"] for m in want["metrics"]]
