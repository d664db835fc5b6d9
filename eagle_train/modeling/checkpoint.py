"""Draft-head checkpoints in the serving layout: `model.safetensors` + `config.json`.

The weights are the head's own (fc.*, layers.*): no embedding, no LM head. config.json is the draft's
Llama config (the target's shapes, `num_hidden_layers` = the head's layers) plus an `eagle_train`
block: the target it was trained for, fc bias, training max length. Writes are atomic.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eagle_train.modeling.draft import DraftHead

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def atomic_write_dir(final: Path, write) -> None:
    """Call `write(tmp_dir)` then move tmp_dir to `final` (replacing it), so `final` is never partial.

    Everything in it gets the usual modes (0755 directories, 0644 files under umask 022): mkdtemp makes
    0700 and safetensors writes 0600, modes that survive the rename and keep a server running as another
    user out."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for path in [tmp, *tmp.rglob("*")]:
            if not path.is_symlink():
                os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def head_config_dict(head: DraftHead, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json content: the draft Llama config plus this project's `eagle_train` block."""
    config = head.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["eagle_train"] = {"fc_bias": head.fc.bias is not None, **(meta or {})}
    return config


def save_head(head: DraftHead, out_dir: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Atomically write the head's weights and config to `out_dir`."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.trainable_state_dict().items()}
    config = head_config_dict(head, meta)

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    atomic_write_dir(Path(out_dir), write)
    return Path(out_dir)


def load_head(path: str | Path, device: torch.device | str = "cpu") -> tuple[DraftHead, dict[str, Any]]:
    """Load a head written by `save_head`. Returns (head without the shared weights filled, meta).

    Call `head.share_target_weights(target.embed_tokens, target.lm_head)` before use.
    """
    path = Path(path)
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    for f in (config_file, weights_file):
        if not f.is_file():
            raise FileNotFoundError(f"draft checkpoint {path}: missing {f.name}")
    raw = json.loads(config_file.read_text())
    meta = raw.pop("eagle_train", {})
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    head = DraftHead(config, fc_bias=bool(meta.get("fc_bias", True)))
    state = load_file(str(weights_file))
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.startswith(("fc.", "layers."))]
    if missing or unexpected:
        raise ValueError(
            f"draft checkpoint {weights_file}: missing keys {missing}, unexpected keys {unexpected}"
        )
    return head.to(device), meta
