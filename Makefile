# Two commands from a fresh clone (nothing installed but Python >= 3.10):
#   make demo    set up .venv, run the demo on an embedded S3 server
#   make test    set up .venv with the test extras, run the test suite
# `make` alone prints this list (the default goal is `help`, so nothing is installed by accident).
# Set-up steps leave stamp files in the venv and are skipped when already done; they rerun when pyproject.toml or
# this Makefile changes. `make clean` removes the venv; CI (.ci/run) starts each run from a fresh one.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
# Test processes (pytest-xdist); 0 runs the suite in this one process. The suite waits on servers and subprocesses
# more than it computes, so two workers halve its time even on two cores.
TEST_WORKERS ?= 2
DEMO_ARGS ?=
BENCH_ARGS ?= --sizes 1024 --reps 3

BIN := $(VENV)/bin
# The venv's bin first on PATH, as after `. .venv/bin/activate` (tests start `weed` and `s3-checkpoint-io`).
RUN := PATH="$(abspath $(BIN)):$$PATH"
# The index's torch is pinned before the package is installed, so pip never resolves an unpinned torch.
PIP := $(BIN)/python -m pip

.DEFAULT_GOAL := help
.PHONY: help demo test lint bench venv clean

help:  ## list the targets
	@echo "Targets (variables: PYTHON=$(PYTHON) VENV=$(VENV) TORCH=$(TORCH)):"
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z]+):.*## (.*)/  make \1\t\2/' | expand -t 16

demo: $(VENV)/.stamp-demo  ## set up the venv (pip, torch, ".[demo]"), run the demo on an embedded S3 server (DEMO_ARGS=...)
	$(RUN) $(BIN)/s3-checkpoint-io demo $(DEMO_ARGS)

test: $(VENV)/.stamp-test  ## set up the venv (pip, torch, ".[all,test]"), run the tests (PYTEST_ARGS=..., TEST_WORKERS=2)
	$(RUN) $(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

lint: $(VENV)/.stamp-test  ## ruff check .
	$(BIN)/ruff check .

bench: $(VENV)/.stamp-bench  ## the checkpoint benchmark against SeaweedFS, table + chart (BENCH_ARGS=...)
	$(RUN) $(BIN)/python benchmarks/bench_checkpoint.py $(BENCH_ARGS)

venv: $(VENV)/.stamp-torch  ## only create the venv, with an upgraded pip and torch

clean:  ## remove the venv, build outputs and caches
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -path './.*' -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# An older pip (23.x, as some distributions ship) cannot resolve the dependencies: it is upgraded first.
$(VENV)/.stamp-torch: Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
		{ echo "error: $(PYTHON) is older than Python 3.10; run e.g. make demo PYTHON=python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	touch $@

# The demo is installed as a user would (not editable), again whenever a module changes.
$(VENV)/.stamp-demo: $(VENV)/.stamp-torch pyproject.toml $(wildcard *.py)
	$(PIP) install -q ".[demo]"
	touch $@

# megatron-core for the `megatron` tests (s3_mcore): without its dependencies, which reach far beyond dist_checkpointing
# (numpy and packaging come with the test extras); its wheels declare Python >= 3.12 though they run on 3.10+.
MEGATRON_CORE ?= megatron-core==0.19.2

$(VENV)/.stamp-test: $(VENV)/.stamp-torch pyproject.toml
	$(PIP) install -q -e ".[all,test]"
	$(PIP) install -q --no-deps --ignore-requires-python $(MEGATRON_CORE)
	touch $@

$(VENV)/.stamp-bench: $(VENV)/.stamp-test
	$(PIP) install -q -e ".[all,test,bench]"
	touch $@
