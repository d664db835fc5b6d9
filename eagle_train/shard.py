"""One feature-store shard file: a safetensors file written deterministically and streamed, read checked.

Layout (valid safetensors, loadable with `safetensors.safe_open`): 8 bytes little-endian header length,
the JSON header (sorted keys, no spaces, padded with spaces to a multiple of 8) and the data, tensors
in the order `offsets` int64 [n + 1], `hidden` [tokens, hidden], for an EAGLE-3 store `aux` [tokens,
3 * hidden] (the inputs of three target layers), `input_ids` uint16 | int32 [tokens], `loss_mask` uint8
[tokens] (each stays aligned to its element size). The metadata holds the sample ids
(a JSON list) and the schema version. The same samples always give the same bytes (the safetensors
library orders metadata keys at random, so two identical runs gave two checksums), and the hidden states
are written into their rows as the target produces them, in any order, so a shard never sits in memory.

`ShardFile` parses a shard defensively: every way a file can be cut short or edited is a `ShardError`
naming the file (a truncated header, a header length past the end, tensors missing or overlapping,
offsets that do not start at 0, decrease or miss the end, token ids outside the vocabulary). The
cheap checks run when it is opened; `verify` adds the sha256 and the value ranges (one pass).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

HIDDEN_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# safetensors dtype tag -> (numpy dtype used to map the bytes, torch dtype to view them as)
ST_DTYPES = {
    "BF16": (np.uint16, torch.bfloat16),
    "F16": (np.float16, torch.float16),
    "F32": (np.float32, torch.float32),
    "U16": (np.uint16, None),
    "I32": (np.int32, torch.int32),
    "I64": (np.int64, torch.int64),
    "U8": (np.uint8, torch.uint8),
}
TAGS = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint16: "U16"}
TAGS.update({torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"})
TENSORS = ("offsets", "hidden", "input_ids", "loss_mask")  # every shard's
ORDER = (
    "offsets",
    "hidden",
    "aux",
    "input_ids",
    "loss_mask",
)  # their order in the data region ("aux": EAGLE-3)
MAX_HEADER = 1 << 30  # a header claiming more is corrupt (a million ids take ~20 MB)

Fill = Callable[[Callable[..., None]], None]  # fill(put): put(i, hidden[, aux]) for every sample


class ShardError(ValueError):
    """A shard file is truncated, edited or not a shard; the message names the file and what is wrong."""


def token_dtype(vocab_size: int) -> torch.dtype:
    """The most compact integer dtype that holds every token id of the vocabulary."""
    return torch.uint16 if vocab_size <= 2**16 else torch.int32


def _header(shapes: dict[str, tuple[torch.dtype, list[int]]], metadata: dict[str, str]) -> tuple[bytes, dict]:
    """The encoded header (length prefix included) and each tensor's [begin, end) in the data region."""
    spans, at = {}, 0
    names = [n for n in ORDER if n in shapes]
    for name in names:
        dtype, shape = shapes[name]
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        spans[name] = (at, at + size)
        at += size
    header = {"__metadata__": metadata}
    header.update(
        {
            n: {"dtype": TAGS[shapes[n][0]], "shape": shapes[n][1], "data_offsets": list(spans[n])}
            for n in names
        }
    )
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text, spans


def write_shard_file(
    path: str | Path,
    ids: Sequence[str],
    input_ids: Sequence[Sequence[int]],
    loss_mask: Sequence[Sequence[int]],
    hidden_size: int,
    hidden_dtype: torch.dtype,
    ids_dtype: torch.dtype,
    fill: Fill,
    metadata: dict[str, str],
    aux_size: int = 0,
) -> None:
    """Write a shard file at `path` (a temporary name: the caller publishes it).

    `fill(put)` must call `put(i, hidden, aux)` once for every sample i with its hidden states [L_i,
    hidden] and, when `aux_size`, its aux features [L_i, aux_size] (else aux None or omitted); any
    order, any float dtype (converted to `hidden_dtype`); the rows go straight to the file."""
    lengths = [len(x) for x in input_ids]
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)  # [n + 1]
    tokens = int(offsets[-1])
    shapes = {
        "offsets": (torch.int64, [len(lengths) + 1]),
        "hidden": (hidden_dtype, [tokens, hidden_size]),
        "input_ids": (ids_dtype, [tokens]),
        "loss_mask": (torch.uint8, [tokens]),
    }
    if aux_size:
        shapes["aux"] = (hidden_dtype, [tokens, aux_size])
    head, spans = _header(shapes, {"ids": json.dumps([str(i) for i in ids]), **metadata})
    written = np.zeros(len(lengths), dtype=bool)
    with open(path, "wb") as f:
        f.write(head)
        base = len(head)
        f.truncate(base + spans["loss_mask"][1])  # the hidden rows are written into their place below
        f.write(offsets.tobytes())
        f.seek(base + spans["input_ids"][0])
        np_ids = ST_DTYPES[TAGS[ids_dtype]][0]
        f.write(np.concatenate([np.asarray(x, dtype=np.int64) for x in input_ids]).astype(np_ids).tobytes())
        f.write(np.concatenate([np.asarray(m, dtype=np.uint8) for m in loss_mask]).tobytes())

        def put(i: int, hidden: torch.Tensor, aux: torch.Tensor | None = None) -> None:
            for name, rows, width in (("hidden", hidden, hidden_size), ("aux", aux, aux_size)):
                if width == 0:
                    if rows is not None:
                        raise ValueError(f"sample {i}: aux features for a shard without them")
                    continue
                if rows is None or tuple(rows.shape) != (lengths[i], width):
                    got = None if rows is None else tuple(rows.shape)
                    raise ValueError(f"sample {i}: {name} {got}, expected ({lengths[i]}, {width})")
                f.seek(base + spans[name][0] + int(offsets[i]) * width * hidden_dtype.itemsize)
                f.write(_bytes(rows.detach().to("cpu", hidden_dtype)))
            written[i] = True

        fill(put)
        if not written.all():
            raise ValueError(f"{path}: no hidden states for samples {np.flatnonzero(~written)[:8].tolist()}")
        f.flush()
        os.fsync(f.fileno())


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (any dtype, bf16 included)."""
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


class ShardFile:
    """A shard opened for reading: header parsed and checked eagerly (small), data memory-mapped on first
    use. `hidden_size` (if given) is checked against the file."""

    def __init__(self, path: str | Path, hidden_size: int | None = None):
        self.path = Path(path)
        self.size = self.path.stat().st_size
        header, self.data_start = self._read_header()
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.header: dict[str, dict[str, Any]] = header
        self._map: np.memmap | None = None
        self._check_layout(hidden_size)
        try:
            self.ids: list[str] = json.loads(self.metadata.get("ids", "[]"))
        except (ValueError, RecursionError):
            raise self.error("the sample ids in its metadata are not JSON") from None
        self.offsets = self.tensor_array("offsets").astype(np.int64)  # [n + 1]
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
        missing = set(TENSORS) - set(self.header)
        if missing:
            raise self.error(f"missing tensors {sorted(missing)}")
        unknown = set(self.header) - set(ORDER)
        if unknown:
            raise self.error(f"unknown tensors {sorted(unknown)}")
        spans = []
        for name in [n for n in ORDER if n in self.header]:
            spec = self.header[name]
            try:
                dtype, shape, (begin, end) = ST_DTYPES[spec["dtype"]][0], spec["shape"], spec["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self.error(f"tensor {name!r} has a malformed entry {spec!r}") from None
            if not all(isinstance(d, int) and d >= 0 for d in [*shape, begin, end]):
                raise self.error(f"tensor {name!r} has a malformed entry {spec!r}")
            if end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
                raise self.error(f"tensor {name!r}: {end - begin} bytes for shape {shape}")
            spans.append((begin, end))
        spans.sort()
        if spans[0][0] != 0 or any(a[1] != b[0] for a, b in itertools.pairwise(spans)):
            raise self.error("its tensors overlap or leave holes")
        if self.data_start + spans[-1][1] != self.size:
            raise self.error(
                f"{self.size} bytes, its header describes {self.data_start + max(e for _, e in spans)}"
            )
        tokens = self.header["hidden"]["shape"][0] if len(self.header["hidden"]["shape"]) == 2 else -1
        if hidden_size is not None and self.header["hidden"]["shape"] != [tokens, hidden_size]:
            raise self.error(
                f"hidden has shape {self.header['hidden']['shape']}, expected [tokens, {hidden_size}]"
            )
        for name in ("input_ids", "loss_mask"):
            if self.header[name]["shape"] != [tokens]:
                raise self.error(f"{name} has shape {self.header[name]['shape']}, hidden has {tokens} rows")
        aux = self.header.get("aux", {}).get("shape")
        if aux is not None and (len(aux) != 2 or aux[0] != tokens):
            raise self.error(f"aux has shape {aux}, hidden has {tokens} rows")

    def _check_offsets(self) -> None:
        offsets, tokens = self.offsets, self.header["input_ids"]["shape"][0]
        if len(self.ids) + 1 != len(offsets):
            raise self.error(f"{len(self.ids)} ids but {len(offsets) - 1} samples in offsets")
        if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != tokens or (np.diff(offsets) < 0).any():
            raise self.error(f"offsets must rise from 0 to {tokens} tokens")

    def tensor_array(self, name: str) -> np.ndarray:
        """A read-only numpy view of one tensor (bf16 appears as uint16)."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        spec = self.header[name]
        begin, end = spec["data_offsets"]
        raw = self._map[self.data_start + begin : self.data_start + end]
        return raw.view(ST_DTYPES[spec["dtype"]][0]).reshape(spec["shape"])

    def rows(self, name: str, begin: int, end: int) -> torch.Tensor:
        """Rows begin:end of a tensor, copied out of the map into a torch tensor."""
        array = np.array(self.tensor_array(name)[begin:end])  # copy: only these rows are read
        torch_dtype = ST_DTYPES[self.header[name]["dtype"]][1]
        tensor = torch.from_numpy(array)
        return tensor.view(torch_dtype) if torch_dtype is not None and tensor.dtype != torch_dtype else tensor

    def verify(self, sha256: str | None, vocab_size: int | None) -> None:
        """The whole file against its recorded sha256, and the values: token ids within the vocabulary,
        loss mask 0/1. One read of the file."""
        if sha256 is not None:
            digest = hashlib.sha256()
            with open(self.path, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
            if digest.hexdigest() != sha256:
                raise self.error("its checksum (sha256) differs from the one recorded when it was written")
        ids = self.tensor_array("input_ids")
        if len(ids) and (int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size)):
            raise self.error(
                f"token ids {int(ids.min())}..{int(ids.max())} leave the vocabulary of {vocab_size}"
            )
        mask = self.tensor_array("loss_mask")
        if len(mask) and int(mask.max()) > 1:
            raise self.error("its loss mask holds values other than 0 and 1")

    def close(self) -> None:
        self._map = None
