"""`python -m eagle_train.extract` as real processes: 2 processes == 1, a killed run resumes, bad input exits."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle_train.config.data import DataConfig
from eagle_train.config.extract import ExtractConfig
from eagle_train.extract import run
from eagle_train.runtime.atomic_files import partial_prefix
from eagle_train.store.manifest import MANIFEST_NAME
from eagle_train.store.reader import FeatureStore
from eagle_train.store.writer import shard_name
from tests.conftest import DATA, error_line
from tests.kill_after import KILLED

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[1]
KILL_AFTER = REPO_ROOT / "tests" / "kill_after.py"
FASTCHAT = str(DATA / "sharegpt" / "fastchat_dummy_conversation.json")
# 10 short FastChat conversations in shards of 3 -> 4 shards
ARGS = ["data=fastchat_dummy", "data.limit=10", "data.max_len=96", "shard_samples=3", "progress=false"]


def extract_cli(
    out_dir: Path, *extra: str, env: dict[str, str] | None = None, command: list[str] | None = None
):
    """`command` (default `python -m eagle_train.extract`) with the test's overrides."""
    command = command or [sys.executable, "-m", "eagle_train.extract"]
    cmd = [*command, *ARGS, f"out_dir={out_dir}", *extra]
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(cmd, cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference_store(tmp_path_factory, target_cfg) -> FeatureStore:
    """The same extraction, uninterrupted, in one process."""
    out_dir = tmp_path_factory.mktemp("reference")
    data = DataConfig(name="fastchat_dummy", path=FASTCHAT, limit=10, max_len=96)
    run(ExtractConfig(target=target_cfg, data=data, out_dir=str(out_dir), shard_samples=3, progress=False))
    return FeatureStore(out_dir)


def assert_same_store(store: FeatureStore, reference: FeatureStore) -> None:
    """Same samples in the same order with the same contents: nothing missing, nothing doubled."""
    assert store.ids == reference.ids and len(set(store.ids)) == len(store.ids) == 10
    assert [(s["start"], s["stop"]) for s in store.manifest["shards"]] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert store.manifest["counts"] == reference.manifest["counts"]
    assert store.manifest["config_hash"] == reference.manifest["config_hash"]
    for i in range(len(reference)):
        got, want = store[i], reference[i]
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(
            got["loss_mask"], want["loss_mask"]
        )
        # the same conversations in the same batches through the same model: bit for bit
        assert torch.equal(got["hidden"], want["hidden"]), f"sample {i}: hidden states differ"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path, reference_store):
    accelerate = [
        str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--main_process_port", str(free_port()), "-m", "eagle_train.extract",
    ]  # fmt: skip
    result = extract_cli(tmp_path, env={"ACCELERATE_USE_CPU": "true"}, command=accelerate)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    store = FeatureStore(tmp_path)
    assert_same_store(store, reference_store)
    # shards 0, 2 by process 0 and 1, 3 by process 1: both processes worked, one manifest
    assert [s["process"] for s in store.manifest["shards"]] == [0, 1, 0, 1]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".json")) == [
        MANIFEST_NAME,
        *[f"shard-0000{k}.json" for k in range(4)],
        "store_config.json",
    ]


def test_killed_run_resumes_to_the_same_store(tmp_path, reference_store):
    # killed right after its first shard is written (the fault comes from tests/kill_after.py)
    killed = extract_cli(
        tmp_path, command=[sys.executable, str(KILL_AFTER), "eagle_train.extract", "write_shard", "1"]
    )
    assert killed.returncode == KILLED, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert (tmp_path / shard_name(0)).exists() and not (tmp_path / shard_name(1)).exists()
    assert not (tmp_path / MANIFEST_NAME).exists()
    kept = (tmp_path / shard_name(0)).stat().st_mtime_ns
    # what a kill in the middle of the next shard leaves: a temp file, and a shard without its sidecar
    (tmp_path / f"{partial_prefix(shard_name(1))}x1y2.tmp").write_bytes(b"partial")
    shutil.copy(tmp_path / shard_name(0), tmp_path / shard_name(2))

    resumed = extract_cli(tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert (tmp_path / shard_name(0)).stat().st_mtime_ns == kept  # the completed shard was kept
    assert not list(tmp_path.glob(".*.tmp"))
    store = FeatureStore(tmp_path)
    store.verify()
    assert_same_store(store, reference_store)
    assert "conversations: 10" in resumed.stdout and "bytes per token" in resumed.stdout


def test_a_rerun_killed_at_its_start_leaves_the_complete_store_usable(tmp_path, reference_store):
    """A rerun over a complete store killed at its start leaves the store usable: the manifest stays until
    a shard is written again and is replaced atomically at the end."""
    shutil.copytree(reference_store.path, tmp_path, dirs_exist_ok=True)
    before = (tmp_path / MANIFEST_NAME).read_text()
    killed = extract_cli(
        tmp_path, command=[sys.executable, str(KILL_AFTER), "eagle_train.extract", "prepare_out_dir", "1"]
    )
    assert killed.returncode == KILLED, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert (tmp_path / MANIFEST_NAME).read_text() == before
    FeatureStore(tmp_path).verify()
    resumed = extract_cli(tmp_path)  # keeps every shard, replaces the manifest atomically
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert_same_store(FeatureStore(tmp_path), reference_store)


def test_cli_bad_input_exits_nonzero_naming_the_record(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = {"id": "ok", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hey"}]}
    bad.write_text(json.dumps(good) + "\n" + '{"id": "broken", "conversations": [\n')
    out_dir = tmp_path / "store"
    result = extract_cli(out_dir, f"data.path={bad}")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "bad.jsonl" in output and "line 2" in output
    assert not out_dir.exists()


def test_a_full_disk_names_the_shard_and_a_rerun_with_room_completes(tmp_path, reference_store):
    """Files capped at 30 kB (a full disk: the write fails with EFBIG as with ENOSPC): one line naming the
    shard being written and what to do, no traceback, nothing half written left; a rerun with room
    extracts the same store."""
    limit = [sys.executable, str(REPO_ROOT / "tests" / "file_size_limit.py"), "30000", "eagle_train.extract"]
    full = extract_cli(tmp_path, command=limit)
    assert full.returncode == 1
    line = error_line(full.stderr)
    assert f"{tmp_path / shard_name(0)}: File too large (errno 27)" in line and "free space" in line
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") or p.name.startswith("shard-")]
    resumed = extract_cli(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_store(FeatureStore(tmp_path), reference_store)
