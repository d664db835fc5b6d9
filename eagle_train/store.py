"""The feature store: the target's hidden states per conversation, in sharded safetensors files.

Layout of a store directory (written by `python -m eagle_train.extract`, read by training):

    store_config.json          identity of the contents (target, dtype, template, max_len, data hash),
                               written first so that a rerun can resume or refuse
    shard-00000.safetensors    one shard: the samples [start, stop) of the tokenized data, in data order
    shard-00000.json           the shard's sidecar (range, counts, sha256), written after the shard: a shard
                               without a valid sidecar is incomplete and is redone on a rerun
    manifest.json              written once, at the end, by the main process: the store is complete

A shard holds four tensors: `hidden` [total_tokens, hidden] in the stored dtype, `input_ids` [total_tokens]
(uint16 when the vocabulary fits, else int32), `loss_mask` [total_tokens] uint8 and `offsets`
[num_samples + 1] int64 (sample i is rows offsets[i]:offsets[i+1]); the sample ids are a JSON list in the
safetensors metadata (`ids`). Only real tokens are stored, never padding. A store for EAGLE-3 heads
(manifest `aux_layers`: the target layers whose inputs it holds) has a fifth, `aux` [total_tokens,
3 * hidden]: 4 hidden states per token, 4x the bytes. Without `aux_layers` the layout is exactly the
EAGLE-1 one (schema 1).

`FeatureStore` reads a store with random access: each shard file is memory-mapped (numpy memmap of the
safetensors data region) on first use, so a sample costs one copy of its own rows, never a shard load.
Torch, numpy and safetensors only: no transformers, no datasets.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from eagle_train.files import atomic_path, atomic_write_json, file_sha256

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
STORE_CONFIG_NAME = "store_config.json"
HIDDEN_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# safetensors dtype tag -> (numpy dtype used to map the bytes, torch dtype to view them as)
_ST_DTYPES = {
    "BF16": (np.uint16, torch.bfloat16),
    "F16": (np.float16, torch.float16),
    "F32": (np.float32, torch.float32),
    "U16": (np.uint16, None),
    "I32": (np.int32, torch.int32),
    "I64": (np.int64, torch.int64),
    "U8": (np.uint8, torch.uint8),
}
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


def token_dtype(vocab_size: int) -> torch.dtype:
    """The most compact integer dtype that holds every token id of the vocabulary."""
    return torch.uint16 if vocab_size <= 2**16 else torch.int32


def target_config_hash(hf_config: dict[str, Any], length: int = 16) -> str:
    """Hash of a target's Hugging Face config (`config.to_dict()`), without paths, versions and dtype.

    Training recomputes it from `load_target_config(cfg).to_dict()` and checks it against the
    manifest's `target.config_hash`.
    """
    kept = {k: v for k, v in hf_config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps(kept, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def mismatches(expected: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """One line per dotted field whose value differs: 'field: expected X, found Y'."""
    exp, got = flatten(expected), flatten(found)
    return [
        f"{key}: expected {exp.get(key)!r}, found {got.get(key, '<missing>')!r}"
        for key in sorted(set(exp) | set(got))
        if exp.get(key) != got.get(key, "<missing>")
    ]


# ---------------------------------------------------------------- writing


def plan_shards(
    lengths: Sequence[int], bytes_per_token: int, shard_samples: int | None, shard_bytes: int
) -> list[tuple[int, int]]:
    """Cut samples 0..n-1, in order, into shards [start, stop): a shard closes before it would exceed
    `shard_samples` samples or `shard_bytes` bytes of hidden states (it always holds one sample).
    A pure function of the lengths, so every process and every rerun gets the same plan."""
    plan: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, length in enumerate(lengths):
        nbytes = length * bytes_per_token
        full = (shard_samples is not None and i - start >= shard_samples) or size + nbytes > shard_bytes
        if i > start and full:
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


def prepare_out_dir(out_dir: str | Path, identity: dict[str, Any], overwrite: bool) -> None:
    """Make `out_dir` ready for an extraction with `identity`: refuse (or with `overwrite`, clear) a
    store made with a different config; keep a matching one's shards (a rerun resumes)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise StoreError(f"out_dir {out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (MANIFEST_NAME, STORE_CONFIG_NAME):
        if (out_dir / name).is_file():
            existing = json.loads((out_dir / name).read_text())
            # `aux_layers` is compared even when this run has none: an EAGLE-3 store is not an EAGLE-1 one
            fields = [*identity, *(["aux_layers"] if "aux_layers" in existing else [])]
            diffs = mismatches(content_key(identity), content_key({k: existing.get(k) for k in fields}))
            if diffs and not overwrite:
                raise StoreMismatchError(
                    f"{out_dir} holds a feature store made with a different config ({name}): "
                    + "; ".join(diffs)
                    + ". Pass overwrite=true to replace it, or choose another out_dir."
                )
            if diffs:
                remove_store_files(out_dir)
            break
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)  # incomplete until the end of this run
    for stale in out_dir.glob(".shard-*.tmp"):  # a shard being written when a run was killed
        stale.unlink(missing_ok=True)
    atomic_write_json(out_dir / STORE_CONFIG_NAME, identity)


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
        side = sidecar_path(out_dir / shard_name(index))
        info = json.loads(side.read_text()) if side.is_file() else {}
        if (info.get("start"), info.get("stop")) != (start, stop) or not (
            out_dir / shard_name(index)
        ).is_file():
            raise StoreError(f"{out_dir}: shard {index} (samples {start}:{stop}) is missing or incomplete")
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
) -> dict[str, Any]:
    """Write shard `index` atomically, then its sidecar; return the sidecar (shard info).

    samples: dicts with "id" (str), "input_ids" (int [L]), "loss_mask" (bool/int [L]),
    "hidden" (float [L, hidden]) and optionally "aux" (float [L, 3 * hidden], every sample or none).
    `extra` (e.g. the sample range) goes into the sidecar.
    """
    out_dir = Path(out_dir)
    if not samples:
        raise ValueError(f"shard {index}: no samples")
    lengths = [len(s["input_ids"]) for s in samples]
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)  # [n + 1]
    ids_dtype = token_dtype(vocab_size)
    tensors = {
        "hidden": torch.cat([torch.as_tensor(s["hidden"]) for s in samples]).to(HIDDEN_DTYPES[hidden_dtype]),
        "input_ids": torch.cat([torch.as_tensor(s["input_ids"]).long() for s in samples]).to(ids_dtype),
        "loss_mask": torch.cat([torch.as_tensor(s["loss_mask"]).bool() for s in samples]).to(torch.uint8),
        "offsets": offsets,
    }
    if "aux" in samples[0]:
        tensors["aux"] = torch.cat([torch.as_tensor(s["aux"]) for s in samples]).to(
            HIDDEN_DTYPES[hidden_dtype]
        )
    metadata = {"ids": json.dumps([str(s["id"]) for s in samples]), "schema_version": str(SCHEMA_VERSION)}
    final = out_dir / shard_name(index)
    with atomic_path(final) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        info = {
            "file": final.name,
            "index": index,
            "num_samples": len(samples),
            "num_tokens": int(offsets[-1]),
            "num_assistant_tokens": int(tensors["loss_mask"].sum()),
            "sha256": file_sha256(tmp),
            "bytes": os.path.getsize(tmp),
            **(extra or {}),
        }
    atomic_write_json(sidecar_path(final), info)
    return info


def sidecar_path(shard_file: str | Path) -> Path:
    """shard-00000.safetensors -> shard-00000.json."""
    return Path(shard_file).with_suffix(".json")


def completed_shard(out_dir: str | Path, index: int, expected: dict[str, Any]) -> dict[str, Any] | None:
    """The sidecar of shard `index` if the shard is complete: sidecar present, its fields equal
    `expected` (e.g. the planned sample range) and the file's sha256 matches. Else None."""
    shard = Path(out_dir) / shard_name(index)
    side = sidecar_path(shard)
    if not (shard.is_file() and side.is_file()):
        return None
    try:
        info = json.loads(side.read_text())
    except json.JSONDecodeError:
        return None
    if any(info.get(k) != v for k, v in expected.items()):
        return None
    if info.get("bytes") != shard.stat().st_size or info.get("sha256") != file_sha256(shard):
        return None
    return info


def remove_store_files(out_dir: str | Path) -> None:
    """Delete what a store writes (manifest, store config, shards, sidecars, temp files); nothing else."""
    out_dir = Path(out_dir)
    patterns = (
        MANIFEST_NAME,
        STORE_CONFIG_NAME,
        "shard-*.safetensors",
        "shard-*.json",
        ".shard-*.tmp",
        ".*.json.*.tmp",
    )
    for pattern in patterns:
        for f in out_dir.glob(pattern):
            f.unlink(missing_ok=True)


# ---------------------------------------------------------------- reading


class _Shard:
    """One shard file: header parsed eagerly (small), data region memory-mapped on first use."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        self.data_start = 8 + header_len
        self.metadata: dict[str, str] = header.pop("__metadata__", {}) or {}
        self.header: dict[str, dict[str, Any]] = header
        self._map: np.memmap | None = None
        missing = {"hidden", "input_ids", "loss_mask", "offsets"} - set(header)
        if missing:
            raise StoreError(f"{path}: not a feature-store shard (missing tensors {sorted(missing)})")
        self.ids: list[str] = json.loads(self.metadata.get("ids", "[]"))
        self.offsets = self.tensor_array("offsets").astype(np.int64)  # [n + 1]
        if len(self.ids) + 1 != len(self.offsets):
            raise StoreError(f"{path}: {len(self.ids)} ids but {len(self.offsets) - 1} samples")

    def tensor_array(self, name: str) -> np.ndarray:
        """A read-only numpy view of one tensor (bf16 appears as uint16)."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        spec = self.header[name]
        begin, end = spec["data_offsets"]
        np_dtype = _ST_DTYPES[spec["dtype"]][0]
        raw = self._map[self.data_start + begin : self.data_start + end]
        return raw.view(np_dtype).reshape(spec["shape"])

    def rows(self, name: str, begin: int, end: int) -> torch.Tensor:
        """Rows begin:end of a tensor, copied out of the map into a torch tensor."""
        spec = self.header[name]
        array = np.array(self.tensor_array(name)[begin:end])  # copy: only these rows are read
        torch_dtype = _ST_DTYPES[spec["dtype"]][1]
        tensor = torch.from_numpy(array)
        return tensor.view(torch_dtype) if torch_dtype is not None and tensor.dtype != torch_dtype else tensor

    def close(self) -> None:
        self._map = None


class FeatureStore:
    """Random access to a complete store written by `eagle_train.extract`.

    `manifest` is the parsed manifest.json; `ids` and `lengths` come from the shard headers (no hidden
    state is read); `store[i]` returns {"id", "input_ids" LongTensor[L], "loss_mask" BoolTensor[L],
    "hidden" Tensor[L, hidden] in the stored dtype} (+ "aux" Tensor[L, 3 * hidden] when opened with
    `aux=True`: the inputs of `aux_layers`, EAGLE-3's features; an EAGLE-1 run never reads them). Picklable (for DataLoader workers): the memory maps
    are reopened lazily in each process.
    """

    def __init__(self, path: str | Path, aux: bool = False):
        self.path, self.aux = Path(path), aux
        manifest_file = self.path / MANIFEST_NAME
        if not manifest_file.is_file():
            hint = (
                " (extraction not finished: rerun it to resume)"
                if (self.path / STORE_CONFIG_NAME).exists()
                else ""
            )
            raise StoreError(f"{self.path}: not a complete feature store, no {MANIFEST_NAME}{hint}")
        self.manifest: dict[str, Any] = json.loads(manifest_file.read_text())
        version = self.manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise StoreMismatchError(
                f"{manifest_file}: schema_version: expected {SCHEMA_VERSION}, found {version!r} "
                "(re-extract the features with this version)"
            )
        self._shards = [self._open_shard(info) for info in self.manifest["shards"]]
        self.ids: list[str] = [i for shard in self._shards for i in shard.ids]
        self.lengths: list[int] = [int(n) for shard in self._shards for n in np.diff(shard.offsets)]
        # first global sample index of each shard, and the total: [num_shards + 1]
        self._starts = np.cumsum([0] + [len(shard.ids) for shard in self._shards])

    def _open_shard(self, info: dict[str, Any]) -> _Shard:
        file = self.path / info["file"]
        if not file.is_file():
            raise StoreError(f"{self.path}: shard {info['file']} listed in {MANIFEST_NAME} is missing")
        shard = _Shard(file)
        if len(shard.ids) != info["num_samples"]:
            raise StoreError(f"{file}: {len(shard.ids)} samples, manifest says {info['num_samples']}")
        if self.manifest.get("aux_layers") and "aux" not in shard.header:
            raise StoreError(f"{file}: the manifest names aux_layers but the shard has no `aux` tensor")
        return shard

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, i: int) -> tuple[_Shard, int, int, int]:
        """(shard, index in the shard, first row, end row) of sample i."""
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)}")
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        shard, j = self._shards[s], i - int(self._starts[s])
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

    def verify(self) -> None:
        """Check every shard's size and sha256 against the manifest (reads the whole store)."""
        for info in self.manifest["shards"]:
            file = self.path / info["file"]
            if file.stat().st_size != info["bytes"] or file_sha256(file) != info["sha256"]:
                raise StoreError(f"{file}: checksum differs from {MANIFEST_NAME} (corrupt or replaced shard)")

    def __getstate__(self) -> dict[str, Any]:
        for shard in self._shards:
            shard.close()
        return self.__dict__.copy()
