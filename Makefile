# `make test` and `make demo` build everything from nothing: a venv, pinned torch, the package.
# TORCH picks the tested torch release: 2.13.0 (the default, in .venv), 2.14.1 or 2.15.0
# (each in its own venv, .venv-torch2.14.1, ...): `make test TORCH=2.15.0`.
PYTHON ?= python3
TESTED_TORCH := 2.13.0 2.14.1 2.15.0
TORCH ?= 2.13.0
ifeq ($(filter $(TORCH),$(TESTED_TORCH)),)
$(error TORCH=$(TORCH) is not a tested torch release (one of: $(TESTED_TORCH)))
endif
VENV := $(if $(filter 2.13.0,$(TORCH)),.venv,.venv-torch$(TORCH))
PY := $(VENV)/bin/python
# What the package and the demo need (torch, shardwrap), then the test extra on top of it.
BASE_STAMP := $(VENV)/.installed-base
STAMP := $(VENV)/.installed
# What `make test` runs: the whole suite unless told otherwise (CI runs a subset on the
# newer torch releases: see .ci/run).
TESTS ?= tests
# Ranks for the demo: one per GPU when CUDA is there, else 2 CPU ranks (override: NPROC=4).
NPROC ?=

.PHONY: test demo lint format unit dist bench clean

# pyproject.toml declares the torch range users may have; each venv pins one exact release
# through its constraints file. pip takes it as PIP_CONSTRAINT, which replaces (not adds
# to) any constraint a pip configuration file sets, so a machine-wide cap on torch neither
# blocks a tested release nor lets another in, and a fresh machine resolves the same.
CONSTRAINTS := constraints/torch-$(TORCH).txt
# DeepSpeed (a test extra) installs without compiled ops and looks for no GPU.
DS_ENV := DS_BUILD_OPS=0 DS_ACCELERATOR=cpu
# torchtitan's FSDP2 code is a client the tests run (installed with --no-deps, see $(STAMP)).
TORCHTITAN := torchtitan==0.3.0
PIP := PIP_CONSTRAINT=$(CURDIR)/$(CONSTRAINTS) $(DS_ENV) $(PY) -m pip install -q

$(BASE_STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip setuptools wheel
	# torch first and pinned, so no later resolution can pull a CUDA build of another one.
	$(PIP) torch==$(TORCH)
	$(PIP) -e .
	touch $@

$(STAMP): $(BASE_STAMP)
	# DeepSpeed's setup imports torch: build it against the torch just installed.
	$(PIP) --no-build-isolation deepspeed==0.19.8
	$(PIP) -e '.[test]'
	# torchtitan without the requirements of its trainer (pyproject's test extra says why).
	$(PIP) --no-deps $(TORCHTITAN)
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check shardwrap tests benchmarks examples
	$(VENV)/bin/ruff format --check shardwrap tests benchmarks examples

format: $(STAMP)
	$(VENV)/bin/ruff format shardwrap tests benchmarks examples
	$(VENV)/bin/ruff check --fix shardwrap tests benchmarks examples

# Two pytest workers (pytest-xdist), each with its own rank pools, a whole test file at a
# time (a file's pooled ranks and module fixtures stay in one worker): most tests wait on
# rank start-up, gloo and process exits more than they compute, so one stream left a core
# idle (load average about 1.2 over a quiet serial run). PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

test: lint
	DS_ACCELERATOR=cpu $(PY) -m pytest $(XDIST) $(TESTS)

# Torch and shardwrap only: the demo needs none of the test extra.
demo: $(BASE_STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node \
	  $(or $(NPROC),$$($(PY) -c 'import torch; print(torch.cuda.device_count() or 2)')) \
	  examples/train_gpt.py

# The chart (matplotlib) is the bench extra; the DeepSpeed peer comes with the test extra.
bench: $(STAMP)
	$(PIP) -e '.[test,bench]'
	DS_ACCELERATOR=cpu $(PY) benchmarks/bench_step.py

clean:
	rm -rf .venv .venv-torch* .pytest_cache .ruff_cache .hypothesis
