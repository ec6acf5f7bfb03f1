#!/usr/bin/env bash
# One GPU run: checks and times everything nanogrpo cares about, in one go, within a time budget.
#
#   bash bench/gpu_check.sh RESULTS_DIR [BUDGET_SECONDS]      # default budget 330 s
#   bash bench/gpu_check.sh --cpu-smoke RESULTS_DIR           # tiny shapes on the CPU: checks the script
#
# Works offline on a machine with torch + triton installed: the checkout runs from PYTHONPATH (no pip
# install needed). Python wheels missing there are installed offline from .whl/ when that folder exists:
# rapidfuzz (the LCS baseline), liger-kernel (the log-prob comparison; no deps: it would pull torch), and
# for the model steps safetensors, tokenizers, transformers, tyro, tqdm, numpy with their dependencies:
#   W="--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl"
#   pip download $W --no-deps liger-kernel
#   pip download $W rapidfuzz safetensors tokenizers transformers tyro tqdm numpy
# Steps, each under its own timeout and the global budget (a step that fails does not stop the others;
# one that cannot run says why in the table):
#   1. the machine: GPU, driver, versions                        -> env.txt
#   2. kernel tests on CUDA (tests/test_kernels_*.py)            -> tests.log
#   3. bench/kernels.py: ceilings, log-probs, LCS, cosine        -> kernels.json, kernels.log
#   4. a random model of a real shape ($GPU_MODEL, default random:qwen2.5-1.5b), built once into the
#      nanogrpo cache: no download (needs safetensors; tokenizers for its tokenizer)  -> model.log
#   5. bench/generate.py: decode tokens/s and HBM bandwidth vs the roofline at batch 1 and 64, and
#      nanogrpo vs transformers when transformers is there     -> generate.json, generate.log
#   6. bench/step.py --plan: one LoRA GRPO step on that model (time split, CUDA peak) next to
#      bench/memory_plan.py's prediction for the same config.json  -> step.json, step.log
#   7. bench/length_groups.py: the training forward + backward with the completions in length groups
#      against one group, and the fixed cost of a group (what logprobs.BUCKET_MIN_FAST should be) -> groups.log
# Steps 4-7 take ~130 s and keep that much of the budget (MODEL_RESERVE); override their flags with
# GENERATE_ARGS / STEP_ARGS / GROUPS_ARGS. The last thing printed is the table; RESULTS_DIR holds the full numbers.
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE=1; shift; fi
RESULTS=${1:?usage: bash bench/gpu_check.sh [--cpu-smoke] RESULTS_DIR [BUDGET_SECONDS]}
BUDGET=${2:-330}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && [ "$SMOKE" = 1 ] && PY=.venv/bin/python
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
    local state=ok why=""
    [ "$rc" = 124 ] && state=timeout
    [ "$rc" != 0 ] && [ "$rc" != 124 ] && state="rc=$rc"
    # a failed step: its last line is usually the reason
    [ "$rc" != 0 ] && why=" $(grep -v '^[[:space:]]*$' "$RESULTS/$name.log" | tail -n 1 | cut -c1-120)"
    printf '%-10s %-8s %ss%s\n' "$name" "$state" "$(($(date +%s) - t0))" "$why" >>"$STATUS"
}

# missing PYTHON_MODULES...: prints the ones that cannot be imported (empty when all are there)
missing() { $PY -c 'import importlib.util as u, sys; print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' "$@"; }

# model_steps MODEL GENERATE_ARGS STEP_ARGS GROUPS_ARGS: steps 4-7 (see the header), each skipped with
# the reason when a package it needs is missing
model_steps() {
    local model=$1 gen_args=$2 step_args=$3 groups_args=$4 miss
    miss=$(missing safetensors)
    if [ -n "$miss" ]; then
        for s in model generate step groups; do
            printf '%-10s %-8s %s\n' "$s" skipped "needs $miss (nanogrpo loads and saves weights with it; wheel in .whl/)" >>"$STATUS"
        done
        return
    fi
    step model 60 $PY -m nanogrpo.model_zoo "$model"
    step generate 75 $PY bench/generate.py $gen_args
    miss=$(missing transformers tokenizers tyro tqdm numpy)
    if [ -n "$miss" ]; then
        printf '%-10s %-8s %s\n' step skipped "train.py needs $miss (wheels in .whl/: see the header)" >>"$STATUS"
    else
        step step 90 $PY bench/step.py $step_args
    fi
    step groups 60 $PY bench/length_groups.py $groups_args
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
    for m in rapidfuzz liger_kernel tyro transformers tokenizers safetensors numpy tqdm; do $PY -c "import $m; print('$m', getattr($m, '__version__', 'ok'))" 2>/dev/null || echo "$m missing"; done
    nproc
} | tee "$RESULTS/env.txt"

RESERVE=${MODEL_RESERVE:-170} # seconds kept for steps 4-7
if [ "$SMOKE" = 1 ]; then
    # the same steps at tiny shapes: a 2-layer random model with Qwen2.5-0.5B's vocabulary and width
    step kernels $(($(left) - RESERVE)) $PY bench/kernels.py --cpu-smoke --out "$RESULTS" --budget-s $(($(left) - RESERVE - 40))
    MODEL=${GPU_MODEL:-random:qwen2.5-0.5b:layers=2}
    model_steps "$MODEL" \
        "${GENERATE_ARGS:---model $MODEL --device cpu --dtype float32 --threads 1 --prompts 2 --group 2 --new-tokens 4 --roofline 1,4 --peak-gbs 20 --warmup 0 --repeats 1 --json $RESULTS/generate.json}" \
        "${STEP_ARGS:---model $MODEL --side nanogrpo --device cpu --threads 1 --prompts 2 --group 2 --new-tokens 4 --filler-words 10 --micro-batch 2 --checkpointing --steps 1 --warmup 0 --plan --json $RESULTS/step.json}" \
        "${GROUPS_ARGS:---model $MODEL --device cpu --prompts 2 --group 4 --prompt-tokens 8 --lengths 2,3,2,4 --long 12 --repeat 1}"
else
    # 2. correctness on CUDA first: a wrong kernel's timings are worthless
    step tests 100 $PY -m pytest -q -x -p no:cacheprovider tests/test_kernels_logprobs.py tests/test_kernels_lcs.py tests/test_kernels_cosine.py
    # 3. kernels, keeping RESERVE seconds for the model steps after it
    step kernels $(($(left) - RESERVE)) $PY bench/kernels.py --out "$RESULTS" --budget-s $(($(left) - RESERVE - 40))
    # 4.-7. a random Qwen2.5-1.5B: decode vs the roofline first, then one GRPO step against the memory plan
    # (P=8 x G=8, ~250-token prompts + 256 new tokens, micro-batch 16, checkpointing on), then length
    # groups on a batch of short completions (8-40 tokens) with one 256-token straggler
    MODEL=${GPU_MODEL:-random:qwen2.5-1.5b}
    model_steps "$MODEL" \
        "${GENERATE_ARGS:---model $MODEL --device cuda --prompts 4 --group 8 --new-tokens 64 --roofline 1,64 --warmup 1 --repeats 2 --json $RESULTS/generate.json}" \
        "${STEP_ARGS:---model $MODEL --side nanogrpo --device cuda --prompts 8 --group 8 --new-tokens 256 --filler-words 70 --micro-batch 16 --checkpointing --steps 1 --warmup 1 --plan --json $RESULTS/step.json}" \
        "${GROUPS_ARGS:---model $MODEL --device cuda --dtype bfloat16 --prompts 8 --group 8 --prompt-tokens 250 --lengths 8,16,12,40,8,24,16,12 --long 256 --repeat 2}"
fi

# the table, last
echo
echo "== nanogrpo gpu_check: $(head -1 "$RESULTS/env.txt"), $(($(date +%s) - START)) s of a $BUDGET s budget"
cat "$STATUS"
echo
[ -f "$RESULTS/kernels.log" ] && sed -n '/^what /,$p' "$RESULTS/kernels.log"
[ -f "$RESULTS/generate.log" ] && sed -n '/^model /,/^reproduce/p' "$RESULTS/generate.log"
[ -f "$RESULTS/step.log" ] && sed -n '/^GRPO step/,$p' "$RESULTS/step.log"
[ -f "$RESULTS/groups.log" ] && sed -n '/^one group/,/^reproduce/p' "$RESULTS/groups.log"
exit 0
