#!/usr/bin/env bash
# One GPU run: checks and times everything nanogrpo cares about, in one go, within a time budget.
#
#   bash bench/gpu_check.sh RESULTS_DIR [BUDGET_SECONDS]      # default budget 330 s
#   bash bench/gpu_check.sh --cpu-smoke RESULTS_DIR           # tiny shapes on the CPU: checks the script
#
# Works offline on a machine with torch + triton installed: the checkout runs from PYTHONPATH (no pip
# install needed). Python wheels missing there (rapidfuzz for the LCS baseline, liger-kernel for the
# log-prob comparison, tyro for train.py) are installed offline from .whl/ when that folder exists:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl rapidfuzz liger-kernel tyro docstring-parser shtab typeguard
# Steps, each under its own timeout and the global budget (a step that fails does not stop the others):
#   1. the machine: GPU, driver, versions                       -> env.txt
#   2. kernel tests on CUDA (tests/test_kernels_*.py)           -> tests.log
#   3. bench/kernels.py: ceilings, log-probs, LCS, cosine       -> kernels.json, kernels.txt
#   4. bench/generate.py (decode tokens/s vs roofline), if any  -> generate.json, generate.log
#   5. bench/step.py (one GRPO step's time split), if any       -> step.json, step.log
# The last thing printed is the table; RESULTS_DIR holds the full numbers.
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE=1; shift; fi
RESULTS=${1:?usage: bash bench/gpu_check.sh [--cpu-smoke] RESULTS_DIR [BUDGET_SECONDS]}
BUDGET=${2:-330}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ "$SMOKE" = 1 ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
START=$(date +%s)
STATUS="$RESULTS/status.txt"
: >"$STATUS"

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME CAP_SECONDS COMMAND...: run under min(CAP, time left), log its output, record rc and seconds
step() {
    local name=$1 cap=$2
    shift 2
    local t=$(left)
    [ "$cap" -lt "$t" ] && t=$cap
    if [ "$t" -le 5 ]; then
        printf '%-10s %-8s %s\n' "$name" "skipped" "time budget spent" >>"$STATUS"
        return
    fi
    local t0=$(date +%s)
    echo "== $name (timeout ${t}s): $*"
    timeout --kill-after=10 "$t" "$@" 2>&1 | tee "$RESULTS/$name.log"
    local rc=${PIPESTATUS[0]}
    local state=ok
    [ "$rc" = 124 ] && state=timeout
    [ "$rc" != 0 ] && [ "$rc" != 124 ] && state="rc=$rc"
    printf '%-10s %-8s %ss\n' "$name" "$state" "$(($(date +%s) - t0))" >>"$STATUS"
}

# 0. offline wheels (see above)
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nanogrpo-site .whl/*.whl &&
        export PYTHONPATH="$PYTHONPATH:/tmp/nanogrpo-site"
fi

# 1. the machine
{
    date -u +"%Y-%m-%d %H:%M:%S UTC"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
    $PY -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
    $PY -c "import triton; print('triton', triton.__version__)" 2>&1
    for m in rapidfuzz liger_kernel tyro transformers; do $PY -c "import $m; print('$m', getattr($m, '__version__', 'ok'))" 2>/dev/null || echo "$m missing"; done
    nproc
} | tee "$RESULTS/env.txt"

if [ "$SMOKE" = 1 ]; then
    step kernels 300 $PY bench/kernels.py --cpu-smoke --out "$RESULTS" --budget-s 240
else
    # 2. correctness on CUDA first: a wrong kernel's timings are worthless
    step tests 100 $PY -m pytest -q -x -p no:cacheprovider tests/test_kernels_logprobs.py tests/test_kernels_lcs.py tests/test_kernels_cosine.py
    # 3. kernels (reserve ~100 s for the model benchmarks after it)
    step kernels $(($(left) - 100)) $PY bench/kernels.py --out "$RESULTS" --budget-s $(($(left) - 140))
    # 4. + 5. hooks for the model-level benchmarks, when they exist; override their flags by environment
    if [ -f bench/generate.py ]; then
        step generate 60 $PY bench/generate.py ${GENERATE_ARGS:---device cuda --json "$RESULTS/generate.json"}
    else
        printf '%-10s %-8s %s\n' generate absent "bench/generate.py does not exist" >>"$STATUS"
    fi
    if [ -f bench/step.py ]; then
        step step 90 $PY bench/step.py ${STEP_ARGS:---model tiny --side nanogrpo --device cuda --steps 2 --json "$RESULTS/step.json"}
    else
        printf '%-10s %-8s %s\n' step absent "bench/step.py does not exist" >>"$STATUS"
    fi
fi

# the table, last
echo
echo "== nanogrpo gpu_check: $(head -1 "$RESULTS/env.txt"), $(($(date +%s) - START)) s of a $BUDGET s budget"
cat "$STATUS"
echo
[ -f "$RESULTS/kernels.log" ] && sed -n '/^what /,$p' "$RESULTS/kernels.log"
[ -f "$RESULTS/step.log" ] && tail -n 15 "$RESULTS/step.log"
exit 0
