"""Checkpoints and resume on the real stories260K and the shared tiny store: a resumed run must be the
same run, a damaged checkpoint is never used, resume=never starts clean, a kill or a full disk loses
nothing and leaves nothing behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from eagle_train.train import run
from eagle_train.training import resume as ckpt
from tests.conftest import error_line
from tests.kill_after import KILLED
from tests.test_train import make_cfg, read_metrics

REPO_ROOT = Path(__file__).resolve().parents[2]
ARGS = ("max_steps=6", "log_every=1", "eval_every=0", "save_every=2", "keep_last=3", "optim.warmup_steps=2")


def steps(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def whole(tiny_store, tmp_path_factory) -> Path:
    """The uninterrupted run every resumed one must reproduce."""
    out = tmp_path_factory.mktemp("whole") / "run"
    run(make_cfg(tiny_store, out, *ARGS))
    return out


@pytest.fixture(scope="module")
def stopped(tiny_store, tmp_path_factory) -> Path:
    """The same run stopped after step 4: checkpoints at steps 2 and 4 (copy it before changing it)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    run(make_cfg(tiny_store, out, *ARGS, "stop_at_step=4"))
    assert steps(out) == ["step_0000002", "step_0000004"]
    return out


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = (
        load_file(str(a / "final" / "model.safetensors")),
        load_file(str(b / "final" / "model.safetensors")),
    )
    return all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize(
    "change, field",
    [
        ("max_steps=8", "settings.max_steps: checkpoint 6, this run 8"),
        ("grad_accum=2", "settings.grad_accum: checkpoint 1, this run 2"),
        ("epochs=3", "settings.epochs: checkpoint 20, this run 3"),
        ("optim.lr=0.002", "settings.optim.lr: checkpoint 0.01, this run 0.002"),
        ("seed=1", "settings.seed"),
    ],
)
def test_resume_refuses_a_run_with_other_settings_naming_the_field(
    tiny_store, stopped, tmp_path, change, field
):
    out = shutil.copytree(stopped, tmp_path / "run")
    with pytest.raises(ckpt.CheckpointError, match=rf"step_0000004: cannot resume: .*{field}.*resume=never"):
        run(make_cfg(tiny_store, out, *ARGS, change))
    assert steps(out) == ["step_0000002", "step_0000004"] and not (out / "final").exists()


def test_resume_refuses_another_store_and_another_process_count(tiny_store, stopped, tmp_path, target_cfg):
    """The process count is part of the identity (checked here on the real checkpoint; a
    2-process launch records processes: 2), and so is the store, by its contents."""
    from eagle_train.config.data import DataConfig
    from eagle_train.config.extract import ExtractConfig
    from eagle_train.extract import run as extract

    out = shutil.copytree(stopped, tmp_path / "run")
    _, record, _ = ckpt.newest_valid_checkpoint(out)
    with pytest.raises(ckpt.CheckpointError, match="processes: checkpoint 1, this run 2"):
        ckpt.resume(Accelerator(cpu=True), out, {**record["run"], "processes": 2})
    conversations = json.loads((tiny_store / "manifest.json").read_text())["data"]["path"]
    other = tmp_path / "other_store"
    data = DataConfig(name="tinystories", path=conversations, limit=40)
    extract(ExtractConfig(target=target_cfg, data=data, out_dir=str(other), dtype="float32", progress=False))
    with pytest.raises(
        ckpt.CheckpointError, match=r"data\.store: checkpoint '[0-9a-f]+', this run '[0-9a-f]+'"
    ):
        run(make_cfg(other, out, *ARGS))


def test_resume_never_starts_clean(tiny_store, whole, tmp_path, stopped):
    """resume=never into a used directory removes the old run, so a later rerun cannot resume it
    (and overwrite the new final/ with the old run's continuation)."""
    out = shutil.copytree(whole, tmp_path / "run")
    (out / "notes.txt").write_text("mine")
    run(make_cfg(tiny_store, out, *ARGS, "resume=never", "stop_at_step=2"))
    assert steps(out) == ["step_0000002"] and not (out / "final").exists()
    assert [m["step"] for m in read_metrics(out) if "loss" in m] == [1, 2]
    run(make_cfg(tiny_store, out, *ARGS))  # resumes the new run at step 2
    assert same_weights(out, whole) and (out / "notes.txt").read_text() == "mine"
    assert [m["step"] for m in read_metrics(out) if "loss" in m] == [1, 2, 3, 4, 5, 6]


def flip(file: Path, at: int = -100) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))


def edit_step(checkpoint: Path) -> None:
    trainer = checkpoint / "training_state" / "trainer.json"
    record = json.loads(trainer.read_text())
    record["trainer"]["cursor"] += 1
    trainer.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda c: flip(c / "model.safetensors"), r"step_0000004/model.safetensors: its checksum differs"),
        (lambda c: flip(c / "training_state" / "optimizer.bin"), "optimizer.bin: its checksum differs"),
        (edit_step, "trainer.json: its checksum does not match its contents"),
        (lambda c: (c / "training_state" / "trainer.json").write_text("{"), r"trainer.json \(trainer state\): not valid JSON"),
    ],
    ids=["head", "optimizer", "edited-state", "truncated-state"],
)  # fmt: skip
def test_a_damaged_checkpoint_is_set_aside_and_the_one_before_resumes_exactly(
    tiny_store, whole, stopped, tmp_path, capsys, damage, reason
):
    """Flipped weights or optimizer bytes, an edited or broken trainer.json: reported, renamed
    damaged-step_*, and the run resumes from step 2 to the very weights of the uninterrupted run."""
    out = shutil.copytree(stopped, tmp_path / "run")
    damage(out / "checkpoints" / "step_0000004")
    run(make_cfg(tiny_store, out, *ARGS))
    printed = capsys.readouterr().out
    assert "damaged checkpoint, not used" in printed and re.search(reason, printed), printed[-2000:]
    assert "resumed from" in printed and "step_0000002 at step 2" in printed
    assert steps(out) == ["damaged-step_0000004", "step_0000002", "step_0000004", "step_0000006"]
    assert same_weights(out, whole)


def kill_after(function: str, calls: int, out: Path, store: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [f"features={store}", f"out_dir={out}", "+recipe=stories260k_cpu", "progress=false",
            "data.eval_fraction=0.1", "max_tokens=1024", "max_batch_size=4", "eval_max_samples=8", *ARGS, *extra]  # fmt: skip
    command = [
        sys.executable,
        str(REPO_ROOT / "tests" / "kill_after.py"),
        "eagle_train.train",
        function,
        str(calls),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run(
        [*command, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_a_killed_run_logs_every_step_once_and_leaves_no_temporary_behind(tiny_store, whole, tmp_path):
    """Killed after logging step 5 (checkpoint at 4): the rerun logs 5 and 6 once; killed inside
    a checkpoint write: its half-written directory is removed by the next run."""
    out = tmp_path / "run"
    killed = kill_after("log_metrics", 5, out, tiny_store)
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    killed = kill_after(
        "eagle_train.modeling.head_checkpoint:save_file", 1, out, tiny_store
    )  # inside step 6's save
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    assert any(p.name.startswith(".") for p in (out / "checkpoints").iterdir())  # what the kill left
    run(make_cfg(tiny_store, out, *ARGS))
    train_steps = [m["step"] for m in read_metrics(out) if "loss" in m]
    assert train_steps == [1, 2, 3, 4, 5, 6]
    assert not [p for d in (out, out / "checkpoints") for p in d.iterdir() if p.name.startswith(".")]
    assert same_weights(out, whole)


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_a_clear_error_and_loses_nothing(tiny_store, stopped, tmp_path):
    """The training state of step 6 cannot be written (files capped at 300 kB: the head fits, the optimizer
    state does not): one line naming the step, the checkpoints before it intact, no step directory of 6
    (not even its head: the step directory appears whole or not at all), no temporary left, and a rerun
    with room resumes from step 4."""
    out = shutil.copytree(stopped, tmp_path / "run")
    args = [f"features={tiny_store}", f"out_dir={out}", "+recipe=stories260k_cpu", "progress=false",
            "data.eval_fraction=0.1", "max_tokens=1024", "max_batch_size=4", "eval_max_samples=8", *ARGS]  # fmt: skip
    command = [sys.executable, str(REPO_ROOT / "tests" / "file_size_limit.py"), "300000", "eagle_train.train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    done = subprocess.run(
        [*command, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 1
    line = error_line(done.stderr)
    assert "writing the checkpoint of step 6" in line and "If the disk is full" in line
    assert steps(out) == ["step_0000002", "step_0000004"]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert ckpt.newest_valid_checkpoint(out)[0].name == "step_0000004"
    run(make_cfg(tiny_store, out, *ARGS))
    assert steps(out) == ["step_0000002", "step_0000004", "step_0000006"]


def test_a_rerun_of_a_finished_run_logs_its_final_evaluation_once(tiny_store, whole, tmp_path):
    """A rerun of a finished run logs no second final evaluation line: metrics.jsonl holds it once."""
    out = shutil.copytree(whole, tmp_path / "run")
    before = (out / "metrics.jsonl").read_text()
    final = run(make_cfg(tiny_store, out, *ARGS))
    run(make_cfg(tiny_store, out, *ARGS))
    assert (out / "metrics.jsonl").read_text() == before
    finals = [m for m in read_metrics(out) if "eval/loss" in m]
    assert [m["step"] for m in finals] == [6] and finals[0]["eval/loss"] == final["eval/loss"]


def reseal(checkpoint: Path) -> None:
    """Record every file's new sha256 in trainer.json and seal it again, as a forger would: only the load
    itself can then tell."""
    trainer = checkpoint / "training_state" / "trainer.json"
    record = json.loads(trainer.read_text())
    for name in record["files"]:
        record["files"][name] = ckpt.file_sha256(checkpoint / name)
    record.pop("sha256")
    trainer.write_text(json.dumps({**record, "sha256": ckpt._seal(record)}))


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_forged_pickle_in_a_checkpoint_is_one_line_naming_it(tiny_store, stopped, tmp_path):
    """A pickle with code in it in a resealed checkpoint is refused in one line naming the file (not a raw
    traceback from torch's weights_only load); nothing of it ever runs."""
    import pickle

    out = shutil.copytree(stopped, tmp_path / "run")
    step = out / "checkpoints" / "step_0000004"
    (step / "training_state" / "optimizer.bin").write_bytes(pickle.dumps(Payload()))
    reseal(step)
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"step_0000004/training_state/optimizer.bin: cannot be loaded \(UnpicklingError",
    ) as err:
        run(make_cfg(tiny_store, out, *ARGS))
    assert "\n" not in str(err.value) and not (REPO_ROOT / "PWNED").exists() and not Path("PWNED").exists()


@pytest.mark.parametrize(
    "forged, message",
    [
        ("code", r"random_states_0.pkl: cannot be loaded \(UnpicklingError"),
        ("other data", r"random_states_0.pkl: not the random states accelerate writes"),
    ],
)
def test_a_forged_random_state_pickle_is_refused_not_skipped(tiny_store, stopped, tmp_path, forged, message):
    """accelerate loads its random states weights-only and, when that fails, only logs "Could not load
    random states" and resumes: a forged random_states_0.pkl (checksums and seal recomputed) holding code,
    or plain data that is not a random state, is refused in one line naming it; nothing of it runs."""
    import pickle

    out = shutil.copytree(stopped, tmp_path / "run")
    step = out / "checkpoints" / "step_0000004"
    pkl = step / "training_state" / "random_states_0.pkl"
    if forged == "code":
        pkl.write_bytes(pickle.dumps(Payload()))
    else:
        torch.save({"step": 4}, pkl)
    reseal(step)
    with pytest.raises(ckpt.CheckpointError, match=rf"step_0000004/training_state/{message}") as err:
        run(make_cfg(tiny_store, out, *ARGS))
    assert "\n" not in str(err.value) and not (REPO_ROOT / "PWNED").exists() and not Path("PWNED").exists()
    assert steps(out) == ["step_0000002", "step_0000004"] and not (out / "final").exists()


def test_a_training_checkpoints_head_changed_since_it_was_saved_is_not_exported(whole, tmp_path):
    """A bit flipped in a step checkpoint's head: export refuses it, naming the file."""
    from eagle_train.config.export import ExportConfig
    from eagle_train.export import run as export

    step = shutil.copytree(whole / "checkpoints" / "step_0000006", tmp_path / "step")
    data = bytearray((step / "model.safetensors").read_bytes())
    data[-40] ^= 0x01
    (step / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"step/model.safetensors: its sha256 differs"):
        export(ExportConfig(ckpt=str(step), out_dir=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_without_the_targets_weight_files_is_refused_naming_them(tiny_store, stopped, tmp_path):
    """A checkpoint whose run identity records no target.weight_files cannot be told to come from this
    target's decoder layers: resuming it is refused, naming the field."""
    out = shutil.copytree(stopped, tmp_path / "run")
    step = out / "checkpoints" / "step_0000004"
    trainer = step / "training_state" / "trainer.json"
    record = json.loads(trainer.read_text())
    del record["run"]["target"]["weight_files"]
    trainer.write_text(json.dumps(record))
    reseal(step)
    with pytest.raises(ckpt.CheckpointError, match=r"cannot resume: .*target\.weight_files"):
        run(make_cfg(tiny_store, out, *ARGS))
