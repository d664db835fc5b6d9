"""One feature-store shard file: a safetensors file written deterministically and streamed, read checked.

Layout (valid safetensors, read with `safetensors.safe_open`): 8 bytes little-endian header length, the
JSON header (sorted keys, no spaces, padded with spaces to a multiple of 8) and the data. Tensors:

    offsets         int64 [n + 1]          sample i is rows offsets[i]:offsets[i+1]
    hidden          [tokens, hidden]       the stored dtype (eagle_train.store.codec): the last hidden state
    aux             [tokens, k * hidden]   optional, same dtype: the inputs of k target layers (EAGLE-3)
    FEATURE_scale   float32 [tokens, g]    fp8 only: one scale per token and hidden-size group of FEATURE
    input_ids       uint16 | int32 [tokens]
    loss_mask       uint8 [tokens]

in the data region by element size, largest first (each stays aligned to its size). The metadata holds
the sample ids (a JSON list) and the schema version. The same samples always give the same bytes (the
safetensors library orders metadata keys at random, so two identical runs gave two checksums), and the
hidden states are written into their rows as the target produces them, in any order, so a shard never
sits in memory.

`ShardFile` parses a shard defensively when it is opened: every way a file can be cut short or edited is
a `ShardError` naming the file (a truncated header, a header length past the end, tensors missing or
overlapping, offsets that do not start at 0, decrease or miss the end, a feature stored in another dtype
than the manifest says); `verify` adds the sha256 and the value ranges (one pass). Rows are read through
`safe_open(...).get_slice` (a handle per process, opened on first use): one copy of the rows asked for.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from eagle_train.runtime.errors import InputError
from eagle_train.store.codec import Storage, encode, float8_dtype

TAGS = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}
if float8_dtype() is not None:
    TAGS[float8_dtype()] = "F8_E4M3"
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "U16": 2, "I32": 4, "I64": 8, "U8": 1, "F8_E4M3": 1}
ID_TAGS = ("U16", "I32")
FEATURES = ("hidden", "aux")  # the feature tensors a shard may hold, in this order
MAX_HEADER = 1 << 30  # a header claiming more is corrupt (a million ids take ~20 MB)


class ShardError(InputError):
    """A shard file is truncated, edited or not a shard; the message names the file and what is wrong."""


def token_dtype(vocab_size: int) -> torch.dtype:
    """The most compact integer dtype that holds every token id of the vocabulary."""
    return torch.uint16 if vocab_size <= 2**16 else torch.int32


def scale_name(feature: str) -> str:
    """The tensor holding `feature`'s fp8 scales."""
    return f"{feature}_scale"


def _header(shapes: dict[str, tuple[str, list[int]]], metadata: dict[str, str]) -> tuple[bytes, dict]:
    """The encoded header (length prefix included) and each tensor's [begin, end) in the data region.
    Tensors are laid out by element size, largest first (then by name): every one stays aligned."""
    spans, at = {}, 0
    for name in sorted(shapes, key=lambda n: (-ITEMSIZE[shapes[n][0]], n)):
        tag, shape = shapes[name]
        size = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[tag]
        spans[name] = (at, at + size)
        at += size
    header: dict[str, Any] = {"__metadata__": metadata}
    header.update(
        {n: {"dtype": shapes[n][0], "shape": shapes[n][1], "data_offsets": list(spans[n])} for n in shapes}
    )
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text, spans


class ShardFileWriter:
    """One shard file at `path` (a temporary name: the caller publishes it), written push-style:

        with ShardFileWriter(path, ids, input_ids, loss_mask, widths, kind, group, ids_dtype, meta) as f:
            f.put(i, hidden, aux=...)   # once per sample i, in any order

    The header, offsets, token ids and loss mask are written when it opens; `put` writes sample i's
    features [L_i, width] (any float dtype: encoded here as `kind`, one scale per `group` values for fp8)
    straight into their rows. widths: feature name -> row width ({"hidden": d} or {"hidden": d, "aux":
    3 * d}). A clean exit checks that every sample got its rows and syncs the file to disk; an exception
    only closes it."""

    def __init__(
        self,
        path: str | Path,
        ids: Sequence[str],
        input_ids: Sequence[Sequence[int]],
        loss_mask: Sequence[Sequence[int]],
        widths: dict[str, int],
        kind: Storage,
        group: int,
        ids_dtype: torch.dtype,
        metadata: dict[str, str],
    ):
        self.path, self.widths, self.kind, self.group = path, widths, kind, group
        self.lengths = [len(x) for x in input_ids]
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)]).astype(
            np.int64
        )  # [n + 1]
        tokens = int(self.offsets[-1])
        shapes = {"offsets": ("I64", [len(self.lengths) + 1]), "input_ids": (TAGS[ids_dtype], [tokens])}
        shapes["loss_mask"] = ("U8", [tokens])
        for name, width in widths.items():
            shapes[name] = (TAGS[kind.dtype], [tokens, width])
            if kind.scaled:
                shapes[scale_name(name)] = ("F32", [tokens, width // group])
        head, self.spans = _header(shapes, {"ids": json.dumps([str(i) for i in ids]), **metadata})
        self.shapes, self.base = shapes, len(head)
        self.written = np.zeros(len(self.lengths), dtype=bool)
        self.file = open(path, "wb")
        try:
            self.file.write(head)
            self.file.truncate(self.base + max(end for _, end in self.spans.values()))  # the rows go below
            self._write_rows("offsets", 0, torch.from_numpy(self.offsets))
            np_ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in input_ids])
            self._write_rows("input_ids", 0, torch.from_numpy(np_ids).to(ids_dtype))
            masks = np.concatenate([np.asarray(m, np.uint8) for m in loss_mask])
            self._write_rows("loss_mask", 0, torch.from_numpy(masks))
        except BaseException:
            self.file.close()
            raise

    def _write_rows(self, name: str, first_row: int, tensor: torch.Tensor) -> None:
        row_bytes = int(np.prod(self.shapes[name][1][1:], dtype=np.int64)) * ITEMSIZE[self.shapes[name][0]]
        self.file.seek(self.base + self.spans[name][0] + first_row * row_bytes)
        self.file.write(_bytes(tensor))

    def put(self, i: int, hidden: torch.Tensor, **more: torch.Tensor) -> None:
        """Sample i's features: hidden [L_i, width] and every other feature the shard holds (aux=...)."""
        given = {"hidden": hidden, **more}
        if set(given) != set(self.widths):
            raise ValueError(f"sample {i}: features {sorted(given)}, the shard holds {sorted(self.widths)}")
        for name, tensor in given.items():
            if tuple(tensor.shape) != (self.lengths[i], self.widths[name]):
                expected = (self.lengths[i], self.widths[name])
                raise ValueError(f"sample {i}: {name} {tuple(tensor.shape)}, expected {expected}")
            values, scale = encode(tensor.detach().to("cpu"), self.kind, self.group)
            self._write_rows(name, int(self.offsets[i]), values)
            if scale is not None:
                self._write_rows(scale_name(name), int(self.offsets[i]), scale)
        self.written[i] = True

    def __enter__(self) -> ShardFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with self.file:
            if exc_type is None:
                if not self.written.all():
                    missing = np.flatnonzero(~self.written)[:8].tolist()
                    raise ValueError(f"{self.path}: no hidden states for samples {missing}")
                self.file.flush()
                os.fsync(self.file.fileno())


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (any dtype, bf16 and fp8 included)."""
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


class ShardFile:
    """A shard opened for reading: header parsed and checked eagerly (small), rows read through
    `safe_open` on first use. `hidden_size` and `kind` (the manifest's, if given) are checked against
    the file: a shard written with another dtype than its manifest says is refused, naming the tensor."""

    def __init__(self, path: str | Path, hidden_size: int | None = None, kind: Storage | None = None):
        self.path = Path(path)
        self.size = self.path.stat().st_size
        header, self.data_start = self._read_header()
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.header: dict[str, dict[str, Any]] = header
        self._handle = None
        self._check_layout(hidden_size)
        self.features = [name for name in FEATURES if name in self.header]
        if kind is not None:
            self._check_storage(kind)
        try:
            self.ids: list[str] = json.loads(self.metadata.get("ids", "[]"))
        except (ValueError, RecursionError):
            raise self.error("the sample ids in its metadata are not JSON") from None
        self.offsets = self._read_raw("offsets", np.int64)  # [n + 1]
        self._check_offsets()

    def error(self, what: str) -> ShardError:
        return ShardError(f"{self.path}: {what} (corrupt or not a feature-store shard; re-extract it)")

    def _read_header(self) -> tuple[dict[str, Any], int]:
        with open(self.path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise self.error(f"{self.size} bytes: no safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(self.size - 8, MAX_HEADER):
                raise self.error(f"header length {length} runs past the end of the file ({self.size} bytes)")
            raw = f.read(length)
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError):
            raise self.error("its safetensors header is not JSON") from None
        if not isinstance(header, dict):
            raise self.error("its safetensors header is not an object")
        return header, 8 + length

    def _check_layout(self, hidden_size: int | None) -> None:
        missing = {"offsets", "hidden", "input_ids", "loss_mask"} - set(self.header)
        if missing:
            raise self.error(f"missing tensors {sorted(missing)}")
        spans = []
        for name, spec in self.header.items():
            try:
                tag, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
                size = ITEMSIZE[tag]
            except (KeyError, TypeError, ValueError):
                raise self.error(f"tensor {name!r} has a malformed entry {spec!r}") from None
            if not all(isinstance(d, int) and d >= 0 for d in [*shape, begin, end]):
                raise self.error(f"tensor {name!r} has a malformed entry {spec!r}")
            if end - begin != int(np.prod(shape, dtype=np.int64)) * size:
                raise self.error(f"tensor {name!r}: {end - begin} bytes for shape {shape}")
            spans.append((begin, end))
        spans.sort()
        if spans[0][0] != 0 or any(a[1] != b[0] for a, b in itertools.pairwise(spans)):
            raise self.error("its tensors overlap or leave holes")
        if self.data_start + spans[-1][1] != self.size:
            raise self.error(
                f"{self.size} bytes, its header describes {self.data_start + max(e for _, e in spans)}"
            )
        hidden = self.header["hidden"]["shape"]
        tokens = hidden[0] if len(hidden) == 2 else -1
        if hidden_size is not None and hidden != [tokens, hidden_size]:
            raise self.error(f"hidden has shape {hidden}, expected [tokens, {hidden_size}]")
        for name, spec in self.header.items():
            if name != "offsets" and (not spec["shape"] or spec["shape"][0] != tokens):
                raise self.error(f"{name} has shape {spec['shape']}, hidden has {tokens} rows")
        if self.header["input_ids"]["dtype"] not in ID_TAGS or self.header["loss_mask"]["dtype"] != "U8":
            raise self.error("input_ids must be U16 or I32 and loss_mask U8")

    def _check_storage(self, kind: Storage) -> None:
        """Every feature is stored as `kind` says (the manifest's `dtype`), with its scales when fp8."""
        want = TAGS.get(kind.dtype)
        for name in self.features:
            found = self.header[name]["dtype"]
            if found != want:
                raise ShardError(
                    f"{self.path}: tensor {name!r} is stored as {found}, but the store's manifest says "
                    f"dtype={kind.name} ({want}): a shard written with another dtype (re-extract it)"
                )
            scale = self.header.get(scale_name(name))
            if kind.scaled and (scale is None or scale["dtype"] != "F32"):
                raise self.error(f"fp8 tensor {name!r} has no float32 {scale_name(name)!r}")
            if not kind.scaled and scale is not None:
                raise self.error(f"dtype={kind.name} but the shard has {scale_name(name)!r}")

    def _check_offsets(self) -> None:
        offsets, tokens = self.offsets, self.header["input_ids"]["shape"][0]
        if len(self.ids) + 1 != len(offsets):
            raise self.error(f"{len(self.ids)} ids but {len(offsets) - 1} samples in offsets")
        if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != tokens or (np.diff(offsets) < 0).any():
            raise self.error(f"offsets must rise from 0 to {tokens} tokens")

    def _read_raw(self, name: str, dtype) -> np.ndarray:
        """A small tensor read straight from the file (before the safetensors handle is trusted)."""
        begin, end = self.header[name]["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            return np.frombuffer(f.read(end - begin), dtype=dtype).copy()

    def _open(self):
        if self._handle is None:
            self._handle = safe_open(str(self.path), framework="pt")
        return self._handle

    def rows(self, name: str, begin: int, end: int) -> torch.Tensor:
        """Rows begin:end of a tensor, in its stored dtype (one copy of those rows)."""
        return self._open().get_slice(name)[begin:end]

    def tensor(self, name: str) -> torch.Tensor:
        """A whole tensor (for the small ones: ids, mask, scales)."""
        return self._open().get_tensor(name)

    def verify(self, sha256: str | None, vocab_size: int | None) -> None:
        """The whole file against its recorded sha256, and the values: token ids within the vocabulary,
        loss mask 0/1, fp8 scales finite and positive. One read of the file."""
        if sha256 is not None:
            digest = hashlib.sha256()
            with open(self.path, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
            if digest.hexdigest() != sha256:
                raise self.error("its checksum (sha256) differs from the one recorded when it was written")
        ids = self.tensor("input_ids").long()
        if len(ids) and (int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size)):
            raise self.error(
                f"token ids {int(ids.min())}..{int(ids.max())} leave the vocabulary of {vocab_size}"
            )
        mask = self.tensor("loss_mask")
        if len(mask) and int(mask.max()) > 1:
            raise self.error("its loss mask holds values other than 0 and 1")
        for name in self.features:
            if scale_name(name) in self.header:
                scale = self.tensor(scale_name(name))
                if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
                    raise self.error(f"{scale_name(name)} holds non-finite or non-positive scales")

    def close(self) -> None:
        self._handle = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handle": None}  # a worker process opens its own
