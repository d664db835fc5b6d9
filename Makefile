# eagle-train: the front door. `make help` lists every target.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU_VERSION ?= 2.13.0
ARGS ?=
EXPERIMENT ?= tiny_cpu

.DEFAULT_GOAL := help

.PHONY: help setup test test-fast lint demo data regenerate extract extract-mp train eval export bench clean

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

lint: setup ## ruff check and ruff format --check over the package, scripts and tests
	$(PY) -m ruff check eagle_train scripts tests train.py
	$(PY) -m ruff format --check eagle_train scripts tests train.py

demo: setup ## The main job: the whole pipeline on the embedded stories260K, report table at the end (~8 min on 2 cores; EXPERIMENT=... for GPU presets)
	$(PY) -m eagle_train.pipeline experiment=$(EXPERIMENT) $(ARGS)

data: setup ## Rebuild the shipped TinyStories conversations (data/tinystories/tinystories_sharegpt.jsonl)
	$(PY) -m eagle_train.data.tinystories out=data/tinystories/tinystories_sharegpt.jsonl

regenerate: setup ## The target writes the replies itself: ARGS="data=sharegpt_prompts out=FILE.jsonl"
	$(PY) -m eagle_train.regenerate $(ARGS)

extract: setup ## Extract target features (ARGS="target.path=... data.path=... out_dir=...")
	$(PY) -m eagle_train.extract $(ARGS)

extract-mp: setup ## Extract with 2 CPU processes (gloo); on GPUs: accelerate launch --num_processes N -m eagle_train.extract
	ACCELERATE_USE_CPU=true $(VENV)/bin/accelerate launch --multi_gpu --num_processes 2 -m eagle_train.extract $(ARGS)

train: setup ## Train the draft head: ARGS="features=DIR out_dir=DIR [+recipe=stories260k_cpu] [max_steps=N]"
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/accelerate launch --config_file conf/accelerate/single.yaml train.py $(ARGS)

eval: setup ## Evaluate a head: tau, acceptance, speedup, greedy identity, plots (ARGS="draft.path=DIR bench=mt_bench")
	$(PY) -m eagle_train.evaluate $(ARGS)

export: setup ## Export a trained head for a server: ARGS="ckpt=DIR format=vllm|sglang|eagle out=DIR"
	$(PY) -m eagle_train.export $(ARGS)

bench: setup ## Run every benchmark script (figures printed and saved under bench_results/)
	@set -e; for s in scripts/bench_*.py; do echo "== $$s"; $(PY) $$s; done

clean: ## Remove runs, caches and benchmark results (keeps .venv)
	rm -rf runs outputs bench_results .pytest_cache .ruff_cache
