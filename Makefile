# `make test` and `make demo` build everything from nothing: .venv, pinned torch, the package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Keep equal to constraints.txt.
TORCH_VERSION := 2.13.0
# Ranks for the demo: one per GPU when CUDA is there, else 2 CPU ranks (override: NPROC=4).
NPROC ?=

.PHONY: test demo lint format unit dist bench clean

# pyproject.toml declares the torch range users may have; this .venv pins the exact release.
CONSTRAINTS := constraints.txt
# DeepSpeed (a test extra) installs without compiled ops and looks for no GPU.
DS_ENV := DS_BUILD_OPS=0 DS_ACCELERATOR=cpu

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# torch first and pinned, so no later resolution can pull a CUDA build; every later
	# install gets the same pin through constraints.txt, so none can replace it.
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	# DeepSpeed's setup imports torch: build it against the torch just installed.
	$(DS_ENV) $(PY) -m pip install -q -c $(CONSTRAINTS) --no-build-isolation deepspeed==0.19.8
	$(DS_ENV) $(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check shardwrap tests benchmarks examples
	$(VENV)/bin/ruff format --check shardwrap tests benchmarks examples

format: $(STAMP)
	$(VENV)/bin/ruff format shardwrap tests benchmarks examples
	$(VENV)/bin/ruff check --fix shardwrap tests benchmarks examples

test: lint
	DS_ACCELERATOR=cpu $(PY) -m pytest tests

demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node \
	  $(or $(NPROC),$$($(PY) -c 'import torch; print(torch.cuda.device_count() or 2)')) \
	  examples/train_gpt.py

# The chart (matplotlib) is the bench extra; the DeepSpeed peer comes with the test extra.
bench: $(STAMP)
	$(DS_ENV) $(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[test,bench]'
	DS_ACCELERATOR=cpu $(PY) benchmarks/bench_step.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
