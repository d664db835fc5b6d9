"""The same Llama with a larger head_dim: an exact re-expression for engines that refuse small heads.

vLLM's CPU attention runs head sizes 32, 64, 80, ... only; stories260K has head_dim 8. A Llama with
head_dim D is the same function with head_dim N = r * D when, per head (q, k and v alike):

- rotary dimension j < D/2 moves to slot r*j and its partner j + D/2 to N/2 + r*j: RoPE (rotate_half)
  pairs slot i with i + N/2 and turns it at base^(-2i/N), so slot r*j turns at base^(-2j/D), the
  original frequency, together with its original partner;
- every other slot of q, k and v is zero (a rotation of zeros is zero; zeros add nothing to q.k or to
  the attention output);
- o_proj's input columns move the same way;
- q is scaled by sqrt(r), so the softmax scale 1/sqrt(N) gives q.k/sqrt(D) as before (r = 4: a factor
  2, exact in floating point).
- per-head RMSNorms on q and k (Qwen3-style attention: a DFlash head's `q_norm` / `k_norm`): their weights
  move to the same slots. The norm's mean runs over N slots, r times as many: k_proj is scaled by sqrt(r)
  too, so both means are the original ones (eps unchanged); the normed q keeps its factor sqrt(r) (for
  the softmax scale) and k_norm's weight is divided by sqrt(r) to give the original k.

`widen_state` applies this to any state dict (a target's `model.layers.N.self_attn.*` or a draft head's
`layers.N.self_attn.*`, an EAGLE-3 head's `midlayer.self_attn.*`); `widen_model_dir` writes a re-expressed
target directory (config, weights, tokenizer); `widen_head` returns a re-expressed draft head. Only RoPE
whose frequencies depend on the frequency alone (default, linear, llama3) re-expresses exactly; others are
refused, and so is a head_dim that is not a positive multiple of the model's.

    python -m eagle_train.interop.reexpress [SRC] OUT [--head-dim 32] [--overwrite]   (SRC: the default target)

OUT is written atomically under its output lock and never removes what this command did not write
(eagle_train.runtime.atomic_files.check_output_dir): it must be absent, empty or an earlier output of this
command (config.json records `eagle_train_reexpressed`; replaced whole); `--overwrite` writes the model's
files into any other directory (deleting nothing else) or replaces a file in its place. OUT == SRC is
refused even then.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.eagle3 import Eagle3Head
from eagle_train.modeling.head_checkpoint import CONFIG_NAME, WEIGHTS_NAME
from eagle_train.runtime.atomic_files import (
    atomic_write_dir,
    atomic_write_into,
    check_output_dir,
    read_json,
    remove_partial_files,
)
from eagle_train.runtime.errors import InputError, user_errors
from eagle_train.runtime.output_lock import OutputLock

ATTENTION_KEY = re.compile(r"(^|\.)self_attn\.([qkvo])_proj\.(weight|bias)$")
HEAD_NORM_KEY = re.compile(r"(^|\.)self_attn\.([qk])_norm\.weight$")  # per-head RMSNorm (Qwen3-style)
EXACT_ROPE_TYPES = ("default", "linear", "llama3")
# files of a model directory that describe the tokenizer and generation, copied as they are
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def check_head_dims(head_dim: int, new_head_dim: int) -> None:
    """InputError unless `new_head_dim` can hold `head_dim` exactly: a positive multiple of it (even)."""
    if head_dim <= 0 or head_dim % 2 or new_head_dim <= 0 or new_head_dim % head_dim:
        raise InputError(
            f"head_dim {new_head_dim} is not an even multiple of {head_dim}: the new head_dim (--head-dim) must "
            f"be a positive multiple of the model's ({head_dim}, e.g. {4 * max(head_dim, 1)})"
        )


def rotary_slots(head_dim: int, new_head_dim: int) -> torch.Tensor:
    """[head_dim] the slot of each original dimension in a head of `new_head_dim`."""
    check_head_dims(head_dim, new_head_dim)
    r, half = new_head_dim // head_dim, head_dim // 2
    j = torch.arange(half)
    return torch.cat([r * j, new_head_dim // 2 + r * j])


def _spread(tensor: torch.Tensor, dim: int, head_dim: int, new_head_dim: int) -> torch.Tensor:
    """Move the per-head blocks of `tensor` along `dim` ([heads * head_dim]) into zero-filled heads of
    `new_head_dim` at `rotary_slots`."""
    moved = tensor.movedim(dim, 0)  # [heads * head_dim, ...]
    heads = moved.shape[0] // head_dim
    out = moved.new_zeros(heads, new_head_dim, *moved.shape[1:])
    out[:, rotary_slots(head_dim, new_head_dim)] = moved.reshape(heads, head_dim, *moved.shape[1:])
    return out.reshape(heads * new_head_dim, *moved.shape[1:]).movedim(0, dim)


@torch.no_grad()
def widen_state(state: dict[str, torch.Tensor], head_dim: int, new_head_dim: int) -> dict[str, torch.Tensor]:
    """A new state dict: every attention projection re-expressed with `new_head_dim` (others shared)."""
    check_head_dims(head_dim, new_head_dim)
    scale = math.sqrt(new_head_dim / head_dim)
    normed = {
        key[: m.start(0)] for key in state if (m := HEAD_NORM_KEY.search(key))
    }  # their layers' prefixes
    out = {}
    for key, value in state.items():
        if match := HEAD_NORM_KEY.search(key):  # [head_dim], shared by the heads; k's undoes k_proj's scale
            wide = _spread(
                value.double() / (scale if match.group(2) == "k" else 1.0), 0, head_dim, new_head_dim
            )
            out[key] = wide.to(value.dtype)
            continue
        match = ATTENTION_KEY.search(key)
        if match is None:
            out[key] = value
            continue
        proj, kind = match.group(2), match.group(3)
        if proj == "o":  # [hidden, heads * head_dim]: its input columns move; its bias is per output
            out[key] = value if kind == "bias" else _spread(value, 1, head_dim, new_head_dim)
            continue
        scaled = proj == "q" or (proj == "k" and key[: match.start(0)] in normed)
        wide = _spread(value.double() if scaled else value, 0, head_dim, new_head_dim)
        out[key] = (wide * scale).to(value.dtype) if scaled else wide
    return out


def check_exact(config: dict[str, Any]) -> int:
    """The config's head_dim, after refusing what the re-expression cannot keep exact."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in EXACT_ROPE_TYPES:
        raise InputError(
            f"RoPE type {rope_type!r} depends on head_dim itself: the re-expression would not be "
            f"exact (supported: {EXACT_ROPE_TYPES})"
        )
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise InputError("partial rotary embeddings cannot be re-expressed with this mapping")
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def widened_config(config: dict[str, Any], new_head_dim: int) -> dict[str, Any]:
    """config.json of the re-expressed model: head_dim changed, where it came from recorded."""
    head_dim = check_exact(config)
    return {
        **config,
        "head_dim": new_head_dim,
        "eagle_train_reexpressed": {"head_dim": head_dim, "new_head_dim": new_head_dim},
    }


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors (one file or an index of shards)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for f in files for k, v in load_file(str(path / f)).items()}
    if (path / WEIGHTS_NAME).is_file():
        return load_file(str(path / WEIGHTS_NAME))
    raise InputError(f"{path}: no {WEIGHTS_NAME} (safetensors weights are needed to re-express a model)")


def is_reexpressed(path: Path) -> bool:
    """Whether `path` holds an earlier output of `widen_model_dir` (its files only)."""
    try:
        config = read_json(path / CONFIG_NAME)
    except ValueError:
        return False
    names = {p.name for p in path.iterdir()}
    return (
        isinstance(config, dict)
        and "eagle_train_reexpressed" in config
        and names <= {CONFIG_NAME, WEIGHTS_NAME, *SIDE_FILES}
    )


def check_reexpress_out(source: Path, out_dir: Path, overwrite: bool) -> bool:
    """Whether `out_dir` is replaced whole (True) or written into (False): `check_output_dir`'s rule, and
    never the source model itself."""
    if out_dir.resolve() == source.resolve():
        raise InputError(f"OUT {out_dir} is the source model itself: choose another output directory")
    what = "an earlier output of eagle_train.interop.reexpress"
    writes = f"{CONFIG_NAME}, {WEIGHTS_NAME} and the tokenizer files"
    own = lambda: is_reexpressed(out_dir)  # noqa: E731
    return check_output_dir(out_dir, own, overwrite, what, writes, "--overwrite")


def widen_model_dir(
    source: str | Path, out_dir: str | Path, new_head_dim: int = 32, overwrite: bool = False
) -> Path:
    """Write the Llama at `source` re-expressed with `new_head_dim` to `out_dir` (atomically, under its lock;
    `check_reexpress_out` says whether it is replaced or written into): config.json, one model.safetensors,
    the tokenizer and generation files as they are."""
    source, out_dir = Path(source), Path(out_dir)
    config = read_json(source / CONFIG_NAME, "model config")
    if not isinstance(config, dict) or config.get("model_type") != "llama":
        model_type = config.get("model_type") if isinstance(config, dict) else None
        raise InputError(f"{source}: model_type {model_type!r}; only Llama models are re-expressed")
    head_dim = check_exact(config)
    check_head_dims(head_dim, new_head_dim)
    new_config = widened_config(config, new_head_dim)
    new_config["eagle_train_reexpressed"]["source"] = str(source)
    with OutputLock(out_dir, "reexpress"):
        replace_whole = check_reexpress_out(source, out_dir, overwrite)
        state = widen_state(read_model_weights(source), head_dim, new_head_dim)

        def write(tmp: Path) -> None:
            weights = {k: v.contiguous() for k, v in state.items()}
            save_file(weights, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            (tmp / CONFIG_NAME).write_text(json.dumps(new_config, indent=2, sort_keys=True) + "\n")
            for name in SIDE_FILES:
                if (source / name).is_file():
                    shutil.copyfile(source / name, tmp / name)

        if out_dir.parent.is_dir():
            remove_partial_files(out_dir.parent, out_dir.name)  # a killed run's temporary directory
        if replace_whole:
            atomic_write_dir(out_dir, write)
        else:
            atomic_write_into(out_dir, write)
    return out_dir


@torch.no_grad()
def widen_head(head: DraftHead | Eagle3Head, new_head_dim: int) -> DraftHead | Eagle3Head:
    """The draft head (EAGLE-1/2, EAGLE-3, P-EAGLE or DFlash: every layer's attention the same way) re-expressed with
    `new_head_dim` (same outputs; `head` itself if it has that head_dim)."""
    config_dict = head.config.to_dict()
    head_dim = check_exact(config_dict)
    if head_dim == new_head_dim:
        return head
    check_head_dims(head_dim, new_head_dim)
    config = LlamaConfig(**{**config_dict, "head_dim": new_head_dim})
    wide = head.with_config(config)
    wide.load_state_dict(widen_state(head.trainable_state_dict(), head_dim, new_head_dim), strict=False)
    return wide.to(head.fc.weight.dtype).train(head.training)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point; a user error ends it in one line (eagle_train.runtime.errors)."""
    from eagle_train.config.base import resolve_path, to_schema
    from eagle_train.config.target import TargetConfig
    from eagle_train.modeling.target import target_source

    parser = argparse.ArgumentParser(description="Re-express a Llama exactly with a larger head_dim.")
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="[SRC] OUT",
        help="source model directory (default: the default target) and the directory to write",
    )
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an OUT that is not empty and not an earlier output (nothing else there is deleted)",
    )
    args = parser.parse_args(argv)
    if len(args.paths) > 2:
        parser.error("give at most SRC and OUT")
    with user_errors():
        source = args.paths[0] if len(args.paths) == 2 else target_source(to_schema({}, TargetConfig))
        out = widen_model_dir(resolve_path(source) or source, args.paths[-1], args.head_dim, args.overwrite)
    print(f"wrote {out} (head_dim {args.head_dim})")


if __name__ == "__main__":
    main()
