"""How a command ends: a user error in one line on stderr with exit code 1 and no traceback (the stages,
through cli.stage_main, on real processes), its traceback on request, and a bug with its traceback."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_train.data.sharegpt import DataError
from eagle_train.runtime.errors import ConfigError, InputError, is_user_error, one_line, user_errors
from eagle_train.runtime.output_lock import LockedError
from eagle_train.store.manifest import StoreError
from eagle_train.training.resume import CheckpointError
from tests.conftest import REPO_ROOT, error_line, run_module


def test_which_exceptions_are_user_errors():
    """The project's error classes and OSErrors are user errors; a TypeError, a plain ValueError (a bug's
    or a library's) and a KeyError are not."""
    user = [
        DataError("x"), StoreError("x"), CheckpointError("x"), LockedError("x"), ConfigError("x"),
        InputError("x"), FileNotFoundError(errno.ENOENT, "No such file or directory", "a.json"),
    ]  # fmt: skip
    assert all(is_user_error(err) for err in user)
    assert not any(is_user_error(err) for err in (TypeError("x"), ValueError("x"), KeyError("x")))


def test_the_line_names_the_file_and_the_remedy_of_a_full_disk():
    err = OSError(errno.ENOSPC, "No space left on device", "/data/store/shard-00001.safetensors")
    assert one_line(err) == (
        "/data/store/shard-00001.safetensors: No space left on device (errno 28): free disk space and rerun"
    )
    assert one_line(InputError("first\n  second\n")) == "first second"


def test_a_user_error_ends_in_one_line_and_a_bug_keeps_its_traceback(capsys, monkeypatch):
    monkeypatch.delenv("EAGLE_TRAIN_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as stopped, user_errors():
        raise DataError("data.jsonl: record 3 (id 'a'): no 'conversations' list")
    assert stopped.value.code == 1
    assert (
        error_line(capsys.readouterr().err) == "error: data.jsonl: record 3 (id 'a'): no 'conversations' list"
    )
    with pytest.raises(TypeError), user_errors():  # a bug: it propagates (with its traceback)
        raise TypeError("unsupported operand")
    monkeypatch.setenv("EAGLE_TRAIN_TRACEBACK", "1")
    with pytest.raises(DataError), user_errors():  # asked for: the traceback of a user error too
        raise DataError("data.jsonl: record 3")


def test_under_a_launcher_one_process_reports_a_shared_error(capsys, monkeypatch):
    """Rank 0 prints every error; another rank prints only one it met alone, prefixed with its rank."""
    monkeypatch.delenv("EAGLE_TRAIN_TRACEBACK", raising=False)
    shared = ConfigError("max_steps: must be > 0")
    alone = DataError("shard-00002.safetensors: its checksum differs")
    for rank, err, printed in [("0", shared, True), ("1", shared, False), ("1", alone, True)]:
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit), user_errors():
            raise err
        stderr = capsys.readouterr().err
        assert (stderr != "") == printed
        if printed and rank == "1":
            assert stderr == f"[rank 1] error: {err}\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["ckpt=/nonexistent/head", "out_dir=OUT"], r"checkpoint directory /nonexistent/head does not exist"),
        (["ckptt=/x"], r"export: Could not override 'ckptt'.*Key 'ckptt' not in 'ExportConfig'"),
        (["format=onnx"], r"format must be one of .*got 'onnx'"),
        (
            ["max_len=many"],
            r"Value 'many' of type 'str' could not be converted to Integer.*full_key: max_len",
        ),
    ],
)
def test_a_stage_ends_a_user_error_in_one_line(tmp_path, args, message):
    """A missing input, a misspelt key, a refused value and a value of the wrong type: one line on
    stderr, exit code 1, no traceback and no "Error executing job"."""
    args = [a.replace("OUT", str(tmp_path / "out")) for a in args]
    done = run_module("eagle_train.export", *args, env={"EAGLE_TRAIN_TRACEBACK": ""})
    assert done.returncode == 1
    assert re.fullmatch(rf"error: .*{message}.*", error_line(done.stderr))


def test_the_traceback_of_a_user_error_is_shown_on_request(tmp_path):
    done = run_module(
        "eagle_train.export",
        "ckpt=/nonexistent/head",
        f"out_dir={tmp_path}",
        env={"EAGLE_TRAIN_TRACEBACK": "1"},
    )
    assert done.returncode == 1
    assert (
        "Traceback" in done.stderr and "checkpoint directory /nonexistent/head does not exist" in done.stderr
    )


def test_a_bug_in_a_stage_keeps_its_traceback(tmp_path):
    """A TypeError raised inside a stage's run is not turned into a line: the traceback shows where."""
    code = (
        "import sys, eagle_train.export as stage\n"
        "def broken(ckpt):\n    return len(None)\n"
        "stage.checkpoint_dir = broken\n"
        f"sys.argv = ['export', 'ckpt=x', 'out_dir={tmp_path}']\n"
        "stage.main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "in broken" in done.stderr and "TypeError" in done.stderr


TRAIN = ["+recipe=stories260k_cpu", "max_steps=2", "progress=false", "max_tokens=1024", "max_batch_size=4"]


def test_training_under_accelerate_launch_ends_in_one_line(tmp_path):
    """`accelerate launch -q` (make train): the stage's own line, no launcher traceback; nothing written."""
    launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "-q", "--config_file"]
    args = [str(REPO_ROOT / "conf" / "accelerate" / "single.yaml"), "train.py", *TRAIN]
    done = subprocess.run(
        [*launch, *args, f"features={tmp_path / 'none'}", f"out_dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT,
        env={**os.environ, "EAGLE_TRAIN_TRACEBACK": ""},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1
    assert re.fullmatch(
        r"error: \S*none: not a complete feature store, no manifest.json", error_line(done.stderr)
    )
    assert not (tmp_path / "run").exists()


def test_a_damaged_shard_read_by_a_dataloader_worker_ends_in_one_line(tiny_store, tmp_path):
    """The store's error raised in a DataLoader worker reaches the user as itself: one line naming the
    shard and what to do, not the worker's traceback inside the message."""
    from tests.test_train import copy_store, hidden_region

    store = copy_store(tiny_store, tmp_path / "store")
    begin, _ = hidden_region(store)
    shard = store / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[begin + 4096 : begin + 4160] = b"\xff" * 64
    shard.write_bytes(bytes(data))
    args = [*TRAIN, f"features={store}", f"out_dir={tmp_path / 'run'}", "loader_workers=2"]
    done = run_module("eagle_train.train", *args, env={"EAGLE_TRAIN_TRACEBACK": ""})
    assert done.returncode == 1
    line = error_line(done.stderr)
    assert re.fullmatch(
        r"error: \S*shard-00000.safetensors: its checksum \(sha256\) differs .*rerun the extraction.*", line
    )
