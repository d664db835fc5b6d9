"""Writing a feature store: the shard planner, the output directory, shards (`ShardWriter`) with their
sidecars, the manifest.

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
verified, if a reader (training) found it damaged and said so in its sidecar (`mark_damaged`), or with
`verify=full` (every kept shard re-read): a shard whose bytes differ is extracted again. Broken metadata
names its file: a broken manifest.json or store_config.json is rewritten by a rerun (the other one, or
the shards' store hash, still says what the store holds). A shard is written under a temporary name and
renamed into place, so nothing half written is ever taken for a shard. The manifest of a complete store
stays in place through a rerun that keeps every shard and is replaced atomically at its end; it is
removed only when a shard is about to be written again (the store is then incomplete until the end).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

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
from eagle_train.store.shard import ShardFileWriter, token_dtype

T = TypeVar("T")

log = logging.getLogger(__name__)


def shard_name(index: int) -> str:
    """File name of shard `index`."""
    return f"shard-{index:05d}.safetensors"


def stream_shards(
    items: Iterable[T],
    tokens: Callable[[T], int],
    bytes_per_token: int,
    shard_samples: int | None,
    shard_bytes: int,
) -> Iterator[tuple[int, int, list[T]]]:
    """The one shard planner: cut `items` (samples in data order, `tokens(item)` tokens each) into shards
    and yield (start, stop, items) of each as soon as it is full. A shard closes before the sample that
    would take it past `shard_samples` samples or `shard_bytes` bytes of features (a shard holds at least
    one). A pure function of the token counts, so every process and every rerun cuts the same shards,
    streamed (extraction) or not (`plan_shards`)."""
    start, size, pending = 0, 0, []
    for item in items:
        nbytes = tokens(item) * bytes_per_token
        full = shard_samples is not None and len(pending) >= shard_samples
        if pending and (full or size + nbytes > shard_bytes):
            yield start, start + len(pending), pending
            start, size, pending = start + len(pending), 0, []
        pending.append(item)
        size += nbytes
    if pending:
        yield start, start + len(pending), pending


def plan_shards(
    lengths: Sequence[int], bytes_per_token: int, shard_samples: int | None, shard_bytes: int
) -> list[tuple[int, int]]:
    """The shards [start, stop) of samples of `lengths` tokens (`stream_shards` over a list)."""
    return [
        (start, stop)
        for start, stop, _ in stream_shards(lengths, int, bytes_per_token, shard_samples, shard_bytes)
    ]


def prepare_out_dir(out_dir: str | Path, identity: dict[str, Any], overwrite: bool) -> None:
    """Make `out_dir` ready for an extraction with `identity`: refuse (or with `overwrite`, clear) a
    store made with a different config; keep a matching one's shards (a rerun resumes) and its manifest
    (replaced at the end, or removed when a shard is written again: `write_shard`). Broken metadata is
    named and rewritten; what killed writes left (`.NAME.partial-*`) is removed."""
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
    """Check that every planned shard has its sidecar, write manifest.json atomically (the store is then
    complete), then remove the shards outside the plan (no manifest names them). Returns the manifest."""
    out_dir = Path(out_dir)
    shards = []
    for index, (start, stop) in enumerate(plan):
        info = read_sidecar(out_dir / shard_name(index))
        if info is None or (info.get("start"), info.get("stop")) != (start, stop):
            raise StoreError(f"{out_dir}: shard {index} (samples {start}:{stop}) is missing or incomplete")
        info.pop("verified", None)  # local to this copy of the store
        shards.append(info)
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
    planned = {shard_name(i) for i in range(len(plan))}
    for stale in out_dir.glob("shard-*.safetensors"):
        if stale.name not in planned:
            stale.unlink()
            sidecar_path(stale).unlink(missing_ok=True)
    return manifest


def _package_version() -> str:
    try:
        return importlib.metadata.version("eagle-train")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ShardWriter:
    """Shard `index` of the store at `out_dir`, written push-style as its features come:

        with ShardWriter(out_dir, index, samples, dtype, vocab_size, widths, extra) as shard:
            shard.put(rows, hidden, aux)    # rows: sample indices; hidden[k]: sample rows[k]'s features
        shard.info                          # the sidecar

    samples: dicts with "id" (str), "input_ids" (int [L]) and "loss_mask" (bool/int [L]); widths: the
    features and their row widths ({"hidden": d}, EAGLE-3 also "aux": 3 * d); `dtype` the stored dtype
    (eagle_train.store.codec: bfloat16 | float16 | float32 | fp8); `extra` (e.g. the sample range and
    the store hash) goes into the sidecar. The file is written under a temporary name (its bytes:
    eagle_train.store.shard) and published when the block ends with every sample's features, then its
    sidecar; an error leaves nothing behind. A manifest in `out_dir` is removed first: the store is
    incomplete until the next one is written."""

    def __init__(
        self,
        out_dir: str | Path,
        index: int,
        samples: Sequence[dict[str, Any]],
        dtype: str,
        vocab_size: int,
        widths: dict[str, int],
        extra: dict[str, Any] | None = None,
    ):
        if not samples:
            raise ValueError(f"shard {index}: no samples")
        self.final = Path(out_dir) / shard_name(index)
        self.index, self.samples, self.dtype, self.vocab_size = index, samples, dtype, vocab_size
        self.widths, self.extra = widths, extra or {}
        self.lengths = [len(s["input_ids"]) for s in samples]
        self.info: dict[str, Any] | None = None

    def __enter__(self) -> ShardWriter:
        self._context = self._written()
        self._context.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return bool(self._context.__exit__(exc_type, exc, tb))

    def put(
        self,
        rows: Sequence[int],
        hidden: torch.Tensor | Sequence[torch.Tensor],
        aux: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        """The features of samples `rows`: a right-padded batch (hidden [b, T, hidden], aux [b, T, 3 *
        hidden]: row k holds sample rows[k]'s L tokens first, only those are stored) or one tensor per
        sample (hidden[k] [L, hidden], exactly)."""
        padded = isinstance(hidden, torch.Tensor)
        for k, i in enumerate(rows):
            cut = slice(self.lengths[i]) if padded else slice(None)  # a padded row's real tokens
            more = {} if aux is None else {"aux": aux[k][cut]}
            self._file.put(i, hidden[k][cut], **more)

    @contextmanager
    def _written(self) -> Iterator[None]:
        (self.final.parent / MANIFEST_NAME).unlink(missing_ok=True)  # incomplete until its next manifest
        masks = [np.asarray(s["loss_mask"], dtype=np.uint8) for s in self.samples]
        with atomic_path(self.final) as tmp:
            with ShardFileWriter(
                tmp,
                [str(s["id"]) for s in self.samples],
                [s["input_ids"] for s in self.samples],
                masks,
                self.widths,
                storage(self.dtype),
                self.widths["hidden"],
                token_dtype(self.vocab_size),
                {"schema_version": str(SCHEMA_VERSION)},
            ) as self._file:
                yield
            self.info = {
                "file": self.final.name,
                "index": self.index,
                "num_samples": len(self.samples),
                "num_tokens": sum(len(m) for m in masks),
                "num_assistant_tokens": int(sum(int(m.sum()) for m in masks)),
                "sha256": file_sha256(tmp),
                "bytes": os.path.getsize(tmp),
                **self.extra,
            }
        atomic_write_json(sidecar_path(self.final), {**self.info, "verified": stat_key(self.final)})


def write_shard(
    out_dir: str | Path,
    index: int,
    samples: Sequence[dict[str, Any]],
    dtype: str,
    vocab_size: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write shard `index` of samples that carry their features ("hidden" [L, hidden], optionally "aux"
    [L, k * hidden], every sample or none) with a `ShardWriter`; return its sidecar."""
    if not samples:
        raise ValueError(f"shard {index}: no samples")
    names = [name for name in ("hidden", "aux") if name in samples[0]]
    widths = {name: int(torch.as_tensor(samples[0][name]).shape[-1]) for name in names}
    features = {name: [torch.as_tensor(s[name]) for s in samples] for name in names}
    with ShardWriter(out_dir, index, samples, dtype, vocab_size, widths, extra) as shard:
        shard.put(range(len(samples)), features["hidden"], features.get("aux"))
    return shard.info


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


def completed_shard(
    out_dir: str | Path, index: int, expected: dict[str, Any], full: bool = False
) -> dict[str, Any] | None:
    """The sidecar of shard `index` if the shard is complete: sidecar present, its fields equal
    `expected` (e.g. the planned sample range and the store hash) and the file's size and sha256
    match. The sha256 is recomputed when the file changed (size, mtime, inode) since it was last
    verified, when a reader marked it damaged (`mark_damaged`) or with `full`; the sidecar then records
    the new verification. Else None (the shard is extracted again)."""
    shard = Path(out_dir) / shard_name(index)
    info = read_sidecar(shard)
    if info is None or any(info.get(k) != v for k, v in expected.items()):
        return None
    if info.get("bytes") != shard.stat().st_size:
        return None
    if full or info.get("verified") != stat_key(shard):
        if info.get("sha256") != file_sha256(shard):
            log.warning(
                "%s: its sha256 differs from %s: extracting it again", shard, sidecar_path(shard).name
            )
            return None
        info.pop("damaged", None)
        info["verified"] = stat_key(shard)
        atomic_write_json(sidecar_path(shard), info)
    return info


def mark_damaged(shard: Path, reason: str) -> bool:
    """Record in the sidecar of `shard` that a reader found it damaged (`reason`) and drop its last
    verification, so the next extraction run re-hashes it and extracts it again if its bytes differ
    (a shard rotted in place keeps its size and mtime). False when the sidecar cannot be written (a
    read-only store: then only `verify=full` finds it); True also when it has no sidecar (redone anyway)."""
    info = read_sidecar(shard)
    if info is None:
        return True
    info.pop("verified", None)
    try:
        atomic_write_json(sidecar_path(shard), {**info, "damaged": reason})
    except OSError:
        return False
    return True


def remove_store_files(out_dir: str | Path) -> None:
    """Delete what a store writes (manifest, store config, shards, sidecars, temp files); nothing else."""
    out_dir = Path(out_dir)
    for pattern in (MANIFEST_NAME, STORE_CONFIG_NAME, "shard-*.safetensors", "shard-*.json"):
        for f in out_dir.glob(pattern):
            f.unlink(missing_ok=True)
    remove_partial_files(out_dir)
