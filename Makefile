# `make test` and `make demo` build everything from nothing: .venv, pinned torch, the package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
# Ranks for the demo: one per GPU when CUDA is there, else 2 CPU ranks (override: NPROC=4).
NPROC ?=

.PHONY: test demo lint format unit dist bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned, so no later resolution can pull a CUDA build.
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check shardwrap tests benchmarks examples
	$(VENV)/bin/ruff format --check shardwrap tests benchmarks examples

format: $(STAMP)
	$(VENV)/bin/ruff format shardwrap tests benchmarks examples
	$(VENV)/bin/ruff check --fix shardwrap tests benchmarks examples

test: lint
	$(PY) -m pytest tests

demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node \
	  $(or $(NPROC),$$($(PY) -c 'import torch; print(torch.cuda.device_count() or 2)')) \
	  examples/train_gpt.py

# The peers (DeepSpeed without compiled ops, matplotlib) are a benchmark extra only.
bench: $(STAMP)
	DS_BUILD_OPS=0 DS_ACCELERATOR=cpu $(PY) -m pip install -q -e '.[bench]'
	DS_ACCELERATOR=cpu $(PY) benchmarks/bench_step.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
