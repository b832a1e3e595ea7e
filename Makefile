# Two commands on a fresh clone:  `make demo`  (main job)  and  `make test`  (whole suite).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
export OMP_NUM_THREADS ?= 1
export WANDB_MODE ?= offline
export NO_MKDOCS_2_WARNING := 1

.PHONY: setup demo test test-fast test-exit test-gpu docs clean

setup: $(VENV)/.installed

# torch goes in first and alone: on a machine without a GPU the CPU build (a bare `torch` requirement
# would pull a multi-GB CUDA build); on a GPU machine whatever CUDA torch the venv already has is kept.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then $(PIP) install "torch>=2.3"; \
	  else $(PIP) install "torch==2.13.0" $${TORCH_CPU_INDEX:+--index-url $$TORCH_CPU_INDEX}; fi; fi
	$(PIP) install -e ".[dev,hf,ft]"
	touch $@

demo: setup
	rm -rf runs/demo
	$(VENV)/bin/gradsync fit --recipe digits --strategy sync --devices 2 --accelerator cpu \
	  --max-epochs 8 --batch-size 32 --output-dir runs/demo

test: setup
	$(PY) -m pytest -q tests
	$(VENV)/bin/mkdocs build --strict -q -d /tmp/gradsync-site

# The GPU path on one CUDA device (skipped without one): NCCL, codecs on CUDA, resume; < 5 minutes.
test-gpu: setup
	$(PY) -m pytest -q tests/gpu

# Twenty plain-Lightning scripts per strategy, each must exit 0 (a soak of the exit-time teardown).
test-exit: setup
	GRADSYNC_EXIT_RUNS=20 $(PY) -m pytest -q tests/cli/test_plain_trainer_exit.py

test-fast: setup
	$(PY) -m pytest -q tests/unit

# The build generates the CLI reference itself; the checked-in copy (for reading the docs on GitHub) is
# refreshed here, and tests/docs/test_cli_reference.py fails when it is stale.
docs: setup
	$(PY) scripts/cli_reference.py -o docs/reference/cli.md
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf runs site .pytest_cache
