"""Run checkpoints: the head in the serving layout plus the full training state for `resume=auto`.

    out_dir/checkpoints/step_0000100/model.safetensors, config.json   the head (eagle_train.modeling.checkpoint)
    out_dir/checkpoints/step_0000100/training_state/                  accelerate state + trainer.json
    out_dir/final/                                                     the head at the end

A checkpoint is resumable iff `training_state/trainer.json` exists: the state is written to a temporary
directory and renamed into place last, so an interrupted save is never picked up. Only the newest
`keep_last` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from eagle_train.modeling.checkpoint import save_head

CHECKPOINT_DIR = "checkpoints"
STATE_DIR = "training_state"
TRAINER_FILE = "trainer.json"


def step_dir(out_dir: str | Path, step: int) -> Path:
    """out_dir/checkpoints/step_XXXXXXX."""
    return Path(out_dir) / CHECKPOINT_DIR / f"step_{step:07d}"


def resumable_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints (head + training state), oldest first."""
    root = Path(out_dir) / CHECKPOINT_DIR
    return [d for d in sorted(root.glob("step_*")) if (d / STATE_DIR / TRAINER_FILE).is_file()]


def prune_checkpoints(out_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step directories."""
    steps = sorted((Path(out_dir) / CHECKPOINT_DIR).glob("step_*"))
    for old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    accelerator,
    model,
    out_dir: str | Path,
    step: int,
    meta: dict[str, Any],
    trainer_state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Save the head (main process) and the full state (every process: DeepSpeed shards it)."""
    final = step_dir(out_dir, step)
    tmp = final.parent / f".{final.name}.{STATE_DIR}.tmp"
    if accelerator.is_main_process:
        save_head(accelerator.unwrap_model(model), final, {**meta, "step": step})
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / TRAINER_FILE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
        shutil.rmtree(final / STATE_DIR, ignore_errors=True)
        os.replace(tmp, final / STATE_DIR)
        prune_checkpoints(out_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, checkpoint: Path) -> dict[str, Any]:
    """Restore model/optimizer/RNG state from `checkpoint` and return its trainer state."""
    accelerator.load_state(str(checkpoint / STATE_DIR))
    return json.loads((checkpoint / STATE_DIR / TRAINER_FILE).read_text())
