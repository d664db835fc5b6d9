"""One writer per output (eagle_train.runtime.output_lock): every writing stage refuses an output another
live process holds, names the holder, and takes over a lock left by a killed process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_train.runtime.output_lock import LockedError, OutputLock, lock_path

REPO_ROOT = Path(__file__).resolve().parents[1]
HOLD = (
    "import sys, time; from eagle_train.runtime.output_lock import OutputLock; "
    "OutputLock(sys.argv[1], 'holder').acquire(); print('held', flush=True); time.sleep(600)"
)


class Holder:
    """A real process holding the lock on `output` until it is killed."""

    def __init__(self, output: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(output)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout.readline().strip() == "held"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def holder():
    holders: list[Holder] = []

    def hold(output: Path) -> Holder:
        holders.append(Holder(output))
        return holders[-1]

    yield hold
    for h in holders:
        h.kill()


def test_a_second_lock_is_refused_naming_the_holder_and_released_cleanly(tmp_path):
    out = tmp_path / "run"
    with OutputLock(out, "train") as lock:
        record = json.loads(lock.path.read_text())
        assert record["pid"] == os.getpid() and record["stage"] == "train" and record["host"]
        with pytest.raises(LockedError, match=rf"{out} is being written by pid {os.getpid()} on .*\(train: "):
            OutputLock(tmp_path / "x" / ".." / "run", "train").acquire()  # any spelling: one lock
    assert not lock.path.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
    OutputLock(out, "train").acquire().release()  # free again


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path, holder):
    out = tmp_path / "store"
    held = holder(out)
    with pytest.raises(LockedError, match=f"pid {held.proc.pid}"):
        OutputLock(out, "extract").acquire()
    held.kill()  # SIGKILL: no cleanup, the lock file stays
    assert lock_path(out).exists()
    with OutputLock(out, "extract"):
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()


def test_a_planted_symlink_is_not_followed_and_is_named(tmp_path):
    """A symbolic link planted as the lock file is never followed (what it points at is untouched); the
    refusal names the lock file, where it points and how to clear it, in one line."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    lock = lock_path(tmp_path / "out")
    lock.symlink_to(victim)
    message = rf"lock file {lock} is a symbolic link \(to {victim}\), which is never followed: remove it"
    with pytest.raises(LockedError, match=message) as err:
        OutputLock(tmp_path / "out", "export").acquire()
    assert "\n" not in str(err.value) and victim.read_text() == "keep"


def test_every_writing_stage_refuses_a_held_output(
    tiny_store, target, target_cfg, tiny_conversations, tmp_path, holder
):
    """extract, train, regenerate, evaluate, export and the pipeline: refused at once, nothing written."""
    from eagle_train.config.data import DataConfig
    from eagle_train.config.draft import DraftConfig
    from eagle_train.config.evaluate import EvaluateConfig
    from eagle_train.config.export import ExportConfig
    from eagle_train.config.extract import ExtractConfig
    from eagle_train.config.pipeline import PipelineConfig, StageSpec
    from eagle_train.config.regenerate import RegenerateConfig
    from eagle_train.config.train import TrainConfig
    from eagle_train.evaluate import run as evaluate
    from eagle_train.export import run as export
    from eagle_train.extract import run as extract
    from eagle_train.modeling.draft import DraftHead
    from eagle_train.modeling.head_checkpoint import save_head
    from eagle_train.pipeline import run as pipeline
    from eagle_train.regenerate import run as regenerate
    from eagle_train.train import run as train

    data = DataConfig(path=str(tiny_conversations), limit=4)
    head = save_head(DraftHead.from_target(target.config), tmp_path / "head", {"target": "stories260k"})
    stages = {
        "extract": lambda out: extract(ExtractConfig(target=target_cfg, data=data, out_dir=str(out), progress=False)),
        "train": lambda out: train(TrainConfig(target=target_cfg, features=str(tiny_store), out_dir=str(out), progress=False)),
        "regenerate": lambda out: regenerate(RegenerateConfig(target=target_cfg, data=data, out=str(out), progress=False)),
        "evaluate": lambda out: evaluate(EvaluateConfig(target=target_cfg, draft=DraftConfig(path=str(head)), out_dir=str(out), progress=False)),
        "export": lambda out: export(ExportConfig(ckpt=str(head), out_dir=str(out))),
        "pipeline": lambda out: pipeline(PipelineConfig(out_dir=str(out), stages={"prepare": StageSpec(module="x", outputs=["y"])})),
    }  # fmt: skip
    for name, run in stages.items():
        out = tmp_path / name
        held = holder(out)
        with pytest.raises(LockedError, match=f"{out} is being written by pid {held.proc.pid}"):
            run(out)
        assert not out.exists(), name
        held.kill()
