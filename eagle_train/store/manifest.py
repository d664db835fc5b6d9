"""A feature store's identity and its manifest: what decides the contents, what a reader accepts.

The identity (`store_identity`) is every field that decides what a store holds: the schema version, the
target (config hash, the sha256 of each of its weight files, `weight_files`: every weight, decoder layers
included; the fingerprint of its embedding and LM head, hidden size, vocabulary, model type, dtype), the
stored `dtype`, the chat template, `max_len`, the data (its sha256 and cleaning options), for an EAGLE-3
store the `aux_layers` whose inputs it holds and, when it is not the Hugging Face forward, the `backend`
that produced the features.
Extraction writes it as store_config.json before the first shard (a rerun resumes or refuses) and as
the head of manifest.json at the end; `content_key` / `store_hash` are what two runs must share.

A reader accepts a manifest (`read_manifest`) when the store is complete, the manifest parses, its schema
version is one this code reads and its dtype one this torch can hold; `check_compatible` then compares
dotted fields (e.g. `target.hidden_size`) with what the caller needs (`expected_target`: training's
target). Every refusal names the file and the field. A store extracted before `weight_files` was recorded
is still read, with a warning that a change of the target's decoder layers cannot be detected for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from eagle_train.config.base import config_hash, flatten
from eagle_train.runtime.atomic_files import FileFormatError, read_json
from eagle_train.runtime.errors import InputError
from eagle_train.store.codec import STORAGES, Fp8UnavailableError, Storage

log = logging.getLogger(__name__)
SCHEMA_VERSION = 2  # written by this version: 2 added fp8 stores (per-token scales); 1 is read as is
READABLE_SCHEMAS = (1, 2)
MANIFEST_NAME = "manifest.json"
STORE_CONFIG_NAME = "store_config.json"
MANIFEST_ONLY = ("config_hash", "counts", "shards", "created_by")  # the rest of a manifest is the identity
# HF config keys that say nothing about the model's function (paths, versions, load-time choices)
_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "use_cache"}


class StoreMismatchError(InputError):
    """A store (or an existing out_dir) does not match what the caller expects; names each field."""


class StoreError(InputError):
    """A store directory is missing, incomplete or corrupt."""


def target_config_hash(hf_config: dict[str, Any], length: int = 16) -> str:
    """Hash of a target's Hugging Face config (`config.to_dict()`), without paths, versions and dtype."""
    kept = {k: v for k, v in hf_config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps(kept, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def store_identity(
    target,
    hf_config,
    dtype: str,
    template: str,
    max_len: int,
    data: dict[str, Any],
    backend: str = "hf",
    aux_layers: list[int] | None = None,
) -> dict[str, Any]:
    """The manifest fields that decide the store's contents (a rerun must match them). `aux_layers` (the
    target layers whose inputs an EAGLE-3 store holds) and a `backend` other than hf appear only in a
    store that has them, so an EAGLE-1 HF store's identity is what it always was.

    target: a loaded target or its frozen parts (modeling.target.Target / FrozenTarget: cfg, source,
    weight_fingerprint, weight_files, hidden_size, vocab_size, dtype); hf_config: its config as
    `AutoConfig` loads it (what training hashes); data: the data block (path, sha256, cleaning options)."""
    identity = {
        "schema_version": SCHEMA_VERSION,
        "target": {
            "name": target.cfg.name,
            "source": target.source,
            "config_hash": target_config_hash(hf_config.to_dict()),
            "weights": target.weight_fingerprint,
            "weight_files": target.weight_files,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "model_type": str(hf_config.model_type),
            "dtype": str(target.dtype).removeprefix("torch."),
            "revision": target.cfg.revision,
            "system_prompt": target.cfg.system_prompt,
        },
        "dtype": dtype,
        "template": template,
        "max_len": max_len,
        "data": data,
    }
    if aux_layers:
        identity["aux_layers"] = list(aux_layers)
    if backend != "hf":
        identity["backend"] = backend
    return identity


WEIGHT_FILES = "target.weight_files."  # the dotted prefix of the per-file sha256 of the target's weights


def expected_target(target, hf_config) -> dict[str, Any]:
    """What a store must have been extracted with (dotted manifest keys) for this target: its config,
    the sha256 of each of its weight files (a fine-tune of any layer differs there) and the fingerprint
    of its embedding and LM head."""
    return {
        "target.config_hash": target_config_hash(hf_config.to_dict()),
        **{f"{WEIGHT_FILES}{k}": v for k, v in target.weight_files.items()},
        **{f"target.weights.{k}": v for k, v in target.weight_fingerprint.items()},
        "target.hidden_size": target.hidden_size,
        "target.vocab_size": target.vocab_size,
    }


def content_key(identity: dict[str, Any]) -> dict[str, Any]:
    """The identity fields that decide the contents: everything but display names and the data path
    (the data is identified by its sha256)."""
    key = json.loads(json.dumps(identity))
    key.get("target", {}).pop("name", None)
    for field in ("name", "path"):
        key.get("data", {}).pop(field, None)
    return key


def identity_fields(recorded: dict[str, Any]) -> dict[str, Any]:
    """The identity part of a store_config.json or manifest.json (the manifest adds what was written)."""
    return {k: v for k, v in recorded.items() if k not in MANIFEST_ONLY}


def store_hash(identity: dict[str, Any]) -> str:
    """The manifest's `config_hash`: a hash of `content_key(identity)`; each shard's sidecar carries it."""
    return config_hash(content_key(identity))


def feature_widths(hidden_size: int, aux_layers: list[int] | None = None) -> dict[str, int]:
    """The feature tensors of a shard and their row widths: `hidden` and, for EAGLE-3, `aux`."""
    widths = {"hidden": hidden_size}
    if aux_layers:
        widths["aux"] = len(aux_layers) * hidden_size
    return widths


def bytes_per_token(hidden_size: int, dtype: str, states: int = 1, vocab_size: int = 32000) -> float:
    """Bytes one stored token costs: `states` hidden states of `hidden_size` in `dtype` (fp8: + a float32
    scale each), its token id and its mask byte; the one home of the store-size arithmetic."""
    row = STORAGES[dtype].row_bytes(states * hidden_size, hidden_size)
    return row + (2 if vocab_size <= 2**16 else 4) + 1


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the complete store at `path`, refused (naming the file and the field) when the
    store is incomplete, the file is not a manifest, its schema_version is not readable here or its
    dtype is unknown or not available in this torch (fp8)."""
    manifest_file = path / MANIFEST_NAME
    if not manifest_file.is_file():
        hint = " (extraction not finished: rerun it to resume)" if (path / STORE_CONFIG_NAME).exists() else ""
        raise StoreError(f"{path}: not a complete feature store, no {MANIFEST_NAME}{hint}")
    try:
        manifest = read_json(manifest_file, "feature store manifest")
    except FileFormatError as err:
        raise StoreError(f"{err}: rerun the extraction to rewrite it") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise StoreError(f"{manifest_file}: not a feature store manifest (no list of shards)")
    version = manifest.get("schema_version")
    if version not in READABLE_SCHEMAS:
        raise StoreMismatchError(
            f"{manifest_file}: schema_version: this version reads {list(READABLE_SCHEMAS)}, found "
            f"{version!r} (a store from another version of eagle-train: re-extract the features)"
        )
    manifest_storage(manifest, manifest_file)
    return manifest


def manifest_storage(manifest: dict[str, Any], where: Path) -> Storage:
    """The stored dtype a manifest names, checked (unknown, or fp8 on a torch without float8: refused)."""
    name = manifest.get("dtype")
    if name not in STORAGES:
        raise StoreError(f"{where}: dtype: {name!r} is not a stored dtype ({sorted(STORAGES)})")
    kind = STORAGES[name]
    try:
        kind.dtype  # noqa: B018 (fp8 needs torch.float8_e4m3fn)
    except Fp8UnavailableError as err:
        raise StoreError(f"{where}: dtype: {err}") from None
    return kind


def check_compatible(manifest: dict[str, Any], expected: dict[str, Any], path: Path) -> None:
    """StoreMismatchError naming every dotted manifest field (e.g. "target.hidden_size") whose value
    differs from `expected` (a field the store lacks is found "<missing>")."""
    found = flatten(manifest)
    diffs = [
        f"{key}: expected {value!r}, found {found.get(key, '<missing>')!r}"
        for key, value in expected.items()
        if found.get(key, "<missing>") != value
    ]
    if diffs:
        raise StoreMismatchError(f"feature store {path} does not match: " + "; ".join(diffs))


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
