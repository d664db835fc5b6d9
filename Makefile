# eagle-train: the front door. `make help` lists every target.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU_VERSION ?= 2.13.0
ARGS ?=

.DEFAULT_GOAL := help

.PHONY: help setup test test-fast lint extract train eval demo bench clean

help: ## List every target with one line each
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-11s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	@# A GPU user's own torch is kept; without one, take the CPU build (not the multi-GB CUDA one).
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_CPU_VERSION)" || \
		$(PIP) install -q "torch==$(TORCH_CPU_VERSION)" --index-url https://download.pytorch.org/whl/cpu
	$(PIP) install -q -e ".[dev,deepspeed,wandb]"
	touch $@

setup: $(VENV)/.installed ## Create .venv with CPU torch (unless torch is there) and the package + extras

test: setup ## Run every test that needs no GPU (slow end-to-end ones too)
	$(PY) -m pytest -q -m "not gpu" $(ARGS)

test-fast: setup ## Quick tier: unit tests only (skips `slow`)
	$(PY) -m pytest -q -m "not gpu and not slow" $(ARGS)

lint: setup ## ruff over the package, scripts and tests
	$(PY) -m ruff check eagle_train scripts tests train.py

extract: setup ## Extract target features on the embedded default (override with ARGS="target.path=... data.path=...")
	$(PY) -m eagle_train.extract $(ARGS)

bench: setup ## Run every benchmark script (figures printed and saved under bench_results/)
	@set -e; for s in scripts/bench_*.py; do echo "== $$s"; $(PY) $$s; done

clean: ## Remove runs, caches and benchmark results (keeps .venv)
	rm -rf runs outputs bench_results .pytest_cache .ruff_cache
