"""What the engine tests share: vLLM's environment (skipped without it), the head_dim-32 stories260K, a
small head trained here (reused from runs/engine_tests/ on a rerun), its exports, and the prompts.

Everything is written under runs/engine_tests/ inside the repository (gitignored): nothing is cached
outside it, so a fresh clone trains each head once (TRAIN_STEPS steps). `make test-engines` runs two pytest
workers (whole files each): what several files share (the head_dim-32 target, the trained heads) is built
by the first worker that needs it while the others wait for it (`shared`), never twice at once."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from eagle_train.cli import compose
from eagle_train.config.base import to_schema
from eagle_train.config.train import TrainConfig
from eagle_train.engines.vllm_engine import DEFAULT_PYTHON
from eagle_train.interop.reexpress import widen_model_dir
from eagle_train.modeling.head_checkpoint import load_head
from eagle_train.modeling.target import load_target
from eagle_train.runtime.output_lock import OutputLock
from tests.conftest import REPO_ROOT

WORK = REPO_ROOT / "runs" / "engine_tests"
HEAD_DIM = 32  # vLLM's CPU attention: 32, 64, 80, 96, 112, 128, ...
TRAIN_STEPS = 400  # each head's: enough for vLLM and the built-in chain to accept at every position compared
MAX_NEW_TOKENS = 64
# The first sentences of ten TinyStories-like prompts, tokenized by the target at session start.
PROMPT_TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "One day, a big dog saw a red ball in the park.",
    "Tom and his mom went to the store to buy some food.",
    "The sun was shining and the birds were singing.",
    "Once upon a time, there was a small cat who liked to play.",
    "Ben had a new toy car that he loved very much.",
    "It was a cold winter day and the snow was falling.",
    "Sara wanted to help her dad in the garden.",
    "A little bird lived in a tall tree near the river.",
    "Max was sad because he lost his favorite hat.",
]


@pytest.fixture(scope="session")
def engine_python() -> Path:
    python = Path(os.environ.get("EAGLE_TRAIN_VLLM_PYTHON", REPO_ROOT / DEFAULT_PYTHON))
    if not os.access(python, os.X_OK):
        pytest.skip(
            f"vLLM's environment is absent ({python}): `make test-engines` builds .venv-vllm and runs these"
        )
    return python


@contextmanager
def shared(name: str) -> Iterator[None]:
    """Held while one pytest worker builds or checks runs/engine_tests/NAME; another worker asking for it
    waits, then finds it built."""
    lock = OutputLock(WORK / f"{name}.shared", "engine tests").acquire(wait=True)
    try:
        yield
    finally:
        lock.release()


@pytest.fixture(scope="session")
def wide_target_dir(target_cfg, engine_python) -> Path:
    """stories260K re-expressed with head_dim 32 (rebuilt once per test run: a second; the run's workers
    share it)."""
    out = WORK / f"stories260K-hd{HEAD_DIM}"
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
    stamp = WORK / f"{out.name}.run"
    with shared(out.name):
        if run is None or not stamp.is_file() or stamp.read_text() != run or not out.is_dir():
            widen_model_dir(target_cfg.path, out, HEAD_DIM)
            if run is not None:
                stamp.write_text(run)
    return out


@pytest.fixture(scope="session")
def wide_target(target_cfg, wide_target_dir):
    return load_target(
        dataclasses.replace(target_cfg, name=f"stories260k-hd{HEAD_DIM}", path=str(wide_target_dir))
    )


def train_once(name: str, steps: int, overrides: list[str]) -> Path:
    """runs/engine_tests/<name>/final: a small head trained online on TinyStories conversations for
    `steps` steps with `overrides`; an earlier session's finished head is reused."""
    from eagle_train.train import run

    out = WORK / name
    final = out / "final"
    with shared(name):
        done = (final / "config.json").is_file() and read_json(final / "config.json")["eagle_train"].get(
            "step"
        ) == steps
        if not done:
            shutil.rmtree(out, ignore_errors=True)
            base = ["+recipe=stories260k_cpu", "data.source=online", "data.limit=3000"]
            base += [f"max_steps={steps}", "eval_every=0", "save_every=0", "progress=false", f"out_dir={out}"]
            run(to_schema(compose("train", overrides=[*base, *overrides]), TrainConfig))
    return final


@pytest.fixture(scope="session")
def trained_ckpt(engine_python) -> Path:
    """A small head trained online on TinyStories conversations (fc bias on, so the export folds it)."""
    return train_once("head", TRAIN_STEPS, [])


def loaded_head(ckpt: Path, target):
    """The head of checkpoint `ckpt` holding `target`'s frozen weights, in eval mode."""
    head, _ = load_head(ckpt)
    head.share_target_weights(target)
    return head.eval()


@pytest.fixture(scope="session")
def trained_head(trained_ckpt, target):
    return loaded_head(trained_ckpt, target)


@pytest.fixture(scope="session")
def prompts(target) -> list[list[int]]:
    """Prompt token ids (BOS + text), the same for every engine."""
    return [target.tokenizer.encode(text) for text in PROMPT_TEXTS]


def fresh_dir(name: str) -> Path:
    path = WORK / name
    shutil.rmtree(path, ignore_errors=True)
    return path


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def run_in_vllm(name: str, runs: dict, engine_python, wide_target_dir, wide_target, prompts):
    """One vLLM invocation of `runs` (name -> speculative_config or None) on the head_dim-32 target, the
    engine tests' prompts and limits, its work files in runs/engine_tests/<name>."""
    import time

    from eagle_train.engines.vllm_engine import run_vllm

    start = time.perf_counter()
    result = run_vllm(
        wide_target_dir,
        prompts,
        runs,
        fresh_dir(name),
        max_tokens=MAX_NEW_TOKENS,
        stop_token_ids=wide_target.stop_token_ids,
        max_model_len=wide_target.max_len,
        python=str(engine_python),
    )
    print(f"{name}: {len(runs)} runs in {time.perf_counter() - start:.0f} s (vllm {result.version})")
    return result


@pytest.fixture(scope="session")
def engine_eval_config(target_cfg, wide_target_dir, trained_ckpt, engine_python):
    """config(out, **changes): `evaluate engine=vllm` of the trained head on the head_dim-32 target:
    tinystories, ar + chain (K = 3), the engine tests' answer length, one thread; `changes` override any
    EvaluateConfig field."""
    from eagle_train.config.decode import DecodeConfig
    from eagle_train.config.draft import DraftConfig
    from eagle_train.config.evaluate import EvaluateConfig

    def config(out: Path, **changes) -> EvaluateConfig:
        settings = dict(
            target=dataclasses.replace(
                target_cfg, name=f"stories260k-hd{HEAD_DIM}", path=str(wide_target_dir)
            ),
            draft=DraftConfig(path=str(trained_ckpt)),
            bench=["tinystories"],
            methods=["ar", "chain"],
            num_questions=4,
            out_dir=str(out),
            num_threads=1,
            min_rounds=1,
            decode=DecodeConfig(chain_length=3, max_new_tokens=MAX_NEW_TOKENS),
            engine="vllm",
            engine_python=str(engine_python),
            progress=False,
        )
        return EvaluateConfig(**{**settings, **changes})

    return config
