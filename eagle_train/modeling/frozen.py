"""The target's frozen parts without its decoder layers, read from its checkpoint files alone.

Offline training needs the target's config, token embedding and LM head (the head shares them); the
vLLM backend of extraction needs the final norm as well (vLLM hands out the residual stream before it).
`load_frozen_target` reads exactly those tensors: the checkpoint's index (`model.safetensors.index.json`
or `pytorch_model.bin.index.json`) names the shards that hold them, a safetensors shard is read one
tensor at a time (`safe_open`), a pytorch shard is memory-mapped with `weights_only=True` (no code from
the file runs, only the tensors asked for are copied). The parameter names come from the model class
built on the meta device (nothing allocated), so tied embeddings and each family's naming are the
model's own. At 70B that is 2 x 2.1 GB read instead of 140 GB.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase
from transformers.utils import cached_file

from eagle_train.config.target import TargetConfig
from eagle_train.modeling.target import (
    TargetParts,
    check_preset_ids,
    error_reason,
    load_target_config,
    load_tokenizer,
    target_source,
    torch_dtype,
)
from eagle_train.runtime.atomic_files import cached_sha256
from eagle_train.runtime.errors import InputError

# (file, format) in the order Hugging Face prefers them
WEIGHT_FILES = (
    ("model.safetensors.index.json", "safetensors"),
    ("model.safetensors", "safetensors"),
    ("pytorch_model.bin.index.json", "pytorch"),
    ("pytorch_model.bin", "pytorch"),
)


class CheckpointError(InputError):
    """The target's checkpoint files lack what is asked for (the message names the file and the key)."""


@dataclass
class FrozenTarget(TargetParts):
    """A target's config, tokenizer, embedding and LM head (and with `norm` its final norm), without its
    decoder layers: what offline training and the vLLM backend need (`Target` has the same fields)."""

    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    cfg: TargetConfig
    source: str
    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    norm: nn.Module | None = None  # the final norm (the LM head's input is norm(residual stream))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @functools.cached_property
    def generation_config(self) -> GenerationConfig:
        """The checkpoint's generation_config.json, else the one its config implies (as `from_pretrained`
        falls back)."""
        try:
            return GenerationConfig.from_pretrained(self.source, revision=self.cfg.revision)
        except OSError:
            return GenerationConfig.from_model_config(self.config)


def weight_files(source: str, revision: str | None = None) -> tuple[dict[str, Shard], str]:
    """{checkpoint key: the shard holding it} and the format (safetensors | pytorch), from the index or
    the single file's own keys. A hub id's shards are fetched only when a tensor of theirs is read."""
    for name, kind in WEIGHT_FILES:
        path = _resolve(source, name, revision)
        if path is None:
            continue
        if not name.endswith(".index.json"):
            single = Shard(source, name, revision)
            return dict.fromkeys(_file_keys(path, kind), single), kind
        weight_map = json.loads(path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path}: no weight_map (not a Hugging Face checkpoint index)")
        shards = {file: Shard(source, file, revision) for file in set(weight_map.values())}
        return {key: shards[file] for key, file in weight_map.items()}, kind
    names = ", ".join(name for name, _ in WEIGHT_FILES)
    raise CheckpointError(f"target {source}: no checkpoint found (none of {names})")


@dataclass(frozen=True)
class Shard:
    """One checkpoint file, resolved (for a hub id: downloaded) only when a tensor of it is read."""

    source: str
    name: str
    revision: str | None = None

    def path(self) -> Path:
        path = _resolve(self.source, self.name, self.revision)
        if path is None:
            raise CheckpointError(
                f"target {self.source}: the checkpoint index names {self.name}, which is missing"
            )
        return path


def checkpoint_sha256(source: str, revision: str | None = None) -> dict[str, str]:
    """{file name: sha256} of every weight file of the checkpoint (the shards its index names, or its
    single file): the identity of every weight the features depend on, decoder layers included. Only
    bytes are read, never a tensor; each file is hashed once (files.cached_sha256: later calls cost a
    stat), several at a time. For a hub id the files are fetched first if they are not in its cache."""
    files, _ = weight_files(source, revision)
    shards = sorted(set(files.values()), key=lambda shard: shard.name)
    paths = [shard.path() for shard in shards]
    workers = max(1, min(len(paths), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sha256") as pool:
        digests = list(pool.map(cached_sha256, paths))  # hashlib and reads release the GIL
    return {shard.name: digest for shard, digest in zip(shards, digests, strict=True)}


def _resolve(source: str, name: str, revision: str | None) -> Path | None:
    if Path(source).is_dir():
        return Path(source) / name if (Path(source) / name).is_file() else None
    found = cached_file(source, name, revision=revision, _raise_exceptions_for_missing_entries=False)
    return Path(found) if found else None


@contextlib.contextmanager
def named_read(file: Path) -> Iterator[None]:
    """A checkpoint file that cannot be read (cut short, not safetensors, a pickle with code in it, which
    torch's weights_only load refuses) is a CheckpointError naming it, not a traceback from the reader."""
    try:
        yield
    except (SafetensorError, pickle.UnpicklingError, EOFError, RuntimeError, OSError) as err:
        raise CheckpointError(
            f"{file}: cannot be read as a weight file ({error_reason(err)}): damaged, or not a checkpoint "
            "of plain tensors"
        ) from None


def _file_keys(path: Path, kind: str) -> list[str]:
    with named_read(path):
        if kind == "safetensors":
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        return list(torch.load(path, map_location="cpu", weights_only=True, mmap=True))


def read_checkpoint_tensors(
    source: str, keys: list[str], revision: str | None = None
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors `keys` (their stored dtype), reading only the shards that hold them."""
    files, kind = weight_files(source, revision)
    by_file: dict[Shard, list[str]] = {}
    for key in keys:
        if key not in files:
            raise CheckpointError(f"target {source}: no tensor {key!r} in its checkpoint")
        by_file.setdefault(files[key], []).append(key)
    out = {}
    for shard, wanted in by_file.items():
        read = _read_safetensors if kind == "safetensors" else _read_pytorch
        out.update(read(shard.path(), wanted))
    return out


def _read_safetensors(file: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    with named_read(file), safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in keys}


def _read_pytorch(file: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    with named_read(file):
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    return {k: state[k].clone() for k in keys}  # copied out of the map; the rest is never read


def meta_model(config: PretrainedConfig, trust_remote_code: bool = False) -> nn.Module:
    """The model class built on the meta device: its parameter names and modules, nothing allocated."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def frozen_parameters(model: nn.Module, norm: bool) -> dict[str, str]:
    """{part: parameter name} of embed_tokens, lm_head and, with `norm`, the final norm's parameters
    (`norm.weight`, ...); a tied LM head is named by the embedding's parameter."""
    modules = {id(module): name for name, module in model.named_modules()}
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {"embed_tokens": f"{modules[id(embed)]}.weight"}
    names["lm_head"] = (
        names["embed_tokens"] if lm_head.weight is embed.weight else f"{modules[id(lm_head)]}.weight"
    )
    if norm:
        final = final_norm(model)
        names.update({f"norm.{n}": f"{modules[id(final)]}.{n}" for n, _ in final.named_parameters()})
    return names


def final_norm(model: nn.Module) -> nn.Module:
    """The decoder's final norm (the LM head's input is its output)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not isinstance(getattr(decoder, "norm", None), nn.Module):
        raise CheckpointError(f"{type(model).__name__}: its decoder has no `norm` module (the final norm)")
    return decoder.norm


def checkpoint_key(name: str, available: dict, source: str) -> str:
    """The checkpoint key of parameter `name`: itself, or the one key that ends with its last two parts
    (e.g. `embed_tokens.weight`, for a checkpoint saved under another prefix)."""
    if name in available:
        return name
    tail = ".".join(name.split(".")[-2:])
    found = [k for k in available if k == tail or k.endswith("." + tail)]
    if len(found) != 1:
        why = "several keys end with" if found else "no key ends with"
        raise CheckpointError(
            f"target {source}: parameter {name!r} is not in its checkpoint ({why} {tail!r})"
        )
    return found[0]


def load_frozen_target(
    cfg: TargetConfig, norm: bool = False, dtype: torch.dtype | None = None
) -> FrozenTarget:
    """The target's config, tokenizer, embedding and LM head (and its final norm with `norm`) in `dtype`
    (default: target.dtype; `auto`: the checkpoint's), frozen, on the CPU: no decoder layer is built or
    read. A tied LM head is the embedding's tensor (one copy)."""
    source = target_source(cfg)
    config = load_target_config(cfg)
    model = meta_model(config, cfg.trust_remote_code)
    names = frozen_parameters(model, norm)
    files, _ = weight_files(source, cfg.revision)
    keys = {part: checkpoint_key(name, files, source) for part, name in names.items()}
    tensors = read_checkpoint_tensors(source, sorted(set(keys.values())), cfg.revision)
    dtype = dtype or (None if cfg.dtype == "auto" else torch_dtype(cfg.dtype))
    converted = {key: tensor.to(dtype or tensor.dtype) for key, tensor in tensors.items()}  # once per tensor
    weight = {part: converted[key] for part, key in keys.items()}
    embed = nn.Embedding.from_pretrained(weight["embed_tokens"], freeze=True)
    lm_head = nn.Linear(weight["lm_head"].shape[1], weight["lm_head"].shape[0], bias=False, device="meta")
    lm_head.weight = nn.Parameter(weight["lm_head"], requires_grad=False)
    module = None
    if norm:
        module = final_norm(model).to_empty(device="cpu")
        module.load_state_dict(
            {p.removeprefix("norm."): w for p, w in weight.items() if p.startswith("norm.")}
        )
        module.requires_grad_(False).eval()
    tokenizer = load_tokenizer(cfg)
    check_preset_ids(cfg, tokenizer, int(lm_head.weight.shape[0]))
    return FrozenTarget(config, tokenizer, cfg, source, embed, lm_head, module)
