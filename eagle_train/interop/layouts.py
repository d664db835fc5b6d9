"""Draft heads in other projects' layouts: export writers (vLLM, SGLang, the EAGLE reference) and one
importer that reads all of them plus this project's checkpoints and the reference's published heads.

What each consumer really loads (read from their loaders):
- vLLM (`model_executor/models/llama_eagle.py`): a plain Llama config (`architectures:
  ["LlamaForCausalLM"]`, mapped to `EagleLlamaForCausalLM`), `fc = Linear(2d, d, bias=False)`; an
  `fc.bias` in the file is silently skipped ("weights that don't exist in the model"), which would change
  every draft token. q/k/v/o biases follow `attention_bias`. So a head trained with an fc bias is
  exported by folding the bias exactly into the first layer (see `fold_fc_bias`), or refused.
- SGLang (`srt/models/llama_eagle.py`, `llama.py`): `architectures: ["LlamaForCausalLMEagle"]`,
  `fc = Linear(2d, d)` WITH a bias (always: a head without one gets a zero bias, never garbage). Its
  `load_weights` prefixes every key but lm_head with `model.` (so the file has none), stacks q/k/v into
  qkv_proj and gate/up into gate_up_proj, warns on an unknown key and skips an unknown `.bias` silently;
  layer 0's input_layernorm is the identity; the MLP has no bias and only SiLU (refused otherwise).
- EAGLE reference (`eagle/model/ea_model.py`, `cnets.py`, `configs.py`): `pytorch_model.bin` loaded
  with `load_state_dict(strict=True)` into a module that owns `embed_tokens`, so the file carries
  `embed_tokens.weight`; config.json's `bias` key (default true) sets the fc bias; `rope_scaling` must be
  null or exactly `{type: linear|dynamic, factor}`; `rope_theta` is read from the top level.
- vLLM and SGLang both turn a top-level `bias: true` into ATTENTION biases, so only the reference layout
  carries that key.
No layout has `layers.0.input_layernorm` or `lm_head`. Every config.json gets an `eagle_train` block
with the target's id and the training maximum length, so a server or a user can warn beyond it.
EAGLE-3 heads (their own layouts, and the `speculators` one) are written and read by
`eagle_train.interop.eagle3_layouts`; `export_head` and `load_draft` hand them over.

Export never deletes what it did not write: an output directory that exists and is not empty must be an
earlier export of the same format (then it is replaced whole, atomically), or `overwrite=True` writes this
layout's files into it and removes nothing but an earlier export's own weights.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from eagle_train.decoding.kv_cache import attention_shape
from eagle_train.modeling.dflash import DFlashHead
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.head_checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_finite,
    check_head_files,
    head_model,
    read_head_weights,
)
from eagle_train.modeling.target import DTYPE_NAMES
from eagle_train.runtime.atomic_files import atomic_write_dir, atomic_write_into, check_output_dir, read_json
from eagle_train.runtime.errors import InputError

log = logging.getLogger(__name__)

FORMATS = ("vllm", "sglang", "eagle", "speculators")
BIN_NAME = "pytorch_model.bin"
ARCHITECTURES = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle", "eagle": "LlamaForCausalLM"}
# Llama config fields a head's config.json carries (the rest of a target's config is noise here).
CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "attention_bias",
    "mlp_bias",
)
LAYOUT_FILES = {
    "vllm": (CONFIG_NAME, WEIGHTS_NAME),
    "sglang": (CONFIG_NAME, WEIGHTS_NAME),
    "eagle": (CONFIG_NAME, BIN_NAME),
    "speculators": (CONFIG_NAME, WEIGHTS_NAME),
}


# ---------------------------------------------------------------------------------------------- export


def rope_fields(config: LlamaConfig) -> dict[str, Any]:
    """RoPE in both spellings: `rope_parameters` (transformers 5) and `rope_theta` + `rope_scaling`
    (transformers 4, vLLM, SGLang, the reference). rope_scaling is null for plain RoPE."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = None if rope_type == "default" else {**params, "rope_type": rope_type, "type": rope_type}
    return {
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_theta": theta, **params, "rope_type": rope_type},
    }


def llama_config_dict(head: DraftHead, dtype: torch.dtype) -> dict[str, Any]:
    """A portable Llama config.json for the head (readable by transformers 4 and 5)."""
    src = head.config.to_dict()
    config = {k: src[k] for k in CONFIG_FIELDS if k in src}
    config.update(rope_fields(head.config))
    config.update(
        model_type="llama",
        num_hidden_layers=int(head.config.num_hidden_layers),
        tie_word_embeddings=False,
        use_cache=True,
        torch_dtype=DTYPE_NAMES[dtype],
        dtype=DTYPE_NAMES[dtype],
    )
    return config


@torch.no_grad()
def fold_fc_bias(state: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Move `fc.bias` b into layer 0's attention biases, exactly (in place; sets attention_bias).

    Layer 0 has no input norm, so its input is h = W x + b. q/k/v = W_* h: the bias becomes
    W_* b added to their biases; the residual carries b: added to o_proj's bias. Every output is unchanged
    (up to rounding). Layers >= 1 get zero biases, which `attention_bias: true` makes them expect.
    """
    bias = state.pop("fc.bias").double()
    layer_ids = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")})
    had_bias = bool(config.get("attention_bias"))
    for i in layer_ids:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = state[f"layers.{i}.self_attn.{proj}.weight"]  # [out, in]
            key = f"layers.{i}.self_attn.{proj}.bias"
            if key not in state:
                if had_bias:
                    raise InputError(f"config says attention_bias but {key} is missing")
                state[key] = torch.zeros(w.shape[0], dtype=w.dtype)
            if i == 0:
                add = bias if proj == "o_proj" else w.double() @ bias
                state[key] = (state[key].double() + add).to(w.dtype)
    config["attention_bias"] = True


def check_reference_representable(head: DraftHead, config: dict[str, Any]) -> None:
    """Refuse what the reference's EConfig / cnets.Model cannot hold, rather than export a wrong head."""
    scaling = config["rope_scaling"]
    if scaling is not None and scaling["type"] not in ("linear", "dynamic"):
        raise InputError(
            f"format=eagle: the EAGLE reference only knows linear/dynamic RoPE scaling, this head uses "
            f"{scaling['type']!r}; export with format=vllm or format=sglang instead"
        )
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise InputError(
            "format=eagle: the EAGLE reference's layer has no o_proj/MLP biases; use format=sglang"
        )
    if head.config.head_dim * head.config.num_attention_heads != head.config.hidden_size:
        raise InputError(
            "format=eagle: the EAGLE reference needs head_dim * num_attention_heads == hidden_size"
        )


def check_sglang_representable(config: dict[str, Any]) -> None:
    """SGLang's Llama layer has an MLP without biases (a bias in the file is skipped silently) and only SiLU."""
    if config.get("mlp_bias"):
        raise InputError(
            "format=sglang: SGLang's LlamaMLP has no biases and would skip them silently; use format=vllm"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise InputError(
            f"format=sglang: SGLang's LlamaMLP supports silu only, this head uses {config['hidden_act']!r}"
        )


def reference_config(config: dict[str, Any], fc_bias: bool) -> dict[str, Any]:
    """The reference's config.json: Llama keys, `bias` for fc, rope_scaling as {type, factor}."""
    out = {k: v for k, v in config.items() if k != "rope_parameters"}
    if out["rope_scaling"] is not None:
        out["rope_scaling"] = {
            "type": out["rope_scaling"]["type"],
            "factor": float(out["rope_scaling"]["factor"]),
        }
    out.update(bias=fc_bias, pretraining_tp=1)
    return out


def export_head(
    head: DraftHead,
    fmt: str,
    out_dir: str | Path,
    meta: dict[str, Any] | None = None,
    embed_tokens: torch.Tensor | None = None,  # [vocab, hidden]: required for format=eagle
    dtype: torch.dtype | None = None,
    fold_bias: bool = True,
    speculative_tokens: int = 3,  # format=speculators: K, the draft tokens vLLM proposes per step
    overwrite: bool = False,
) -> Path:
    """Atomically write `head` to `out_dir` in the layout `fmt` (vllm | sglang | eagle | speculators) loads.

    vllm: a trained fc bias is folded into layer 0 (`fold_bias=True`) or refused. eagle: needs the
    target's input embedding (the reference loads it strictly from the head's file). speculators:
    EAGLE-3 heads only (the format has no EAGLE-1 type). An existing non-empty `out_dir` is refused
    unless it is an earlier `fmt` export or `overwrite` is set (`check_export_dir`).
    """
    if fmt not in FORMATS:
        raise InputError(f"unknown export format {fmt!r}; expected one of {FORMATS}")
    out_dir = Path(out_dir)
    replace_whole = check_export_dir(out_dir, fmt, overwrite)
    check_finite(head.trainable_state_dict(), "export")
    dtype = dtype or head.fc.weight.dtype
    if head.kind == "dflash":
        from eagle_train.interop.dflash_layouts import dflash_writer  # it builds on this module's helpers

        write = dflash_writer(head, fmt, {**(meta or {}), "format": fmt}, dtype, speculative_tokens)
        return publish_export(out_dir, fmt, write, replace_whole)
    if head.reads_aux:  # EAGLE-3 and P-EAGLE
        from eagle_train.interop.eagle3_layouts import eagle3_writer  # it builds on this module's helpers

        llama = llama_config_dict(head, dtype)
        info = {**(meta or {}), "format": fmt, "fc_bias": False}
        if fmt == "eagle":
            llama = reference_config(llama, False)
        if fmt == "sglang":
            check_sglang_representable(llama)
        write = eagle3_writer(head, fmt, llama, info, dtype, embed_tokens, speculative_tokens)
        return publish_export(out_dir, fmt, write, replace_whole)
    if fmt == "speculators":
        raise InputError("format=speculators has no EAGLE-1 head type; export with format=vllm")
    state = {k: v.detach().to("cpu", torch.float32).clone() for k, v in head.trainable_state_dict().items()}
    config = llama_config_dict(head, dtype)
    fc_bias = "fc.bias" in state
    info = {**(meta or {}), "format": fmt, "fc_bias": fc_bias}
    if fmt == "vllm" and fc_bias:
        if not fold_bias:
            raise InputError(
                "format=vllm: vLLM's EAGLE fc has no bias and skips fc.bias silently, which changes every draft "
                "token. Train with draft.fc_bias=false, or export with fc_bias=fold (exact: moves the bias into "
                "layer 0's attention biases)."
            )
        fold_fc_bias(state, config)
        info["fc_bias_folded"] = True
    if fmt == "sglang":
        check_sglang_representable(config)
    if fmt == "sglang" and not fc_bias:
        state["fc.bias"] = torch.zeros(
            head.fc.out_features
        )  # SGLang's fc always has one: never leave it unset
    if fmt == "eagle":
        check_reference_representable(head, config)
        if embed_tokens is None:
            raise InputError(
                "format=eagle: the reference loads embed_tokens.weight strictly; pass the target's embedding"
            )
        config = reference_config(config, fc_bias)
    if embed_tokens is not None:
        if embed_tokens.shape != (config["vocab_size"], config["hidden_size"]):
            raise InputError(f"embedding shape {tuple(embed_tokens.shape)} does not match the head's config")
        state["embed_tokens.weight"] = embed_tokens.detach().to("cpu", torch.float32).clone()
    config["architectures"] = [ARCHITECTURES[fmt]]
    config["eagle_train"] = info
    state = {k: v.to(dtype).contiguous() for k, v in sorted(state.items())}
    return publish_export(out_dir, fmt, files_writer(state, config, bin_file=fmt == "eagle"), replace_whole)


def files_writer(
    state: dict[str, torch.Tensor], config: dict[str, Any], bin_file: bool = False
) -> Callable[[Path], None]:
    """`write(dir)`: an export's files: `state` as model.safetensors (`bin_file`: pytorch_model.bin, the
    reference's) and `config` as config.json."""

    def write(tmp: Path) -> None:
        if bin_file:
            torch.save(state, tmp / BIN_NAME)
        else:
            save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    return write


def publish_export(out_dir: Path, fmt: str, write: Callable[[Path], None], replace_whole: bool) -> Path:
    """`write(dir)`'s files at `out_dir`, atomically: the whole directory replaced (`replace_whole`), or
    written into it, removing only an earlier export's own weights (`check_export_dir` decided which)."""
    if replace_whole:
        atomic_write_dir(out_dir, write)
        return out_dir
    earlier = exported_format(out_dir)
    atomic_write_into(out_dir, write)
    for name in set(LAYOUT_FILES.get(earlier, ())) - set(LAYOUT_FILES[fmt]):  # an earlier export's weights
        (out_dir / name).unlink(missing_ok=True)
    return out_dir


def exported_format(out_dir: Path) -> str | None:
    """The format an earlier export recorded in `out_dir/config.json`, or None (not one of ours)."""
    try:
        info = read_json(out_dir / CONFIG_NAME).get("eagle_train", {})
    except (ValueError, AttributeError):
        return None
    fmt = info.get("format") if isinstance(info, dict) else None
    return fmt if fmt in FORMATS else None


def check_export_dir(out_dir: Path, fmt: str, overwrite: bool) -> bool:
    """Whether `out_dir` is replaced whole (`check_output_dir`): it does not exist or holds exactly an
    earlier `fmt` export. An empty directory, or any directory with `overwrite`, is written into (False).
    Anything else is refused: export never deletes files it did not write."""

    def own() -> bool:
        entries = {p.name for p in out_dir.iterdir()}
        return entries <= set(LAYOUT_FILES[fmt]) and exported_format(out_dir) == fmt

    writes = " and ".join(LAYOUT_FILES[fmt])
    return check_output_dir(out_dir, own, overwrite, f"an earlier format={fmt} export", writes)


def load_input_embedding(source: str | Path) -> torch.Tensor:
    """A target's input embedding [vocab, hidden] without loading the whole model when its weights are
    safetensors (reads one tensor); otherwise through transformers."""
    path = Path(source)
    index = path / "model.safetensors.index.json"
    files = {}
    if index.is_file():
        files = {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    elif (path / WEIGHTS_NAME).is_file():
        with safe_open(str(path / WEIGHTS_NAME), framework="pt") as f:
            files = {k: path / WEIGHTS_NAME for k in f.keys()}
    key = next((k for k in sorted(files, key=len) if k.endswith("embed_tokens.weight")), None)
    if key is not None:
        with safe_open(str(files[key]), framework="pt") as f:
            return f.get_tensor(key)
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype="auto")
    return model.get_input_embeddings().weight.detach()


# ---------------------------------------------------------------------------------------------- import


def read_weights(path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The head's tensors from model.safetensors or pytorch_model.bin (weights_only: no pickled code)."""
    for name in (WEIGHTS_NAME, BIN_NAME):
        file = path / name
        if file.is_file():
            if name == WEIGHTS_NAME:
                return read_head_weights(file), file
            try:
                state = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as err:  # a pickle with code in it, or a corrupt file
                raise InputError(f"{file}: not a plain tensor state dict ({err})") from err
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise InputError(f"{file}: expected a dict of tensors")
            return state, file
    raise FileNotFoundError(f"draft head {path}: no weights ({WEIGHTS_NAME} or {BIN_NAME})")


def head_state(raw: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    """fc.* and layers.* (a `model.` prefix stripped); embed_tokens/lm_head dropped (the target's are
    used)."""
    state = {}
    for key, value in raw.items():
        key = key.removeprefix("model.")
        if key.startswith(("embed_tokens.", "lm_head.")) or key.endswith("rotary_emb.inv_freq"):
            continue
        if not key.startswith(("fc.", "layers.")):
            raise InputError(f"{file}: unexpected tensor {key!r} for an EAGLE-1/2 head")
        state[key] = value
    if "fc.weight" not in state:
        raise InputError(f"{file}: no fc.weight: not an EAGLE draft head")
    return state


def head_config(raw: dict[str, Any], state: dict[str, torch.Tensor] | None = None) -> LlamaConfig:
    """The head's Llama config from its config.json; the layer count is taken from the weights (EAGLE-3
    heads, `state` None: one layer, the midlayer)."""
    kwargs = {k: raw[k] for k in CONFIG_FIELDS if raw.get(k) is not None}
    if raw.get("rope_parameters"):
        kwargs["rope_parameters"] = raw["rope_parameters"]
    else:
        kwargs["rope_theta"] = raw.get("rope_theta", 10000.0)
        if raw.get("rope_scaling"):
            kwargs["rope_scaling"] = raw["rope_scaling"]
    if "qkv_bias" in raw and not kwargs.get("attention_bias"):
        raise InputError("config.json: qkv_bias (q/k/v biases without o_proj) is not supported")
    layers = [int(k.split(".")[1]) for k in state or {} if k.startswith("layers.")]
    kwargs["num_hidden_layers"] = 1 + max(layers, default=0)
    shape = attention_shape(kwargs)
    kwargs.update(head_dim=shape.head_dim, num_key_value_heads=shape.kv_heads)
    return LlamaConfig(**kwargs, tie_word_embeddings=False)


def check_matches_target(config: LlamaConfig, state: dict[str, torch.Tensor], target, file: Path) -> None:
    """A head for another target: a clear error instead of a shape error deep in a forward."""
    d = int(state["fc.weight"].shape[0])
    if (
        d != target.hidden_size
        or config.hidden_size != target.hidden_size
        or state["fc.weight"].shape[1] != 2 * d
    ):
        raise InputError(
            f"{file}: head hidden size {d} (config {config.hidden_size}) does not match the target's "
            f"{target.hidden_size} ({target.source}): this head was trained for another model"
        )
    if config.vocab_size != target.vocab_size:
        raise InputError(
            f"{file}: head vocabulary {config.vocab_size} does not match the target's {target.vocab_size} ({target.source})"
        )


def recorded_target(meta: dict[str, Any]) -> tuple[str | None, str | None]:
    """(target name, target source) a head's meta records: training writes `target: {name, source, ...}`;
    exports may hold a plain name plus `target_source`."""
    target = meta.get("target")
    if isinstance(target, dict):
        return target.get("name"), target.get("source")
    return target, meta.get("target_source")


def other_target(meta: dict[str, Any], target) -> str | None:
    """Why a head's meta says it was trained for another target than `target` (the weight files that
    differ, or the weight fingerprint of the embedding and LM head: a fine-tune of the same shape, or its
    name), or None."""
    trained_for, _ = recorded_target(meta)
    block = meta.get("target") if isinstance(meta.get("target"), dict) else {}
    files = block.get("weight_files") or meta.get("target_weight_files")
    if isinstance(files, dict) and files != target.weight_files:
        differ = differing_files(files, target.weight_files)
        return (
            f"it was trained for a target with other weights (weight files that differ: {differ}): a "
            "fine-tune or another revision; expect a lower acceptance; the output is still the target's own"
        )
    recorded = block.get("weights") or meta.get("target_weights")
    if recorded and recorded != target.weight_fingerprint:
        return (
            f"it was trained for a target with other weights (embedding / LM head fingerprint {recorded}, "
            f"this target's {target.weight_fingerprint}): expect a lower acceptance; the output is still "
            "the target's own"
        )
    if trained_for and trained_for != target.cfg.name:
        return f"it was trained for {trained_for!r}, not {target.cfg.name!r}"
    return None


def differing_files(recorded: dict[str, str], found: dict[str, str]) -> str:
    """`name (sha256 recorded ab12cd34..., here ef56...)` for each file whose sha256 differs, is only
    recorded or is only here."""
    short = lambda sha: f"{sha[:12]}..." if sha else "none"  # noqa: E731
    return "; ".join(
        f"{name} (sha256 recorded {short(recorded.get(name))}, here {short(found.get(name))})"
        for name in sorted(set(recorded) | set(found))
        if recorded.get(name) != found.get(name)
    )


def warn_other_target(path: Path, meta: dict[str, Any], target) -> None:
    """Log loudly when a head is loaded for another target than the one it was trained for."""
    why = other_target(meta, target)
    if why:
        log.warning("draft head %s: %s", path, why)


def load_draft(
    path: str | Path, target, device: torch.device | str | None = None, mask_token_id: int | None = None
):
    """Load a draft head for `target` (a `Target`) from this project's checkpoint, any exported layout,
    or a reference head (pytorch_model.bin or model.safetensors + config.json): EAGLE-1/2 heads
    (`DraftHead`) and EAGLE-3 heads (`Eagle3Head`: the reference's, SpecForge's, speculators') and
    P-EAGLE heads (`PEagleHead`: this project's, speculators', SpecForge's, NeMo's; `mask_token_id` for
    a layout whose config.json records none) and DFlash heads (`DFlashHead`: this project's checkpoint,
    vLLM's and z-lab's layout, the speculators format: interop.dflash_layouts).

    The target's embedding (EAGLE-1/2: and LM head) is shared into the head; it is returned in eval mode
    on the target's device and dtype (or `device`).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"draft head {path}: not a directory")
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"draft head {path}: missing {CONFIG_NAME}")
    try:
        raw_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise InputError(f"{config_file}: not valid JSON ({err})") from err
    if head_model(raw_config) is DFlashHead:  # this project's, vLLM's (z-lab's) or the speculators layout
        from eagle_train.interop.dflash_layouts import load_dflash

        head, meta = load_dflash(path, raw_config, target)
        warn_other_target(path, meta, target)
        return head.to(device or target.device, target.dtype).eval()
    check_head_files(path)
    raw_state, file = read_weights(path)
    from eagle_train.interop.eagle3_layouts import flat_config, is_eagle3, load_eagle3

    if is_eagle3(raw_config, raw_state):
        check_finite(raw_state, file)
        llama = head_config(flat_config(raw_config))
        head = load_eagle3(raw_config, raw_state, file, target, llama, mask_token_id)
        warn_other_target(path, raw_config.get("eagle_train", {}), target)
        return head.to(device or target.device, target.dtype).eval()
    state = head_state(raw_state, file)
    config = head_config(raw_config, state)
    check_matches_target(config, state, target, file)
    check_finite(state, file)
    warn_other_target(path, raw_config.get("eagle_train", {}), target)
    head = DraftHead(config, fc_bias="fc.bias" in state, target=target)
    try:
        missing, unexpected = head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    except RuntimeError as err:  # shapes that do not fit the config
        raise InputError(f"{file}: tensors do not match {config_file}: {err}") from err
    missing = [k for k in missing if k.startswith(("fc.", "layers."))]
    if missing or unexpected:
        raise InputError(f"{file}: missing tensors {missing}, unexpected tensors {unexpected}")
    return head.to(device or target.device, target.dtype).eval()
