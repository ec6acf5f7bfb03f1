#!/usr/bin/env bash
# One GPU run: checks and times everything nanogrpo cares about, in one go, within a time budget.
#
#   bash bench/gpu_check.sh RESULTS_DIR [BUDGET_SECONDS]      # default budget 450 s (under 8 minutes)
#   bash bench/gpu_check.sh --cpu-smoke RESULTS_DIR           # tiny shapes on the CPU: checks the script
#
# Works offline on a machine with torch + triton installed: the checkout runs from PYTHONPATH (no pip
# install needed). Python wheels missing there are installed offline from .whl/ when that folder exists:
# rapidfuzz (the LCS baseline), liger-kernel (the log-prob comparison; no deps: it would pull torch), and
# for the model steps safetensors, tokenizers, transformers, tyro, tqdm, numpy with their dependencies:
#   W="--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl"
#   pip download $W --no-deps liger-kernel
#   pip download $W rapidfuzz safetensors tokenizers transformers tyro tqdm numpy
# Steps in the order that makes a blocking failure cheap: what would stop a user's first run comes first.
# Each runs under its own timeout and the global budget; a step that fails does not stop the others, and
# one that cannot run says why in the table.
#   1. the machine: GPU, driver, versions                                   -> env.txt
#   2. train.py tiny on the device, two steps each: GRPO, GRPO with dynamic sampling, PPO, and a bf16 full
#      fine-tune with KL in the loss (the sampler under autocast)          -> train-*.log, train-*/
#   3. the kernel, attention and decode-loop tests on CUDA, all of them (no -x: the decode loops replayed
#      as CUDA graphs give the eager sampler's tokens)                      -> tests.log
#   4. a random model of a real shape ($GPU_MODEL, default random:qwen2.5-1.5b), built once into the
#      nanogrpo cache: no download (needs safetensors; tokenizers for its tokenizer)  -> model.log
#   5. bench/generate.py: the decode step with LoRA adapters as training samples, at batch 1, 64 and 128:
#      ms/step, kernels per step and time per launch, share of the HBM roofline  -> generate.json, .log;
#      then eager against the step replayed as a CUDA graph (--sampling.decode graph) at the same batches
#      -> generate-graph.*, and against the compiled step, alone and as a graph, at batch 64 -> generate-compiled.*
#   6. bench/attention.py: which SDPA backend training-shaped (padded, GQA) attention gets  -> attention.log
#   7. bench/step.py --plan: one LoRA GRPO step on that model (time split, sampler-trainer gap) with
#      torch.cuda.max_memory_allocated next to nanogrpo.model.memory's plan for the same run  -> step.json, .log
#   8. bench/length_groups.py: the training forward + backward with the completions in length groups
#      against one group, and the fixed cost of a group                   -> groups.log
#   9. bench/kernel_timings.py: ceilings, log-probs, LCS, cosine with what the budget has left  -> kernels.json
# Override the model steps' flags with GENERATE_ARGS / STEP_ARGS / GROUPS_ARGS; run only some steps with
# GPU_STEPS="model generate-graph" (the others are listed as skipped). The last thing printed is the table;
# RESULTS_DIR holds the full numbers.
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE=1; shift; fi
RESULTS=${1:?usage: bash bench/gpu_check.sh [--cpu-smoke] RESULTS_DIR [BUDGET_SECONDS]}
BUDGET=${2:-450}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && [ "$SMOKE" = 1 ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
START=$(date +%s)
STATUS="$RESULTS/status.txt"
: >"$STATUS"

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME CAP_SECONDS COMMAND...: run under min(CAP, time left), log its output, record rc and seconds
step() {
    local name=$1 cap=$(($2 * CAP_SCALE))
    shift 2
    if [ -n "${GPU_STEPS:-}" ] && [[ " $GPU_STEPS " != *" $name "* ]]; then
        skip "$name" "not in GPU_STEPS"
        return
    fi
    local t=$(left)
    [ "$cap" -lt "$t" ] && t=$cap
    if [ "$t" -le 5 ]; then
        printf '%-14s %-8s %s\n' "$name" "skipped" "time budget spent" >>"$STATUS"
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
    printf '%-14s %-8s %ss%s\n' "$name" "$state" "$(($(date +%s) - t0))" "$why" >>"$STATUS"
}

skip() { printf '%-14s %-8s %s\n' "$1" skipped "$2" >>"$STATUS"; }

# missing PYTHON_MODULES...: prints the ones that cannot be imported (empty when all are there)
missing() { $PY -c 'import importlib.util as u, sys; print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' "$@"; }

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
    for m in rapidfuzz liger_kernel flash_attn tyro transformers tokenizers safetensors numpy tqdm; do $PY -c "import $m; print('$m', getattr($m, '__version__', 'ok'))" 2>/dev/null || echo "$m missing"; done
    nproc
} | tee "$RESULTS/env.txt"

CAP_SCALE=1
if [ "$SMOKE" = 1 ]; then
    CAP_SCALE=3 # a 2-core machine running other work: the caps are for an H200
    DEV=cpu
    # a narrow random Qwen2 shape (biases, GQA) with the tiny tokenizer's vocabulary: the smoke checks that the
    # benches run; the H200 run uses the real width
    MODEL=${GPU_MODEL:-random:qwen2.5-0.5b:layers=2,hidden_size=128,intermediate_size=256,num_attention_heads=4,num_key_value_heads=2,head_dim=32,vocab_size=1024}
    GENERATE_ARGS=${GENERATE_ARGS:---model $MODEL --device cpu --dtype float32 --threads 1 --prompts 2 --group 2 --new-tokens 4 --roofline 1,4 --lora-r 4 --peak-gbs 20 --warmup 0 --repeats 1 --only nanogrpo --json $RESULTS/generate.json}
    STEP_ARGS=${STEP_ARGS:---model $MODEL --side nanogrpo --device cpu --threads 1 --prompts 2 --group 2 --new-tokens 4 --filler-words 10 --micro-batch 2 --checkpointing --steps 1 --warmup 0 --plan --json $RESULTS/step.json}
    GROUPS_ARGS=${GROUPS_ARGS:---model $MODEL --device cpu --prompts 2 --group 4 --prompt-tokens 8 --lengths 2,3,2,4 --long 12 --repeat 1}
    ATTN_ARGS="--cpu-smoke"
    KERNEL_ARGS="--cpu-smoke"
else
    DEV=cuda
    # a random Qwen2.5-1.5B: decode vs the roofline with LoRA at batch 1, 64 and 128 (P=16 x G=8), one GRPO
    # step against the memory plan (P=8 x G=8, ~250-token prompts + 256 new tokens, micro-batch 16,
    # checkpointing on), length groups on short completions (8-40 tokens) with one 256-token straggler
    MODEL=${GPU_MODEL:-random:qwen2.5-1.5b}
    GENERATE_ARGS=${GENERATE_ARGS:---model $MODEL --device cuda --prompts 4 --group 8 --new-tokens 64 --roofline 1,64,128 --lora-r 16 --warmup 1 --repeats 2 --only nanogrpo --json $RESULTS/generate.json}
    STEP_ARGS=${STEP_ARGS:---model $MODEL --side nanogrpo --device cuda --prompts 8 --group 8 --new-tokens 256 --filler-words 70 --micro-batch 16 --checkpointing --steps 1 --warmup 1 --plan --json $RESULTS/step.json}
    GROUPS_ARGS=${GROUPS_ARGS:---model $MODEL --device cuda --dtype bfloat16 --prompts 8 --group 8 --prompt-tokens 250 --lengths 8,16,12,40,8,24,16,12 --long 256 --repeat 2}
    ATTN_ARGS="--device cuda"
    KERNEL_ARGS=""
fi

# 2. a user's first run: train.py on the device, each stage that samples, two steps
miss=$(missing transformers tokenizers tyro tqdm numpy safetensors)
TRAIN="$PY train.py tiny --model.device $DEV --steps 2 --log-samples-every 0 --no-plots"
if [ -n "$miss" ]; then
    for s in train-grpo train-dynamic train-ppo train-full; do skip $s "train.py needs $miss (wheels in .whl/: see the header)"; done
else
    step train-grpo 60 $TRAIN --out-dir "$RESULTS/train-grpo"
    step train-dynamic 45 $TRAIN --grpo.dynamic-sampling --out-dir "$RESULTS/train-dynamic"
    step train-ppo 45 $TRAIN --algo ppo --out-dir "$RESULTS/train-ppo"
    if [ "$SMOKE" = 1 ]; then FULL_DTYPE=float32; else FULL_DTYPE=bfloat16; fi
    step train-full 45 $TRAIN --lora.r 0 --model.dtype $FULL_DTYPE --grpo.kl-placement loss --grpo.beta 0.04 --out-dir "$RESULTS/train-full"
fi

# 3. correctness on CUDA before any timing: a wrong kernel's timings are worthless; every test runs
if [ "$SMOKE" = 1 ]; then
    skip tests "the CPU suite runs them (make test)"
else
    step tests 150 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_logprobs.py tests/test_kernels_lcs.py \
        tests/test_kernels_cosine.py tests/test_attention.py tests/test_sampling_static.py
fi

# 4.-8. the model steps, each skipped with the reason when a package it needs is missing
miss=$(missing safetensors)
if [ -n "$miss" ]; then
    for s in model generate generate-graph generate-compiled attention step groups; do
        skip $s "needs $miss (nanogrpo loads and saves weights with it; wheel in .whl/)"
    done
else
    step model 60 $PY -m nanogrpo.model.zoo "$MODEL"
    step generate 90 $PY bench/generate.py $GENERATE_ARGS
    if [ "$SMOKE" = 1 ]; then
        skip generate-graph "a CUDA graph needs a GPU (tests/test_sampling_static.py checks its loop on the CPU)"
        skip generate-compiled "tests/test_sampling_compiled.py compiles the step on the CPU"
    else  # the decode loops of --sampling.decode side by side; a compile timed apart
        step generate-graph 120 $PY bench/generate.py --model $MODEL --device cuda --prompts 4 --group 8 \
            --new-tokens 64 --roofline 1,64,128 --lora-r 16 --warmup 1 --repeats 2 --only nanogrpo \
            --decode eager,graph --json $RESULTS/generate-graph.json
        step generate-compiled 180 $PY bench/generate.py --model $MODEL --device cuda --prompts 8 --group 8 \
            --new-tokens 64 --roofline 64 --lora-r 16 --warmup 1 --repeats 2 --only nanogrpo \
            --decode eager,compiled,compiled-graph --json $RESULTS/generate-compiled.json
    fi
    if [ -f bench/attention.py ]; then step attention 40 $PY bench/attention.py $ATTN_ARGS; else skip attention "bench/attention.py is missing"; fi
    miss=$(missing transformers tokenizers tyro tqdm numpy)
    if [ -n "$miss" ]; then
        skip step "train.py needs $miss (wheels in .whl/: see the header)"
    else
        step step 90 $PY bench/step.py $STEP_ARGS
    fi
    step groups 60 $PY bench/length_groups.py $GROUPS_ARGS
fi

# 9. the kernels, with what is left (40 s of it kept for the table and the bench's own wrap-up)
step kernels $(($(left) - 10)) $PY bench/kernel_timings.py $KERNEL_ARGS --out "$RESULTS" --budget-s $(($(left) - 40))

# the table, last
echo
echo "== nanogrpo gpu_check: $(head -1 "$RESULTS/env.txt"), $(($(date +%s) - START)) s of a $BUDGET s budget"
cat "$STATUS"
echo
for s in train-grpo train-dynamic train-ppo train-full; do
    [ -f "$RESULTS/$s.log" ] && echo "$s: $(tr '\r' '\n' <"$RESULTS/$s.log" | grep '^step 2 |' | tail -1)"
done
[ -f "$RESULTS/tests.log" ] && echo "tests: $(grep -E '(passed|failed|error)' "$RESULTS/tests.log" | tail -1)"
[ -f "$RESULTS/generate.log" ] && sed -n '/^model /,/^reproduce/p' "$RESULTS/generate.log"
[ -f "$RESULTS/generate-graph.log" ] && sed -n '/^model /,/^reproduce/p' "$RESULTS/generate-graph.log"
[ -f "$RESULTS/generate-compiled.log" ] && sed -n '/^model /,/^reproduce/p' "$RESULTS/generate-compiled.log"
[ -f "$RESULTS/attention.log" ] && sed -n '/^attention /,$p' "$RESULTS/attention.log"
[ -f "$RESULTS/step.log" ] && sed -n '/^GRPO step/,$p' "$RESULTS/step.log"
[ -f "$RESULTS/groups.log" ] && sed -n '/^one group/,/^reproduce/p' "$RESULTS/groups.log"
[ -f "$RESULTS/kernels.log" ] && sed -n '/^what /,$p' "$RESULTS/kernels.log"
exit 0
