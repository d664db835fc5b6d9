"""Shared fixtures: the real embedded target and the shared data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from eagle_train.config.base import CONF_DIR, DATA_DIR
from eagle_train.families.matrix import default_work
from eagle_train.runtime.atomic_files import cache_dir

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The embedded target is tiny (d=64): one thread is faster than two, and far faster on a busy machine
# where a second thread waits for a core. Subprocesses started by tests inherit OMP_NUM_THREADS.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]
# The shape of the tiny random models of other families the tests build (vocabulary: stories260K's tokenizer).
TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
STORIES260K = DATA_DIR / "models" / "stories260K"
DATA = DATA_DIR


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def target_cfg():
    """The TargetConfig of the embedded default (stories260K), composed from conf/target."""
    from omegaconf import OmegaConf

    from eagle_train.config import TargetConfig, to_schema

    return to_schema(OmegaConf.load(CONF_DIR / "target" / "stories260k.yaml"), TargetConfig)


@pytest.fixture(scope="session")
def target(target_cfg):
    """The real stories260K target, frozen, on CPU (loaded once per session)."""
    from eagle_train.modeling.target import load_target

    torch.manual_seed(0)
    return load_target(target_cfg)


@pytest.fixture(scope="session")
def tiny_conversations(tmp_path_factory) -> Path:
    """64 TinyStories conversations (the shipped builder), built once per test run."""
    from eagle_train.data.tinystories import build_tinystories_conversations

    path = tmp_path_factory.mktemp("conversations") / "tinystories.jsonl"
    build_tinystories_conversations(out_path=path, limit=64)
    return path


@pytest.fixture(scope="session")
def tiny_store(tiny_conversations, target_cfg, tmp_path_factory) -> Path:
    """A float32 feature store of `tiny_conversations` from the real target, extracted once per test run
    (tests that change it copy it first)."""
    from eagle_train.config.data import DataConfig
    from eagle_train.config.extract import ExtractConfig
    from eagle_train.extract import run as extract

    out = tmp_path_factory.mktemp("store") / "features"
    data = DataConfig(name="tinystories", path=str(tiny_conversations))
    extract(ExtractConfig(target=target_cfg, data=data, out_dir=str(out), dtype="float32", progress=False))
    return out


@pytest.fixture(scope="session")
def tiny_store_aux(tiny_conversations, target_cfg, tmp_path_factory) -> Path:
    """The same conversations with EAGLE-3's features too (aux=true: the inputs of layers 1, 2, 4)."""
    from eagle_train.config.data import DataConfig
    from eagle_train.config.extract import ExtractConfig
    from eagle_train.extract import run as extract

    out = tmp_path_factory.mktemp("store_aux") / "features"
    data = DataConfig(name="tinystories", path=str(tiny_conversations))
    cfg = ExtractConfig(
        target=target_cfg, data=data, out_dir=str(out), dtype="float32", progress=False, aux=True
    )
    extract(cfg)
    return out


def reseal(store: Path, index: int) -> None:
    """After a deliberate edit of shard `index` of a store: record the file's new sha256 and size in the
    manifest, as a writer with a bug (or an attacker) would, so only the content checks can catch it."""
    import json

    from eagle_train.runtime.atomic_files import file_sha256
    from eagle_train.store.manifest import MANIFEST_NAME
    from eagle_train.store.writer import shard_name

    shard = store / shard_name(index)
    manifest = json.loads((store / MANIFEST_NAME).read_text())
    manifest["shards"][index].update(sha256=file_sha256(shard), bytes=shard.stat().st_size)
    (store / MANIFEST_NAME).write_text(json.dumps(manifest))


# eagle-train's cache as the user has it (runtime.atomic_files.cache_dir), read before `weight_hash_cache`
# points the environment elsewhere: the family tests keep their npm tokenizers, built models and finished
# matrix stages there, outside git, from one session (and one `make` target) to the next
USER_CACHE = cache_dir()


@pytest.fixture(scope="session")
def matrix_work():
    """The family matrix's work directory beside the built models ($EAGLE_TRAIN_CACHE/matrix): a stage that
    finished for the same model and settings is reused (by the families' slow and engine tests, and the next
    session too)."""
    return default_work(USER_CACHE)


@pytest.fixture(scope="session", autouse=True)
def weight_hash_cache(tmp_path_factory):
    """The sha256 cache of target weight files (eagle_train.runtime.atomic_files.cached_sha256) in a temporary
    directory, for this process and the subprocesses tests start: never the user's ~/.cache."""
    os.environ["EAGLE_TRAIN_CACHE"] = str(tmp_path_factory.mktemp("eagle_train_cache"))
    yield
    os.environ.pop("EAGLE_TRAIN_CACHE", None)


def untrained_dflash_head(target, block_size: int, seed: int):
    """An untrained two-layer DFlash head reading target layers 1 and 2, mask token 0, in eval mode, its
    norms drawn away from 1 (so a wrongly applied norm shows)."""
    from eagle_train.modeling.dflash import DFlashHead

    torch.manual_seed(seed)
    head = DFlashHead.from_target(target.config, [1, 2], block_size, 0, target=target, num_layers=2)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return head.eval()


def decoder_fine_tune(dest: Path) -> Path:
    """A copy of stories260K at `dest` whose decoder layer 0 was then changed in place (its MLP nudged),
    as a fine-tune of the layers alone would: same config, same embedding and LM head, other features."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(STORIES260K, dest)
    weights = load_file(str(dest / "model.safetensors"))
    weights["model.layers.0.mlp.down_proj.weight"] += 0.05
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def run_module(module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600):
    """`python -m MODULE ARGS` from the repository root, output captured (a real process: the command's
    own exit code and stderr)."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_line(stderr: str) -> str:
    """The one `error: ...` line a command ends with on a user error, after checking that stderr holds no
    traceback and no other error line (what a user reads is that line alone)."""
    assert "Traceback" not in stderr and "Error executing job" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error:" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: "), stderr[-3000:]
    assert stderr.rstrip().splitlines()[-1] == errors[0], stderr[-3000:]
    return errors[0]
