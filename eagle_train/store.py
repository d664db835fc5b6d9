"""The feature store: the target's hidden states per conversation, in sharded safetensors files.

Layout of a store directory (written by `python -m eagle_train.extract`, read by training):

    store_config.json          identity of the contents (target and its weight fingerprint, dtype,
                               template, max_len, data hash), written before the first shard so that a
                               rerun can resume or refuse
    shard-00000.safetensors    one shard: the samples [start, stop) of the tokenized data, in data order
                               (the file format: eagle_train.shard; the same samples give the same bytes)
    shard-00000.json           the shard's sidecar (range, store hash, counts, sha256, the file's size and
                               mtime when last verified), written after the shard: a shard without a
                               valid sidecar is incomplete and is redone on a rerun
    manifest.json              written once, at the end, by the main process: the store is complete

Only real tokens are stored, never padding. A store for EAGLE-3 heads (manifest `aux_layers`: the target
layers whose inputs it holds) has a fifth tensor per shard, `aux` [tokens, 3 * hidden]: 4 hidden states
per token, 4x the bytes; without `aux_layers` the layout is exactly the EAGLE-1 one. A rerun keeps a
shard whose sidecar matches the plan and the store hash; its sha256 is recomputed only if the file's size,
mtime or inode changed since it was last verified (a resume does not re-read the store). Broken metadata
names its file: a broken manifest.json or store_config.json is rewritten by a rerun (the other one, or the
shards' store hash, still says what the store holds).

`FeatureStore` reads a complete store with random access, checked before use: when it is opened, the
manifest's shard list (contiguous ranges, names, counts), every shard's header and offsets and the
uniqueness of the sample ids; the first time a shard is read in a process, its sha256 and value ranges
(token ids inside the vocabulary). Each shard is memory-mapped, so a sample costs one copy of its own rows.
Torch, numpy and safetensors only: no transformers, no datasets.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle_train.config.base import config_hash, flatten, mismatches
from eagle_train.files import (
    FileFormatError,
    atomic_path,
    atomic_write_json,
    file_sha256,
    read_json,
    remove_partial_files,
)
from eagle_train.shard import HIDDEN_DTYPES, ShardError, ShardFile, token_dtype, write_shard_file

log = logging.getLogger(__name__)
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
STORE_CONFIG_NAME = "store_config.json"
# HF config keys that say nothing about the model's function (paths, versions, load-time choices)
_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "use_cache"}


class StoreMismatchError(ValueError):
    """A store (or an existing out_dir) does not match what the caller expects; names each field."""


class StoreError(ValueError):
    """A store directory is missing, incomplete or corrupt."""


# ---------------------------------------------------------------- small helpers


def shard_name(index: int) -> str:
    """File name of shard `index`."""
    return f"shard-{index:05d}.safetensors"


def target_config_hash(hf_config: dict[str, Any], length: int = 16) -> str:
    """Hash of a target's Hugging Face config (`config.to_dict()`), without paths, versions and dtype.

    Training recomputes it from `load_target_config(cfg).to_dict()` and checks it against the
    manifest's `target.config_hash`.
    """
    kept = {k: v for k, v in hf_config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps(kept, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


# ---------------------------------------------------------------- writing


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


def content_key(identity: dict[str, Any]) -> dict[str, Any]:
    """The identity fields that decide the contents: everything but display names and the data path
    (the data is identified by its sha256)."""
    key = json.loads(json.dumps(identity))
    key.get("target", {}).pop("name", None)
    for field in ("name", "path"):
        key.get("data", {}).pop(field, None)
    return key


def store_hash(identity: dict[str, Any]) -> str:
    """The manifest's `config_hash`: a hash of `content_key(identity)`; each shard's sidecar carries it."""
    return config_hash(content_key(identity))


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
        # `aux_layers` is compared even when this run has none: an EAGLE-3 store is not an EAGLE-1 one
        fields = [*identity, *(["aux_layers"] if "aux_layers" in existing else [])]
        diffs = mismatches(content_key(identity), content_key({k: existing.get(k) for k in fields}))
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


def recorded_identity(out_dir: Path) -> tuple[str, dict[str, Any] | None]:
    """(file name, identity) of an existing store: the manifest, else the store config; a broken one is
    logged (a rerun rewrites it) and the other is used."""
    for name in (MANIFEST_NAME, STORE_CONFIG_NAME):
        if (out_dir / name).is_file():
            try:
                found = read_json(out_dir / name, "feature store metadata")
            except FileFormatError as err:
                log.warning("%s; this run rewrites it", err)
                continue
            if isinstance(found, dict):
                return name, found
            log.warning("%s: not a JSON object; this run rewrites it", out_dir / name)
    return "", None


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
    hidden_dtype: str,
    vocab_size: int,
    extra: dict[str, Any] | None = None,
    hidden: Any = None,
    hidden_size: int | None = None,
    aux_size: int = 0,
) -> dict[str, Any]:
    """Write shard `index` atomically, then its sidecar; return the sidecar (shard info).

    samples: dicts with "id" (str), "input_ids" (int [L]), "loss_mask" (bool/int [L]) and "hidden"
    (float [L, hidden]) and, for an EAGLE-3 store, "aux" (float [L, 3 * hidden], every sample or none);
    or, streamed, without them: then `hidden(put)` calls `put(i, [L_i, hidden_size], aux)` for every
    sample, aux [L_i, aux_size] when `aux_size` (eagle_train.shard.write_shard_file). `extra` (e.g. the
    sample range and the store hash) goes into the sidecar.
    """
    out_dir = Path(out_dir)
    if not samples:
        raise ValueError(f"shard {index}: no samples")
    if hidden is None:
        hidden_size = int(torch.as_tensor(samples[0]["hidden"]).shape[-1])
        aux_size = int(torch.as_tensor(samples[0]["aux"]).shape[-1]) if "aux" in samples[0] else 0

        def hidden(put):
            for i, sample in enumerate(samples):
                aux = torch.as_tensor(sample["aux"]) if aux_size else None
                put(i, torch.as_tensor(sample["hidden"]), aux)

    final = out_dir / shard_name(index)
    masks = [np.asarray(s["loss_mask"], dtype=np.uint8) for s in samples]
    with atomic_path(final) as tmp:
        write_shard_file(
            tmp,
            [str(s["id"]) for s in samples],
            [s["input_ids"] for s in samples],
            masks,
            hidden_size,
            HIDDEN_DTYPES[hidden_dtype],
            token_dtype(vocab_size),
            hidden,
            {"schema_version": str(SCHEMA_VERSION)},
            aux_size,
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


# ---------------------------------------------------------------- reading

SHARD_FIELDS = ("file", "index", "start", "stop", "num_samples", "num_tokens", "sha256", "bytes")


class FeatureStore:
    """Random access to a complete store written by `eagle_train.extract`, checked before use.

    `manifest` is the parsed manifest.json; `ids` and `lengths` come from the shard headers (no hidden
    state is read); `store[i]` returns {"id", "input_ids" LongTensor[L], "loss_mask" BoolTensor[L],
    "hidden" Tensor[L, hidden] in the stored dtype} (+ "aux" Tensor[L, 3 * hidden] when opened with
    `aux=True`: the inputs of `aux_layers`, EAGLE-3's features; an EAGLE-1 run never reads them).
    Opening checks the structure (StoreError naming the file and what is wrong); a shard's sha256 and
    value ranges are checked the first time it is read in a process (`verify()` checks them all now).
    `expected` (dotted manifest fields) is checked first, as `check_compatible`. Picklable (for
    DataLoader workers): the memory maps are reopened lazily in each process.
    """

    def __init__(self, path: str | Path, expected: dict[str, Any] | None = None, aux: bool = False):
        self.path, self.aux = Path(path), aux
        self.manifest = self._read_manifest()
        if expected:  # the contents asked for (e.g. this target's) before the consistency of the files
            self.check_compatible(expected)
        entries = self.manifest["shards"]
        self._check_entries(entries)
        hidden_size = self.manifest.get("target", {}).get("hidden_size")
        self._shards = [self._open_shard(info, hidden_size) for info in entries]
        self._verified = [False] * len(self._shards)
        self.ids: list[str] = [i for shard in self._shards for i in shard.ids]
        self._check_unique_ids()
        self.lengths: list[int] = [int(n) for shard in self._shards for n in np.diff(shard.offsets)]
        # first global sample index of each shard, and the total: [num_shards + 1]
        self._starts = np.cumsum([0] + [len(shard.ids) for shard in self._shards])

    def _read_manifest(self) -> dict[str, Any]:
        manifest_file = self.path / MANIFEST_NAME
        if not manifest_file.is_file():
            hint = (
                " (extraction not finished: rerun it to resume)"
                if (self.path / STORE_CONFIG_NAME).exists()
                else ""
            )
            raise StoreError(f"{self.path}: not a complete feature store, no {MANIFEST_NAME}{hint}")
        try:
            manifest = read_json(manifest_file, "feature store manifest")
        except FileFormatError as err:
            raise StoreError(f"{err}: rerun the extraction to rewrite it") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
            raise StoreError(f"{manifest_file}: not a feature store manifest (no list of shards)")
        version = manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise StoreMismatchError(
                f"{manifest_file}: schema_version: expected {SCHEMA_VERSION}, found {version!r} "
                "(re-extract the features with this version)"
            )
        return manifest

    def _check_entries(self, entries: list[Any]) -> None:
        """The manifest's shards tile the samples: shard k is shard_name(k), starting where k-1 stopped."""
        stop = 0
        for k, info in enumerate(entries):
            if not isinstance(info, dict) or any(f not in info for f in SHARD_FIELDS):
                raise StoreError(f"{self.path / MANIFEST_NAME}: shard entry {k} lacks one of {SHARD_FIELDS}")
            if (info["index"], info["file"], info["start"]) != (k, shard_name(k), stop) or (
                info["stop"] - info["start"] != info["num_samples"]
            ):
                raise StoreError(
                    f"{self.path / MANIFEST_NAME}: shard entry {k} ({info['file']}, samples "
                    f"{info['start']}:{info['stop']}) does not follow the one before (expected {shard_name(k)} "
                    f"from sample {stop})"
                )
            stop = info["stop"]

    def _open_shard(self, info: dict[str, Any], hidden_size: int | None) -> ShardFile:
        file = self.path / info["file"]
        if not file.is_file():
            raise StoreError(f"{self.path}: shard {info['file']} listed in {MANIFEST_NAME} is missing")
        try:
            shard = ShardFile(file, hidden_size)
        except ShardError as err:
            raise StoreError(str(err)) from None
        if len(shard.ids) != info["num_samples"] or int(shard.offsets[-1]) != info["num_tokens"]:
            raise StoreError(
                f"{file}: {len(shard.ids)} samples of {int(shard.offsets[-1])} tokens, {MANIFEST_NAME} says "
                f"{info['num_samples']} of {info['num_tokens']}"
            )
        if shard.size != info["bytes"]:
            raise StoreError(f"{file}: {shard.size} bytes, {MANIFEST_NAME} says {info['bytes']}")
        if bool(self.manifest.get("aux_layers")) != ("aux" in shard.header):
            held = "holds an `aux` tensor" if "aux" in shard.header else "has no `aux` tensor"
            raise StoreError(f"{file}: the shard {held}, {MANIFEST_NAME} aux_layers is {self.aux_layers}")
        return shard

    def _check_unique_ids(self) -> None:
        if len(set(self.ids)) == len(self.ids):
            return
        seen: dict[str, int] = {}
        for s, shard in enumerate(self._shards):
            for sample_id in shard.ids:
                if sample_id in seen:
                    raise StoreError(
                        f"{self.path}: sample id {sample_id!r} is in {shard_name(seen[sample_id])} and "
                        f"{shard_name(s)}: a shard is duplicated or misplaced (re-extract the store)"
                    )
                seen[sample_id] = s

    def shard(self, s: int) -> ShardFile:
        """Shard `s`, its sha256 and value ranges verified on first use in this process."""
        if not self._verified[s]:
            info = self.manifest["shards"][s]
            try:
                self._shards[s].verify(info["sha256"], self.manifest.get("target", {}).get("vocab_size"))
            except ShardError as err:
                raise StoreError(str(err)) from None
            self._verified[s] = True
        return self._shards[s]

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, i: int) -> tuple[ShardFile, int, int, int]:
        """(shard, index in the shard, first row, end row) of sample i."""
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)}")
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        shard, j = self.shard(s), i - int(self._starts[s])
        return shard, j, int(shard.offsets[j]), int(shard.offsets[j + 1])

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample i's input_ids LongTensor[L] and loss_mask BoolTensor[L], without its hidden states."""
        shard, _, begin, end = self._locate(i)
        return shard.rows("input_ids", begin, end).long(), shard.rows("loss_mask", begin, end).bool()

    def __getitem__(self, i: int) -> dict[str, Any]:
        shard, j, begin, end = self._locate(i)
        sample = {
            "id": shard.ids[j],
            "input_ids": shard.rows("input_ids", begin, end).long(),  # [L]
            "loss_mask": shard.rows("loss_mask", begin, end).bool(),  # [L]
            "hidden": shard.rows("hidden", begin, end),  # [L, hidden]
        }
        if self.aux:
            if not self.aux_layers:
                raise StoreError(f"{self.path}: no aux features (extracted without aux=true)")
            sample["aux"] = shard.rows("aux", begin, end)  # [L, 3 * hidden]
        return sample

    @property
    def aux_layers(self) -> list[int]:
        """The target layers whose inputs the store holds (EAGLE-3's features); [] for an EAGLE-1 store."""
        return list(self.manifest.get("aux_layers") or [])

    @property
    def hidden_dtype(self) -> torch.dtype:
        return HIDDEN_DTYPES[self.manifest["dtype"]]

    def check_compatible(self, expected: dict[str, Any]) -> None:
        """Raise StoreMismatchError naming every dotted manifest field (e.g. "target.hidden_size")
        whose value differs from `expected`."""
        found = flatten(self.manifest)
        diffs = [
            f"{key}: expected {value!r}, found {found.get(key, '<missing>')!r}"
            for key, value in expected.items()
            if found.get(key, "<missing>") != value
        ]
        if diffs:
            raise StoreMismatchError(f"feature store {self.path} does not match: " + "; ".join(diffs))

    def content_hash(self) -> str:
        """What identifies the contents (not the path): the config hash and every shard's sha256."""
        shas = [info["sha256"] for info in self.manifest["shards"]]
        blob = json.dumps([self.manifest.get("config_hash"), shas]).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def verify(self) -> None:
        """Check every shard's sha256 and value ranges now (reads the whole store)."""
        for s in range(len(self._shards)):
            self.shard(s)

    def __getstate__(self) -> dict[str, Any]:
        for shard in self._shards:
            shard.close()
        return self.__dict__.copy()
