# Two commands from a fresh clone (nothing installed but Python >= 3.10):
#   make demo    set up .venv, run the demo on an embedded S3 server
#   make test    set up .venv with the test extras, run the test suite
# `make` alone prints this list (the default goal is `help`, so nothing is installed by accident).
# Set-up steps leave stamp files in the venv and are skipped when already done; they rerun when pyproject.toml or
# this Makefile changes. `make clean` removes the venv; CI (.ci/run) starts each run from a fresh one.

PYTHON ?= python3
VENV ?= .venv
NEMO_VENV ?= .venv-nemo
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
.PHONY: help demo test lint bench venv clean nemo-check megatron-core

help:  ## list the targets
	@echo "Targets (variables: PYTHON=$(PYTHON) VENV=$(VENV) TORCH=$(TORCH)):"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  make \1\t\2/' | expand -t 20

demo: $(VENV)/.stamp-demo  ## set up the venv (pip, torch, ".[demo]"), run the demo on an embedded S3 server (DEMO_ARGS=...)
	$(RUN) $(BIN)/s3-checkpoint-io demo $(DEMO_ARGS)

test: $(VENV)/.stamp-test  ## set up the venv (pip, torch, ".[all,test]"), run the tests (PYTEST_ARGS=..., TEST_WORKERS=2)
	$(RUN) $(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

lint: $(VENV)/.stamp-test  ## ruff check .
	$(BIN)/ruff check .

nemo-check: $(NEMO_VENV)/.stamp-nemo  ## by hand, not CI: tests/test_nemo.py with the real NeMo 2.7.3 in its own venv (.venv-nemo)
	S3CKPT_TEST_BACKENDS=moto S3CKPT_TEST_REQUIRE_NEMO=1 $(NEMO_VENV)/bin/python -m pytest -rs tests/test_nemo.py $(PYTEST_ARGS)

bench: $(VENV)/.stamp-bench  ## the checkpoint benchmark against SeaweedFS, table + chart (BENCH_ARGS=...)
	$(RUN) $(BIN)/python benchmarks/bench_checkpoint.py $(BENCH_ARGS)

venv: $(VENV)/.stamp-torch  ## only create the venv, with an upgraded pip and torch

clean:  ## remove the venv, build outputs and caches
	rm -rf $(VENV) $(NEMO_VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
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
# `make megatron-core MEGATRON_CORE=megatron-core==0.18.2` puts another release in an existing venv (CI's second
# environment has NeMo 2.x's).
MEGATRON_CORE ?= megatron-core==0.19.2
MEGATRON_CORE_FLAGS := -q --no-deps --ignore-requires-python
INSTALL_MEGATRON_CORE = $(PIP) install $(MEGATRON_CORE_FLAGS) $(MEGATRON_CORE)

$(VENV)/.stamp-test: $(VENV)/.stamp-torch pyproject.toml
	$(PIP) install -q -e ".[all,test]"
	$(INSTALL_MEGATRON_CORE)
	touch $@

megatron-core:
	$(INSTALL_MEGATRON_CORE)

$(VENV)/.stamp-bench: $(VENV)/.stamp-test
	$(PIP) install -q -e ".[all,test,bench]"
	touch $@

# NeMo 2.x for tests/test_nemo.py, by hand (`make nemo-check`), never in CI's venv: nemo-toolkit declares far more than
# its `nemo.lightning` imports, and pins lightning <= 2.4 (the test venv has a newer one). NeMo comes without its
# dependencies; NEMO_IMPORT_DEPS are the ones importing nemo.lightning (MegatronCheckpointIO, MegatronStrategy,
# AsyncFinalizableCheckpointIO) needs, found one ImportError at a time. Every install names $(TORCH), so pip never
# resolves an unpinned torch. About 2 minutes and 1.5 GB (torch's CPU wheel is most of it).
NEMO ?= nemo-toolkit==2.7.3
NEMO_MEGATRON_CORE ?= megatron-core==0.18.2
NEMO_LIGHTNING ?= lightning==2.4.0
NEMO_IMPORT_DEPS ?= python-dateutil fiddle cloudpickle huggingface_hub wrapt omegaconf hydra-core wget onnx \
	nv-one-logger-pytorch-lightning-integration
NEMO_TEST_DEPS ?= "boto3[crt]>=1.36" "s3fs>=2024.12.0" "moto[server]>=5.1" "pytest>=8"
NEMO_PIP := $(NEMO_VENV)/bin/python -m pip

$(NEMO_VENV)/.stamp-nemo: Makefile
	$(PYTHON) -m venv $(NEMO_VENV)
	$(NEMO_PIP) install -q --upgrade pip
	$(NEMO_PIP) install -q $(TORCH)
	$(NEMO_PIP) install $(MEGATRON_CORE_FLAGS) $(NEMO_MEGATRON_CORE)
	$(NEMO_PIP) install -q $(TORCH) numpy packaging psutil $(NEMO_LIGHTNING)
	$(NEMO_PIP) install -q --no-deps $(NEMO)
	$(NEMO_PIP) install -q $(TORCH) $(NEMO_LIGHTNING) $(NEMO_IMPORT_DEPS) $(NEMO_TEST_DEPS)
	touch $@
