"""Draft-head checkpoints in the serving layout: `model.safetensors` + `config.json`.

The weights are the head's own: EAGLE-1/2 fc.*, layers.* (no embedding, no LM head); EAGLE-3 fc.*,
midlayer.*, layers.* (layers 1..N-1), norm, its own lm_head, d2t, t2d (no embedding); P-EAGLE also
mask_hidden and mask_embedding (the learned row of its mask token); DFlash fc, hidden_norm, layers.*, norm
(eagle_train.modeling.dflash). config.json is the draft's Llama config
(the target's shapes, `num_hidden_layers` = the head's layers; EAGLE-3 also its architecture, draft
vocabulary and aux layer ids, eagle_train.modeling.eagle3; P-EAGLE its mask token, eagle_train.modeling.peagle)
plus an `eagle_train` block: the head type, the target it was trained for, fc bias, training max length and
the sha256 of model.safetensors (`weights_sha256`). Writes are atomic. Before a head is used (`load_head`,
`interop.load_draft`) its files are checked against every checksum recorded for them (`check_head_files`:
that sha256 and, in a training checkpoint, training_state/trainer.json's): a changed file is refused, named.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eagle_train.modeling.dflash import DFLASH_FIELDS, DFlashHead
from eagle_train.modeling.draft import DraftHead, SharedTarget
from eagle_train.modeling.eagle3 import EAGLE3_FIELDS, Eagle3Head
from eagle_train.modeling.peagle import PEAGLE_FIELDS, PEagleHead
from eagle_train.modeling.target import error_reason
from eagle_train.runtime.atomic_files import atomic_write_dir, file_sha256, read_json
from eagle_train.runtime.errors import InputError

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
STATE_DIR = "training_state"  # a training checkpoint's state beside its head (eagle_train.training.resume)
TRAINER_FILE = (
    "trainer.json"  # in STATE_DIR: the trainer state and the sha256 of every file of the checkpoint
)
# every head class, the most specific first: a checkpoint is the first whose `recognise` claims its
# config.json (the head protocol, modeling.draft.DraftHead; the head kinds' registry, eagle_train.heads)
HEAD_MODELS = (DFlashHead, PEagleHead, Eagle3Head, DraftHead)
# config.json fields beyond the Llama shape that some head class records
HEAD_FIELDS = EAGLE3_FIELDS + PEAGLE_FIELDS + DFLASH_FIELDS


def head_model(raw: dict) -> type:
    """The head class a checkpoint's config.json describes (`HEAD_MODELS`)."""
    return next(cls for cls in HEAD_MODELS if cls.recognise(raw))


def head_config_dict(head: DraftHead | Eagle3Head, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json content: the draft Llama config plus this project's `eagle_train` block."""
    config = head.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config.update(head.checkpoint_fields())
    config["eagle_train"] = {"type": head.kind, "fc_bias": head.fc.bias is not None, **(meta or {})}
    return config


def check_finite(tensors: Mapping[str, torch.Tensor], where: str | Path) -> None:
    """ValueError naming the first tensor with a NaN or an infinity: a head like that is never written
    or loaded (it would only produce garbage drafts)."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise InputError(
                f"{where}: {name} holds {bad} non-finite values (NaN or inf): refusing this head"
            )


def save_head(head: DraftHead | Eagle3Head, out_dir: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Atomically write the head's weights and config to `out_dir`; ValueError for non-finite weights
    (nothing is written), OSError when the write fails (a full disk)."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.trainable_state_dict().items()}
    check_finite(tensors, out_dir)
    config = head_config_dict(head, meta)

    def write(tmp: Path) -> None:
        try:
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        except SafetensorError as err:  # an I/O error from safetensors' Rust writer
            raise OSError(f"{tmp / WEIGHTS_NAME}: {err}") from err
        config["eagle_train"]["weights_sha256"] = file_sha256(tmp / WEIGHTS_NAME)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    atomic_write_dir(Path(out_dir), write)
    return Path(out_dir)


def recorded_checksums(path: Path) -> list[tuple[str, str, Path]]:
    """(file name, sha256, the file recording it) for the head files of `path` whose checksum was
    recorded when they were saved: config.json's `eagle_train.weights_sha256` (save_head) and, in a
    training checkpoint, the head files training_state/trainer.json lists."""
    recorded = []
    config = read_json(path / CONFIG_NAME, "draft head config")
    sha = config.get("eagle_train", {}).get("weights_sha256") if isinstance(config, dict) else None
    if isinstance(sha, str):
        recorded.append((WEIGHTS_NAME, sha, path / CONFIG_NAME))
    trainer = path / STATE_DIR / TRAINER_FILE
    if trainer.is_file():
        files = read_json(trainer, "trainer state").get("files", {})
        recorded += [(name, files[name], trainer) for name in (WEIGHTS_NAME, CONFIG_NAME) if name in files]
    return recorded


def check_head_files(path: str | Path) -> None:
    """InputError naming the file when a head file of `path` is missing or no longer has the sha256
    recorded when it was saved (`recorded_checksums`): a bit flip, a truncation or an edit since. A head
    without records (another project's, an export) passes."""
    path = Path(path)
    for name, sha, where in recorded_checksums(path):
        if not (path / name).is_file():
            raise InputError(
                f"{path / name}: missing, although {where.name} records its sha256 (the head was saved with "
                "it): restore the file, or use another head"
            )
        if file_sha256(path / name) != sha:
            raise InputError(
                f"{path / name}: its sha256 differs from the one {where.name} recorded when the head was "
                "saved (the file was damaged or changed since; if you changed the weights on purpose, "
                f"remove the record from {where})"
            )


def read_head_weights(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a head's safetensors file; a truncated or foreign file is a ValueError naming it."""
    try:
        return load_file(str(file))
    except SafetensorError as err:
        raise InputError(f"{file}: not a readable safetensors file ({err}): truncated or damaged") from None


def load_head(
    path: str | Path, device: torch.device | str = "cpu", target: SharedTarget | None = None
) -> tuple[DraftHead | Eagle3Head, dict[str, Any]]:
    """Load a head written by `save_head`. Returns (head, meta): with `target`, the head holds the
    target's frozen embedding (EAGLE-1: and LM head; eagle_train.modeling.draft), else call
    `head.share_target_weights(target)` before use. Its files are checked first (`check_head_files`)."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    for f in (config_file, weights_file):
        if not f.is_file():
            raise FileNotFoundError(f"draft checkpoint {path}: missing {f.name}")
    check_head_files(path)
    raw = read_json(config_file, "draft head config")
    head, meta = build_head(raw, read_head_weights(weights_file), config_file, weights_file, target)
    return head.to(device), meta


def build_head(
    raw: dict[str, Any],
    state: dict[str, torch.Tensor],
    config_file: Path,
    weights_file: Path,
    target: SharedTarget | None = None,
) -> tuple[DraftHead | Eagle3Head, dict[str, Any]]:
    """(head, meta) of a checkpoint's config.json content `raw` (its `eagle_train` block: meta) and tensors
    `state`, read from `config_file` and `weights_file` (named in errors): every tensor checked finite and
    matching, none missing or unexpected."""
    raw = dict(raw)
    model = head_model(raw)
    meta = raw.pop("eagle_train", {})
    dropped = ("architectures", "model_type", *HEAD_FIELDS)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in dropped})
    head = model.from_checkpoint(config, raw, meta, config_file, target=target)
    check_finite(state, weights_file)
    head.check_checkpoint_state(state, weights_file)
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shapes that do not fit the config
        raise InputError(f"{weights_file}: tensors do not match {config_file}: {error_reason(err)}") from None
    missing = [k for k in missing if k in head.trainable_state_dict()]
    if missing or unexpected:
        raise InputError(
            f"draft checkpoint {weights_file}: missing keys {missing}, unexpected keys {unexpected}"
        )
    return head, meta
