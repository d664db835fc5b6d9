"""Writing a feature store: the shard plan, the output directory, shards with their sidecars, the manifest.

Layout of a store directory (written by `python -m eagle_train.extract`, read by `eagle_train.store.reader`):

    store_config.json          the store's identity (eagle_train.store.manifest), written before the first
                               shard so that a rerun can resume or refuse
    shard-00000.safetensors    one shard: the samples [start, stop) of the tokenized data, in data order
                               (the file format: eagle_train.store.shard; the same samples give the same bytes)
    shard-00000.json           the shard's sidecar (range, store hash, counts, sha256, the file's size and
                               mtime when last verified), written after the shard: a shard without a
                               valid sidecar is incomplete and is redone on a rerun
    manifest.json              written once, at the end, by the main process: the store is complete

Only real tokens are stored, never padding. A rerun keeps a shard whose sidecar matches the plan and the
store hash; its sha256 is recomputed only if the file's size, mtime or inode changed since it was last
verified (a resume does not re-read the store). Broken metadata names its file: a broken manifest.json or
store_config.json is rewritten by a rerun (the other one, or the shards' store hash, still says what the
store holds). A shard is written under a temporary name and renamed into place, so nothing half written
is ever taken for a shard.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle_train.config.base import mismatches
from eagle_train.runtime.atomic_files import (
    FileFormatError,
    atomic_path,
    atomic_write_json,
    file_sha256,
    read_json,
    remove_partial_files,
)
from eagle_train.store.codec import storage
from eagle_train.store.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    STORE_CONFIG_NAME,
    StoreError,
    StoreMismatchError,
    content_key,
    identity_fields,
    recorded_identity,
    store_hash,
)
from eagle_train.store.shard import Fill, token_dtype, write_shard_file


def shard_name(index: int) -> str:
    """File name of shard `index`."""
    return f"shard-{index:05d}.safetensors"


def shard_closes(count: int, size: int, nbytes: int, shard_samples: int | None, shard_bytes: int) -> bool:
    """Whether a shard holding `count` samples and `size` bytes of hidden states closes before the next
    sample (`nbytes`): it would exceed `shard_samples` or `shard_bytes` (a shard holds at least one)."""
    return count > 0 and (
        (shard_samples is not None and count >= shard_samples) or size + nbytes > shard_bytes
    )


def plan_shards(
    lengths: Sequence[int], bytes_per_token: int, shard_samples: int | None, shard_bytes: int
) -> list[tuple[int, int]]:
    """Cut samples 0..n-1, in order, into shards [start, stop) by `shard_closes`. A pure function of the
    lengths, so every process and every rerun gets the same plan (extraction applies the same rule as
    the samples stream in)."""
    plan: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, length in enumerate(lengths):
        nbytes = length * bytes_per_token
        if shard_closes(i - start, size, nbytes, shard_samples, shard_bytes):
            plan.append((start, i))
            start, size = i, 0
        size += nbytes
    if start < len(lengths):
        plan.append((start, len(lengths)))
    return plan


def prepare_out_dir(out_dir: str | Path, identity: dict[str, Any], overwrite: bool) -> None:
    """Make `out_dir` ready for an extraction with `identity`: refuse (or with `overwrite`, clear) a
    store made with a different config; keep a matching one's shards (a rerun resumes). Broken metadata
    is named and rewritten; what killed writes left (`.NAME.partial-*`) is removed."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise StoreError(f"out_dir {out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    name, existing = recorded_identity(out_dir)
    if existing is not None:
        diffs = mismatches(content_key(identity), content_key(identity_fields(existing)))
        refusal = f"a different config ({name}): " + "; ".join(diffs)
    else:
        others = sorted({s for s in shard_store_hashes(out_dir) if s != store_hash(identity)})
        diffs = others
        refusal = (
            f"shards of another store (store hash {others[0] if others else ''}) and no readable metadata"
        )
    if diffs and not overwrite:
        raise StoreMismatchError(
            f"{out_dir} holds a feature store made with {refusal}. Pass overwrite=true to replace it, "
            "or choose another out_dir."
        )
    if diffs:
        remove_store_files(out_dir)
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)  # incomplete until the end of this run
    remove_partial_files(out_dir)  # shards and sidecars being written when a run was killed
    atomic_write_json(out_dir / STORE_CONFIG_NAME, identity)


def shard_store_hashes(out_dir: Path) -> set[str]:
    """The store hashes recorded in the readable sidecars of `out_dir`."""
    hashes = set()
    for side in out_dir.glob("shard-*.json"):
        try:
            recorded = read_json(side).get("store")
        except (FileFormatError, AttributeError):
            continue
        if recorded is not None:  # shards without one are redone (completed_shard asks for it)
            hashes.add(str(recorded))
    return hashes


def write_manifest(
    out_dir: str | Path,
    identity: dict[str, Any],
    plan: Sequence[tuple[int, int]],
    report: dict[str, Any],
    content_hash: str,
) -> dict[str, Any]:
    """Check that every planned shard has its sidecar, remove shards outside the plan, and write
    manifest.json atomically (the store is then complete). Returns the manifest."""
    out_dir = Path(out_dir)
    shards = []
    for index, (start, stop) in enumerate(plan):
        info = read_sidecar(out_dir / shard_name(index))
        if info is None or (info.get("start"), info.get("stop")) != (start, stop):
            raise StoreError(f"{out_dir}: shard {index} (samples {start}:{stop}) is missing or incomplete")
        info.pop("verified", None)  # local to this copy of the store
        shards.append(info)
    planned = {shard_name(i) for i in range(len(plan))}
    for stale in out_dir.glob("shard-*.safetensors"):
        if stale.name not in planned:
            stale.unlink()
            sidecar_path(stale).unlink(missing_ok=True)
    tokens = sum(s["num_tokens"] for s in shards)
    nbytes = sum(s["bytes"] for s in shards)
    counts = {
        "conversations": sum(s["num_samples"] for s in shards),
        "tokens": tokens,
        "assistant_tokens": sum(s["num_assistant_tokens"] for s in shards),
        "bytes": nbytes,
        "bytes_per_token": nbytes / max(tokens, 1),
        "seen": report.get("seen", 0),
        "skipped": report.get("counts", {}),
        "fixes": report.get("fixes", {}),
    }
    manifest = {
        **identity,
        "config_hash": content_hash,
        "counts": counts,
        "shards": shards,
        "created_by": {"tool": "eagle_train.extract", "version": _package_version()},
    }
    atomic_write_json(out_dir / MANIFEST_NAME, manifest)
    return manifest


def _package_version() -> str:
    try:
        return importlib.metadata.version("eagle-train")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def write_shard(
    out_dir: str | Path,
    index: int,
    samples: Sequence[dict[str, Any]],
    dtype: str,
    vocab_size: int,
    extra: dict[str, Any] | None = None,
    fill: Fill | None = None,
    widths: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Write shard `index` atomically, then its sidecar; return the sidecar (shard info).

    samples: dicts with "id" (str), "input_ids" (int [L]), "loss_mask" (bool/int [L]) and the features
    "hidden" (float [L, hidden]) and optionally "aux" (float [L, k * hidden], every sample or none); or,
    streamed, without features: then `fill(put)` calls `put(i, hidden, aux=...)` for every sample and
    `widths` names the features and their row widths (eagle_train.store.shard.write_shard_file). `dtype`
    is the stored dtype (eagle_train.store.codec: bfloat16 | float16 | float32 | fp8); `extra` (e.g. the
    sample range and the store hash) goes into the sidecar.
    """
    out_dir = Path(out_dir)
    if not samples:
        raise ValueError(f"shard {index}: no samples")
    if fill is None:
        names = [name for name in ("hidden", "aux") if name in samples[0]]
        widths = {name: int(torch.as_tensor(samples[0][name]).shape[-1]) for name in names}

        def fill(put):
            for i, sample in enumerate(samples):
                put(i, **{name: torch.as_tensor(sample[name]) for name in names})

    final = out_dir / shard_name(index)
    masks = [np.asarray(s["loss_mask"], dtype=np.uint8) for s in samples]
    with atomic_path(final) as tmp:
        write_shard_file(
            tmp,
            [str(s["id"]) for s in samples],
            [s["input_ids"] for s in samples],
            masks,
            widths,
            storage(dtype),
            widths["hidden"],
            token_dtype(vocab_size),
            fill,
            {"schema_version": str(SCHEMA_VERSION)},
        )
        info = {
            "file": final.name,
            "index": index,
            "num_samples": len(samples),
            "num_tokens": sum(len(m) for m in masks),
            "num_assistant_tokens": int(sum(int(m.sum()) for m in masks)),
            "sha256": file_sha256(tmp),
            "bytes": os.path.getsize(tmp),
            **(extra or {}),
        }
    atomic_write_json(sidecar_path(final), {**info, "verified": stat_key(final)})
    return info


def stat_key(file: Path) -> dict[str, int]:
    """What says a file is unchanged since it was verified: size, mtime and inode."""
    st = file.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def sidecar_path(shard_file: str | Path) -> Path:
    """shard-00000.safetensors -> shard-00000.json."""
    return Path(shard_file).with_suffix(".json")


def read_sidecar(shard: Path) -> dict[str, Any] | None:
    """A shard's sidecar, or None when the shard or its sidecar is missing or unreadable."""
    side = sidecar_path(shard)
    if not (shard.is_file() and side.is_file()):
        return None
    try:
        info = read_json(side)
    except FileFormatError:
        return None
    return info if isinstance(info, dict) else None


def completed_shard(out_dir: str | Path, index: int, expected: dict[str, Any]) -> dict[str, Any] | None:
    """The sidecar of shard `index` if the shard is complete: sidecar present, its fields equal
    `expected` (e.g. the planned sample range and the store hash) and the file's size and sha256
    match. The sha256 is recomputed only when the file changed (size, mtime, inode) since it was last
    verified, and the sidecar then records the new verification. Else None."""
    shard = Path(out_dir) / shard_name(index)
    info = read_sidecar(shard)
    if info is None or any(info.get(k) != v for k, v in expected.items()):
        return None
    if info.get("bytes") != shard.stat().st_size:
        return None
    if info.get("verified") != stat_key(shard):
        if info.get("sha256") != file_sha256(shard):
            return None
        info["verified"] = stat_key(shard)
        atomic_write_json(sidecar_path(shard), info)
    return info


def remove_store_files(out_dir: str | Path) -> None:
    """Delete what a store writes (manifest, store config, shards, sidecars, temp files); nothing else."""
    out_dir = Path(out_dir)
    for pattern in (MANIFEST_NAME, STORE_CONFIG_NAME, "shard-*.safetensors", "shard-*.json"):
        for f in out_dir.glob(pattern):
            f.unlink(missing_ok=True)
    remove_partial_files(out_dir)
