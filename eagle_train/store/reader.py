"""Reading a complete feature store with random access, checked before use.

`open_store(path, expected)` is how training opens one: the manifest is read and checked
(eagle_train.store.manifest: complete, readable schema, a dtype this torch holds), then compared with what
the caller needs (`expected`: dotted fields such as `target.config_hash`), then every shard's header. A
sample comes back in its stored dtype (fp8 codes with their scales, bf16 as bf16): decoding happens on
the training device (eagle_train.store.codec.decode), so a host moves and pins only the stored bytes.
Torch, numpy and safetensors only: no transformers, no datasets.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle_train.runtime.errors import InputError
from eagle_train.store.codec import Storage
from eagle_train.store.manifest import (
    MANIFEST_NAME,
    StoreError,
    StoreMismatchError,
    check_compatible,
    manifest_storage,
    read_manifest,
)
from eagle_train.store.shard import ShardError, ShardFile, scale_name
from eagle_train.store.writer import mark_damaged, shard_name

SHARD_FIELDS = ("file", "index", "start", "stop", "num_samples", "num_tokens", "sha256", "bytes")


class FeatureStore:
    """Random access to a complete store written by `eagle_train.extract`, checked before use.

    `manifest` is the parsed manifest.json; `ids` and `lengths` come from the shard headers (no hidden
    state is read); `store[i]` returns {"id", "input_ids" LongTensor[L], "loss_mask" BoolTensor[L],
    "hidden" [L, hidden] in the stored dtype} plus, for an fp8 store, "hidden_scale" float32 [L, 1], and
    with `aux=True` "aux" [L, k * hidden] (+ "aux_scale"): EAGLE-3's features. Opening checks the structure
    (StoreError naming the file and what is wrong); a shard's sha256 and value ranges are checked the
    first time it is read in a process (`verify()` checks them all now). A damaged shard is recorded as
    such in its sidecar (`damaged`), so a rerun of the extraction repairs it. `expected` (dotted manifest
    fields) is checked first, as `check_compatible`. Picklable (for DataLoader workers): each process
    opens its own file handles.
    """

    def __init__(self, path: str | Path, expected: dict[str, Any] | None = None, aux: bool = False):
        self.path, self.aux = Path(path), aux
        self.manifest = read_manifest(self.path)
        if expected:  # the contents asked for (e.g. this target's) before the consistency of the files
            self.check_compatible(expected)
        self.storage: Storage = manifest_storage(self.manifest, self.path / MANIFEST_NAME)
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
            shard = ShardFile(file, hidden_size, self.storage)
        except ShardError as err:
            raise damaged(file, str(err)) from None
        if len(shard.ids) != info["num_samples"] or int(shard.offsets[-1]) != info["num_tokens"]:
            raise damaged(
                file,
                f"{file}: {len(shard.ids)} samples of {int(shard.offsets[-1])} tokens, {MANIFEST_NAME} says "
                f"{info['num_samples']} of {info['num_tokens']}",
            )
        if shard.size != info["bytes"]:
            raise damaged(file, f"{file}: {shard.size} bytes, {MANIFEST_NAME} says {info['bytes']}")
        if bool(self.manifest.get("aux_layers")) != ("aux" in shard.features):
            held = "holds an `aux` tensor" if "aux" in shard.features else "has no `aux` tensor"
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
                raise damaged(self._shards[s].path, str(err)) from None
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
        }
        if self.aux and not self.aux_layers:
            raise StoreError(f"{self.path}: no aux features (extracted without aux=true)")
        for name in ("hidden", "aux") if self.aux else ("hidden",):
            sample[name] = shard.rows(name, begin, end)  # [L, width], stored dtype
            if self.storage.scaled:
                sample[scale_name(name)] = shard.rows(scale_name(name), begin, end)  # [L, groups]
        return sample

    @property
    def aux_layers(self) -> list[int]:
        """The target layers whose inputs the store holds (EAGLE-3's features); [] for an EAGLE-1 store."""
        return list(self.manifest.get("aux_layers") or [])

    def check_compatible(self, expected: dict[str, Any]) -> None:
        """Raise StoreMismatchError naming every dotted manifest field (e.g. "target.hidden_size")
        whose value differs from `expected`."""
        check_compatible(self.manifest, expected, self.path)

    def content_hash(self) -> str:
        """What identifies the contents (not the path): the config hash and every shard's sha256."""
        shas = [info["sha256"] for info in self.manifest["shards"]]
        blob = json.dumps([self.manifest.get("config_hash"), shas]).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def verify(self) -> None:
        """Check every shard's sha256 and value ranges now (reads the whole store)."""
        for s in range(len(self._shards)):
            self.shard(s)


def damaged(shard: Path, what: str) -> StoreError:
    """The error for a damaged shard, once the damage is recorded in the shard's sidecar
    (eagle_train.store.writer.mark_damaged), so that a rerun of the extraction re-checks the shard and
    extracts it again (a shard rotted in place keeps its size and mtime: nothing else would tell)."""
    if mark_damaged(Path(shard), what):
        how = "rerun the extraction (the same command): it re-checks this shard and extracts it again"
    else:
        how = (
            "the store is read-only here, so nothing recorded it: rerun the extraction with verify=full "
            "(every shard re-checked, the damaged ones extracted again)"
        )
    return StoreError(f"{what}. To repair the store, {how}")


def open_store(
    path: str | Path | None,
    expected: dict[str, Any],
    aux_layers: list[int] | None = None,
    reader: str = "draft.type=eagle3",
) -> FeatureStore:
    """The feature store at `path`, refused (StoreMismatchError naming the field) unless its manifest
    has the `expected` fields (e.g. eagle_train.store.manifest.expected_target: this target's) and, for
    an EAGLE-3 or DFlash head (`aux_layers`, read by `reader`: what the refusal names), holds the inputs
    of exactly those target layers."""
    if path is None:
        raise InputError("offline training needs `features=DIR`")
    try:
        store = FeatureStore(path, expected, aux=aux_layers is not None)
    except StoreMismatchError as err:
        raise StoreMismatchError(
            f"{err} (extracted from another model, or by an older version: re-extract it)"
        ) from None
    if aux_layers is not None and store.aux_layers != aux_layers:
        held = f"the inputs of target layers {store.aux_layers}" if store.aux_layers else "no aux layers"
        raise StoreMismatchError(
            f"feature store {path}: aux_layers: it holds {held}; {reader} needs the inputs of layers "
            f"{aux_layers} (target.aux_layers): extract with aux=true target.aux_layers={aux_layers}, or train "
            "online (data.source=online)"
        )
    return store
