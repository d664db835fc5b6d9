"""Stage: export a trained head to the layout vLLM, SGLang or the EAGLE reference loads.

    python -m eagle_train.export ckpt=runs/<run>/train/final format=vllm out_dir=exports/<name>
    python -m eagle_train.export ckpt=... format=speculators speculative_tokens=3 out_dir=...  (EAGLE-3, DFlash)

The output directory (config.json + model.safetensors, or pytorch_model.bin for format=eagle) is
written atomically under an exclusive lock (eagle_train.runtime.output_lock); a non-empty directory that
is not an earlier export of the same format is refused unless `overwrite=true`, and nothing but this layout's own
files is ever deleted. config.json carries the target's id and the training maximum length in its
`eagle_train` block, and no local path (a hub id is kept). Layout details and the loaders they were
checked against: eagle_train/interop/layouts.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eagle_train.cli import stage_lock, stage_main
from eagle_train.config.base import resolve_path
from eagle_train.config.export import ExportConfig
from eagle_train.heads import head_kind
from eagle_train.interop.layouts import export_head, load_input_embedding, recorded_target
from eagle_train.interop.reexpress import widen_head
from eagle_train.modeling.head_checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_head
from eagle_train.modeling.target import torch_dtype
from eagle_train.runtime.atomic_files import remove_partial_files
from eagle_train.runtime.errors import InputError

log = logging.getLogger(__name__)


def checkpoint_dir(ckpt: str) -> Path:
    """The checkpoint directory, with a clear error when it or its files are missing."""
    if not ckpt:
        raise InputError("export: set ckpt=DIR (a head checkpoint written by training)")
    path = resolve_path(ckpt)
    if path is None or not Path(path).is_dir():
        raise FileNotFoundError(f"export: checkpoint directory {ckpt} does not exist")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (Path(path) / name).is_file():
            raise FileNotFoundError(f"export: checkpoint {path} has no {name}")
    return Path(path)


def target_architectures(meta: dict, source: str | None) -> list[str] | None:
    """The target's `architectures` (for reference in the export): recorded by training, else read
    from the target's config.json when its source is a local directory."""
    recorded = meta["target"].get("architectures") if isinstance(meta.get("target"), dict) else None
    if recorded:
        return list(recorded)
    config = resolve_path(source) / CONFIG_NAME if source and resolve_path(source) else None
    if config is not None and config.is_file():
        return json.loads(config.read_text()).get("architectures")
    return None


def export_meta(meta: dict, cfg: ExportConfig, ckpt: Path) -> dict:
    """The `eagle_train` block: target id, its hub id (never a local path: config.json is published),
    architectures, config hash, weight files' sha256 and weight fingerprint, training max length."""
    name, source = recorded_target(meta)
    architectures = target_architectures(meta, source)
    if isinstance(meta.get("target"), dict):
        recorded = meta["target"]
        meta = {
            **meta,
            "target_config_hash": recorded.get("config_hash"),
            "target_weights": recorded.get("weights"),
            "target_weight_files": recorded.get("weight_files"),
        }
    target_id = cfg.target_id or name
    max_len = cfg.max_len or meta.get("max_len")
    if target_id is None or max_len is None:
        log.warning("checkpoint %s records no target id or max_len; set target_id=... max_len=...", ckpt)
    # weights_sha256 is the checkpoint file's (modeling.head_checkpoint.check_head_files), not the export's
    meta = {
        k: v for k, v in meta.items() if k not in ("target_source", "source_checkpoint", "weights_sha256")
    }
    if source and not local_path(source):
        meta["target_source"] = source
    return {
        **meta,
        "target": target_id,
        "target_architectures": architectures,
        "max_len": max_len,
        "note": f"trained on sequences of at most {max_len} tokens; expect lower acceptance beyond that",
    }


def local_path(source: str) -> bool:
    """Whether a recorded target source names a local file system path (not a hub id)."""
    return source.startswith(("/", ".", "~")) or Path(source).exists() or source.count("/") > 1


def target_path(cfg: ExportConfig, recorded: dict, ckpt: Path, why: str) -> Path | str:
    """The target's directory (or hub id): `target_path`, else the source the checkpoint records."""
    source = cfg.target_path or recorded_target(recorded)[1]
    if not source:
        raise InputError(f"export ({why}): {ckpt} records no target source; set target_path=...")
    return resolve_path(source) or source


def run(cfg: ExportConfig) -> Path:
    """Export `cfg.ckpt` to `cfg.out_dir` in `cfg.format`; returns the output directory."""
    if not cfg.out_dir:
        raise InputError("export: set out_dir=DIR (the directory to write)")
    ckpt = checkpoint_dir(cfg.ckpt)
    head, recorded = load_head(ckpt)
    meta = export_meta(recorded, cfg, ckpt)
    embed = None
    kind = head_kind(head)
    if cfg.format == "eagle" or kind.ships_embedding:
        source = target_path(cfg, recorded, ckpt, "format=eagle" if cfg.format == "eagle" else kind.title)
        embed = load_input_embedding(source)
    if kind.ships_embedding:  # the head holds the target's embedding (P-EAGLE: its learned row in place)
        kind.hold_embedding(head, embed, recorded, source, ckpt)
        embed = None
    if cfg.head_dim and cfg.head_dim != head.config.head_dim:
        meta["reexpressed"] = {"head_dim": head.config.head_dim, "new_head_dim": cfg.head_dim}
        head = widen_head(head, cfg.head_dim)
    out_dir = resolve_path(cfg.out_dir) or Path(cfg.out_dir)
    with stage_lock(out_dir, "export"):
        if out_dir.parent.is_dir():
            remove_partial_files(out_dir.parent, out_dir.name)  # a killed export's temporary directory
        out = export_head(
            head,
            cfg.format,
            out_dir,
            meta=meta,
            embed_tokens=embed,
            dtype=torch_dtype(cfg.dtype) if cfg.dtype else None,
            fold_bias=cfg.fc_bias == "fold",
            overwrite=cfg.overwrite,
            speculative_tokens=cfg.speculative_tokens,
        )
    log.info("exported %s -> %s (format=%s)", ckpt, out, cfg.format)
    return out


main = stage_main("export", run)


if __name__ == "__main__":
    main()
