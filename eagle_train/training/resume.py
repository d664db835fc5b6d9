"""Run checkpoints: the head in the serving layout plus the full training state for `resume=auto`.

    out_dir/checkpoints/step_0000100/model.safetensors, config.json   the head
                                                                       (eagle_train.modeling.head_checkpoint)
    out_dir/checkpoints/step_0000100/training_state/                  accelerate state + trainer.json
    out_dir/final/                                                     the head at the end

`trainer.json` holds the trainer state (step, epoch, cursor), the run's identity (`run_identity`: what a
resumed run must share with the one that wrote it) and the sha256 of every file of the checkpoint, and is
itself sealed by a sha256 of its contents. The whole step directory (head and state) is written under a
temporary name (`.step_XXXXXXX.partial-ckpt`) and renamed into place last, so an interrupted save (a kill,
a full disk) leaves no step directory at all and is never picked up.
Resuming takes the newest checkpoint whose every checksum holds; a damaged one (flipped weights or
optimizer bytes, an edited trainer.json, a step that does not match its directory) is said so, renamed
`damaged-step_XXXXXXX` (kept for inspection, never pruned in place of a good one) and the one before it
is used. Only the newest `keep_last` checkpoints are kept.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle_train.config.base import flatten, mismatches
from eagle_train.config.train import TrainConfig
from eagle_train.modeling.head_checkpoint import STATE_DIR, TRAINER_FILE, read_head_weights, save_head
from eagle_train.modeling.target import error_reason
from eagle_train.runtime.atomic_files import (
    PARTIAL,
    FileFormatError,
    atomic_write_json,
    file_sha256,
    read_json,
)
from eagle_train.runtime.errors import UserError

CHECKPOINT_DIR = "checkpoints"
RANDOM_STATES = "random_states_*.pkl"  # accelerate's random number generator states, one pickle per process
RANDOM_STATE_KEYS = {"random_state", "numpy_random_seed", "torch_manual_seed"}
DAMAGED_PREFIX = "damaged-"
# Settings a resumed run may change: they decide what is shown, logged, evaluated or kept, or where
# things are, never what is trained (the store and the target are identified by their contents).
FREE_SETTINGS = (
    "stop_at_step", "log_every", "eval_every", "eval_max_samples", "eval_depth", "save_every", "keep_last",
    "wandb", "wandb_project", "progress", "out_dir", "resume", "features", "mixed_precision",
    "target.name", "target.path", "data.name", "data.path", "eval_engine", "eval_engine_every",
    "eval_engine_prompts", "eval_engine_max_new_tokens", "eval_engine_python", "eval_engine_target",
    "loader_workers", "loader_prefetch",
)  # fmt: skip


# settings only one kind of head reads, left out of the other kinds' identities (their runs from before the
# setting existed still resume)
KIND_SETTINGS = {
    "draft.block_size": "dflash",
    "draft.target_layer_ids": "dflash",
    "loss.num_anchors": "dflash",
    "loss.dflash_gamma": "dflash",
}


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be written, or one on disk is damaged; names the directory and why."""


def run_identity(cfg: TrainConfig, source: dict[str, Any], processes: int, precision: str) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote its checkpoint: the process count and the
    resolved precision, every setting but FREE_SETTINGS (grad_accum, epochs, max_steps, the optimizer,
    loss, seed, batch plan and head among them), and `source`: the data's and the target's identity
    (training/sources.py: the store's content hash or the online file's sha256, the target's config hash
    and weight fingerprint)."""
    settings = {
        k: v
        for k, v in flatten(asdict(cfg)).items()
        if k not in FREE_SETTINGS and KIND_SETTINGS.get(k, cfg.draft.type) == cfg.draft.type
    }
    return {"processes": processes, "precision": precision, "settings": settings, **source}


def step_dir(out_dir: str | Path, step: int) -> Path:
    """out_dir/checkpoints/step_XXXXXXX."""
    return Path(out_dir) / CHECKPOINT_DIR / f"step_{step:07d}"


def resumable_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints (head + training state), oldest first (not yet verified)."""
    root = Path(out_dir) / CHECKPOINT_DIR
    return [d for d in sorted(root.glob("step_*")) if (d / STATE_DIR / TRAINER_FILE).is_file()]


def prune_checkpoints(out_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints."""
    for old in resumable_checkpoints(out_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _seal(record: dict[str, Any]) -> str:
    """The sha256 of a trainer record's contents (its own `sha256` field left out)."""
    body = {k: v for k, v in record.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _checksums(checkpoint: Path, state_dir: Path) -> dict[str, str]:
    """sha256 of the head files and of every file of the training state, by path in the checkpoint."""
    files = {p.name: file_sha256(p) for p in sorted(checkpoint.iterdir()) if p.is_file()}
    for p in sorted(state_dir.rglob("*")):
        if p.is_file() and p.name != TRAINER_FILE:
            files[f"{STATE_DIR}/{p.relative_to(state_dir)}"] = file_sha256(p)
    return files


def save_checkpoint(
    accelerator,
    model,
    out_dir: str | Path,
    step: int,
    meta: dict[str, Any],
    trainer_state: dict[str, Any],
    identity: dict[str, Any],
    keep_last: int,
) -> Path:
    """Save the head (main process) and the full state (every process: DeepSpeed shards it), then seal it
    with trainer.json. A failed write (a full disk) is a CheckpointError naming the step; the checkpoints
    before it are untouched."""
    final = step_dir(out_dir, step)
    tmp = final.parent / f".{final.name}{PARTIAL}ckpt"  # the whole step directory, renamed into place last
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            save_head(accelerator.unwrap_model(model), tmp, {**meta, "step": step})
            (tmp / STATE_DIR).mkdir()
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp / STATE_DIR))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            record = {"trainer": trainer_state, "run": identity, "files": _checksums(tmp, tmp / STATE_DIR)}
            atomic_write_json(tmp / STATE_DIR / TRAINER_FILE, {**record, "sha256": _seal(record)})
            publish_step(tmp, final)
            prune_checkpoints(out_dir, keep_last)
    except Exception as err:  # a full disk shows as OSError, torch's RuntimeError or safetensors' own error
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = err.__cause__ or err
        raise CheckpointError(
            f"writing the checkpoint of step {step} to {final} failed ({type(cause).__name__}: {cause}). If the "
            "disk is full, free space and rerun: the checkpoints before it are untouched and resume=auto "
            "continues from the newest"
        ) from err
    accelerator.wait_for_everyone()
    return final


def publish_step(tmp: Path, final: Path) -> None:
    """Rename the finished step directory `tmp` to `final`; one there already (a save cut short by an
    earlier eagle-train, which wrote the head first) is moved aside first and then removed."""
    if final.exists():
        old = final.with_name(f".{final.name}{PARTIAL}old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def verify_checkpoint(checkpoint: Path) -> dict[str, Any]:
    """The sealed trainer record of `checkpoint` if every checksum holds, else CheckpointError saying why."""
    try:
        record = read_json(checkpoint / STATE_DIR / TRAINER_FILE, "trainer state")
    except FileFormatError as err:
        raise CheckpointError(str(err)) from None
    if not isinstance(record, dict) or record.get("sha256") != _seal(record) or "trainer" not in record:
        raise CheckpointError(
            f"{checkpoint / STATE_DIR / TRAINER_FILE}: its checksum does not match its contents"
        )
    if checkpoint.name != f"step_{record['trainer'].get('step', -1):07d}":
        raise CheckpointError(f"{checkpoint}: trainer.json records step {record['trainer'].get('step')}")
    for name, sha in sorted(record.get("files", {}).items()):
        file = checkpoint / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if file_sha256(file) != sha:
            raise CheckpointError(f"{file}: its checksum differs from the one recorded when it was saved")
    return record


def newest_valid_checkpoint(out_dir: str | Path) -> tuple[Path | None, dict[str, Any], list[str]]:
    """(checkpoint, trainer record, damage reports) of the newest checkpoint that verifies, trying
    newer ones first; (None, {}, reports) when none does. Read only: every process may call it."""
    damaged = []
    for checkpoint in reversed(resumable_checkpoints(out_dir)):
        try:
            return checkpoint, verify_checkpoint(checkpoint), damaged
        except CheckpointError as err:
            damaged.append(str(err))
    return None, {}, damaged


def set_aside(out_dir: str | Path, keep: Path | None) -> list[Path]:
    """Clear the step directories newer than `keep` (all when None) before a resumed run writes its own:
    a complete one (damaged, since `keep` is the newest valid) is renamed `damaged-step_XXXXXXX` and kept
    for inspection; an incomplete one (a save killed half-way: no trainer.json) is deleted. Returns the
    renamed ones."""
    moved = []
    for checkpoint in sorted((Path(out_dir) / CHECKPOINT_DIR).glob("step_*")):
        if keep is not None and checkpoint.name <= keep.name:
            continue
        if (checkpoint / STATE_DIR / TRAINER_FILE).is_file():
            target = checkpoint.with_name(DAMAGED_PREFIX + checkpoint.name)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(checkpoint, target)
            moved.append(target)
        else:
            shutil.rmtree(checkpoint, ignore_errors=True)
    return moved


def resume(accelerator, out_dir: Path, identity: dict[str, Any]) -> dict[str, Any] | None:
    """Restore the newest valid checkpoint of `out_dir` and return its trainer state, or None when there
    is none (a fresh run). Damaged checkpoints are reported and set aside (`set_aside`); a checkpoint
    written by a run with another identity is refused, naming each differing field; so is a directory
    holding a finished or damaged run but no valid checkpoint. Every process takes the same decision."""
    checkpoint, record, damaged = newest_valid_checkpoint(out_dir)
    for report in damaged:
        accelerator.print(f"WARNING: damaged checkpoint, not used: {report}")
    start_over = "pass resume=never to start over (removes checkpoints/, final/ and metrics.jsonl) or use another out_dir"
    if checkpoint is None:
        if damaged or (out_dir / "final").exists():
            raise CheckpointError(f"{out_dir} holds a run but no checkpoint that verifies: {start_over}")
        return None
    diffs = mismatches(record.get("run", {}), identity, labels=("checkpoint", "this run"))
    if diffs:
        raise CheckpointError(
            f"{checkpoint}: cannot resume: this run differs from the one that wrote it: " + "; ".join(diffs)
            + f". Rerun with the checkpoint's settings, or {start_over}"
        )  # fmt: skip
    if accelerator.is_main_process:
        for moved in set_aside(out_dir, checkpoint):
            accelerator.print(f"WARNING: set aside as {moved}")
    accelerator.wait_for_everyone()
    load_state(accelerator, checkpoint)
    accelerator.print(
        f"resumed from {checkpoint} at step {record['trainer']['step']}"
        + (f" (the {len(damaged)} newer ones are damaged)" if damaged else "")
    )
    return record["trainer"]


def load_state(accelerator, checkpoint: Path) -> None:
    """accelerate's `load_state` of the checkpoint's training state; a file it cannot load (a pickle
    holding code, which torch's weights_only load refuses; a file cut short) is a CheckpointError naming
    the file and the reason, not a traceback from deep inside torch. The random-state pickles are loaded
    first the way accelerate does (weights only, numpy arrays allowed), since accelerate itself only logs
    "Could not load random states" and goes on when that fails."""
    state_dir = checkpoint / STATE_DIR
    for file in sorted(state_dir.glob(RANDOM_STATES)):
        states = refuse_unloadable(file, checkpoint)
        if not isinstance(states, dict) or not RANDOM_STATE_KEYS <= set(states):
            raise CheckpointError(
                f"{file}: not the random states accelerate writes (no {sorted(RANDOM_STATE_KEYS)}). Move "
                f"{checkpoint.name} aside to resume from the checkpoint before it, or pass resume=never"
            )
    try:
        accelerator.load_state(str(state_dir))
    except Exception:  # torch's UnpicklingError, RuntimeError, EOFError, safetensors' own error
        file = unloadable_file(state_dir)
        if file is None:  # every file loads alone: not a damaged file (e.g. out of memory)
            raise
        refuse_unloadable(file, checkpoint)


def refuse_unloadable(file: Path, checkpoint: Path) -> Any:
    """`file` loaded as plain data (`load_plain`), else a CheckpointError naming it and why."""
    try:
        return load_plain(file)
    except Exception as err:  # whatever the load raises, this is the file
        raise CheckpointError(
            f"{file}: cannot be loaded ({error_reason(err)}): not a training state this trainer wrote. "
            f"Move {checkpoint.name} aside to resume from the checkpoint before it, or pass resume=never"
        ) from None


def load_plain(file: Path) -> Any:
    """A training state file loaded as plain data: safetensors, or a torch pickle read weights-only with
    numpy's arrays allowed (accelerate's random states hold numpy's generator state), no other object."""
    if file.suffix == ".safetensors":
        return read_head_weights(file)
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode, np.dtypes.UInt32DType]
    with torch.serialization.safe_globals(allowed):
        return torch.load(file, map_location="cpu", weights_only=True)


def unloadable_file(state_dir: Path) -> Path | None:
    """The first file of a training state that `load_plain` refuses (None: none of them)."""
    for file in sorted(state_dir.iterdir()):
        if file.suffix not in (".safetensors", ".bin", ".pkl"):
            continue
        try:
            load_plain(file)
        except Exception:  # whatever the load raises, this is the file
            return file
    return None


def clear_run(out_dir: Path) -> None:
    """Remove what a training run writes in `out_dir` (checkpoints/, final/, metrics.jsonl); nothing else."""
    shutil.rmtree(out_dir / CHECKPOINT_DIR, ignore_errors=True)
    shutil.rmtree(out_dir / "final", ignore_errors=True)
    (out_dir / "metrics.jsonl").unlink(missing_ok=True)
