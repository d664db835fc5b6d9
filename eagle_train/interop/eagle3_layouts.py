"""EAGLE-3 heads in other projects' layouts: the export writers and the importer (`interop.export_head`
and `interop.load_draft` hand EAGLE-3 heads to this module).

What each consumer loads (read from their loaders; the EAGLE notes' "EAGLE-3" section):
- vLLM (`model_executor/models/llama_eagle3.py`, `method: eagle3`): config `architectures:
  ["LlamaForCausalLMEagle3"]` (or Eagle3LlamaForCausalLM), `draft_vocab_size`, the aux layer ids at the
  top level or in `eagle_config`, `fc_norm`, `norm_output`; weights `midlayer.*` (mapped to layers.0),
  fc WITHOUT bias, `norm`, `lm_head` [draft_vocab, d], `d2t` (its draft-to-target map; a head over the
  full vocabulary has none, so none is written), `t2d` skipped, the embedding shared from the target.
- SGLang (`srt/models/llama_eagle3.py`): the same keys and `eagle_config`; `hot_token_id = d2t + arange`;
  no fc_norm, no norm_output (their weights would be skipped without a word): refused.
- the EAGLE reference (`eagle/model/cnets.py`, `ea_model.py`): `pytorch_model.bin` loaded with
  strict=False, so a missing tensor stays random: it gets the target's embedding too (the reference
  skips loading the base model's embedding when config.json has `target_hidden_size`, which it then
  does not get when the widths agree); no EAGLE-3.1 switches.
- speculators (vLLM-native packaging, auto-detected by `speculators_config`): no top-level model_type,
  `speculators_model_type: eagle3`, the Llama shape in `transformer_layer_config`, `norm_before_residual:
  false` (its default is true: the residual after hidden_norm, another head), the verifier (target) and
  K; the speculators library's own key names `layers.0.*`.
- multi-layer heads (layers 1..N-1 after the midlayer): vLLM loads `layers.i.*` as plain pre-norm Llama
  layers; SGLang's `additional_layers` drop the first layer's residual (another function) and the
  reference has one layer: format=sglang and format=eagle refuse them.
- P-EAGLE heads (vLLM `parallel_drafting: true`): `mask_hidden` [1, 1, 3 d_t], the whole embedding with
  the learned mask row in place (`embed_tokens.weight`: without it vLLM uses the target's row), the mask
  token as `mask_token_id` and `pard_token` (vLLM reads either), `speculators_model_type: peagle` in the
  speculators format (vLLM maps it to eagle3 + parallel drafting, `mask_token_id` -> `pard_token`).
The importer reads all of these plus SpecForge's (`PEagleDraftModel`: `layers.0.*` ... , no mask token in
its config.json: the caller must name it) and NeMo AutoModel's (`model.` prefixes) published heads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from eagle_train.config.target import reference_aux_layers, resolve_aux_layers
from eagle_train.interop.layouts import files_writer
from eagle_train.modeling.draft import frozen_modules
from eagle_train.modeling.draft_vocab import t2d_from_d2t
from eagle_train.modeling.eagle3 import (
    EAGLE3_FIELDS,
    Eagle3Head,
    eagle3_config_fields,
    eagle3_from_config,
    recorded_aux_layers,
)
from eagle_train.modeling.head_checkpoint import CONFIG_NAME
from eagle_train.modeling.peagle import (
    PEAGLE_FIELDS,
    check_placeholder_tensors,
    check_placeholder_token,
    is_peagle_config,
    peagle_config_fields,
    peagle_from_config,
    recorded_mask_token,
    target_special_ids,
)
from eagle_train.runtime.errors import InputError

log = logging.getLogger(__name__)

# the speculators library's classes; vLLM maps the type itself
SPECULATORS_ARCHITECTURES = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator"}


def serving_state(head: Eagle3Head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors for an export: floats in `dtype`, d2t int64, t2d bool; no d2t/t2d for a head
    over the whole target vocabulary (vLLM then builds no map and would refuse one)."""
    state = {k: v.detach().to("cpu").clone() for k, v in head.trainable_state_dict().items()}
    if head.draft_vocab_size == head.config.vocab_size:
        state.pop("d2t")
        state.pop("t2d")
    if head.kind == "peagle":  # the learned row goes out inside the whole embedding
        state.pop("mask_embedding")
        state["embed_tokens.weight"] = head.serving_embedding().to("cpu")
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sorted(state.items())}


def check_exportable(head: Eagle3Head, fmt: str) -> None:
    """Refuse what a layout's loader cannot hold rather than write a head that loads wrong."""
    if fmt in ("sglang", "eagle") and (head.kind == "peagle" or head.config.num_hidden_layers > 1):
        what = "a P-EAGLE head" if head.kind == "peagle" else f"{head.config.num_hidden_layers} layers"
        raise InputError(
            f"format={fmt}: {what}: {'SGLang' if fmt == 'sglang' else 'the EAGLE reference'} cannot run it "
            "as trained (SGLang's extra EAGLE-3 layers drop the first layer's residual; no parallel "
            "drafting); export with format=vllm or format=speculators"
        )
    if fmt in ("sglang", "eagle") and (head.fc_norm_enabled or head.norm_output):
        raise InputError(
            f"format={fmt}: {'SGLang' if fmt == 'sglang' else 'the EAGLE reference'} has no fc_norm / "
            "norm_output (EAGLE-3.1); it would skip their weights silently. Export with format=vllm or "
            "format=speculators, or train without them"
        )
    if fmt == "eagle" and head.config.head_dim * head.config.num_attention_heads != head.config.hidden_size:
        raise InputError(
            "format=eagle: the EAGLE reference needs head_dim * num_attention_heads == hidden_size"
        )


def export_config(head: Eagle3Head, fmt: str, llama: dict[str, Any], info: dict[str, Any], k: int) -> dict:
    """config.json of an EAGLE-3 export (`llama`: the portable Llama fields, as for EAGLE-1 heads)."""
    fields = peagle_config_fields(head) if head.kind == "peagle" else eagle3_config_fields(head)
    if fmt == "eagle":
        for key in ("target_hidden_size", "fc_norm", "norm_output"):  # see the module docstring
            fields.pop(key)
    if fmt != "speculators":
        return {**llama, **fields, "eagle_train": info}
    layers = int(head.config.num_hidden_layers)
    layer = {
        **llama,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": layers,
    }
    ids = fields["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    mask = {"mask_token_id": head.mask_token_id} if head.kind == "peagle" else {}
    return {
        "architectures": [SPECULATORS_ARCHITECTURES[head.kind]],
        "speculators_model_type": head.kind,
        **mask,
        "transformer_layer_config": layer,
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": head.target_hidden_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": head.fc_norm_enabled,
        "norm_output": head.norm_output,
        "eagle_aux_hidden_state_layer_ids": ids,
        "tie_word_embeddings": False,
        "torch_dtype": llama["torch_dtype"],
        "speculators_config": speculators_block(head.kind, k, info),
        "eagle_train": info,
    }


def speculators_block(algorithm: str, k: int, info: dict[str, Any]) -> dict[str, Any]:
    """The speculators format's `speculators_config`: the algorithm, K greedy drafts, the verifier (the
    target's id and architectures from the export's `eagle_train` block `info`)."""
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": k,
                "accept_tolerance": 0.0,
                "verifier_accept_k": 1,
            }
        ],
        "verifier": {
            "name_or_path": info.get("target_source") or info.get("target"),
            "architectures": list(info.get("target_architectures") or []),
        },
    }


def eagle3_writer(
    head: Eagle3Head,
    fmt: str,
    llama: dict[str, Any],
    info: dict[str, Any],
    dtype: torch.dtype,
    embed_tokens: torch.Tensor | None,
    speculative_tokens: int,
) -> Callable[[Path], None]:
    """`write(dir)`: writes an EAGLE-3 head's files in layout `fmt` (vllm | sglang | eagle | speculators)
    into a directory; `interop.export_head` publishes them atomically."""
    check_exportable(head, fmt)
    state = serving_state(head, dtype)
    if fmt == "speculators":
        state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
    if fmt == "eagle":
        if embed_tokens is None:
            raise InputError("format=eagle: the reference needs the target's embedding in the file; pass it")
    if embed_tokens is not None and head.kind != "peagle":  # P-EAGLE: its own (the learned row in place)
        if tuple(embed_tokens.shape) != (head.config.vocab_size, head.config.hidden_size):
            raise InputError(f"embedding shape {tuple(embed_tokens.shape)} does not match the head's config")
        state["embed_tokens.weight"] = embed_tokens.detach().to("cpu", dtype).contiguous()
    config = export_config(head, fmt, llama, {**info, "type": head.kind}, speculative_tokens)
    return files_writer(state, config, bin_file=fmt == "eagle")


# ---------------------------------------------------------------------------------------------- import


def is_eagle3(raw_config: dict[str, Any], raw_state: dict[str, torch.Tensor]) -> bool:
    """An EAGLE-3 (or P-EAGLE) head: its config says so, or its tensors are EAGLE-3's (midlayer, d2t,
    t2d, P-EAGLE's mask_hidden)."""
    archs = raw_config.get("architectures") or []
    if raw_config.get("speculators_model_type") == "eagle3" or any("Eagle3" in a for a in archs):
        return True
    keys = [k.removeprefix("model.") for k in raw_state]
    named = any(k.startswith("midlayer.") or k in ("d2t", "t2d", "mask_hidden") for k in keys)
    return named or is_peagle_config(raw_config)


def flat_config(raw: dict[str, Any]) -> dict[str, Any]:
    """One flat config: a speculators config's Llama shape (`transformer_layer_config`) with its EAGLE-3
    fields on top; other layouts are flat already."""
    if "transformer_layer_config" not in raw:
        return raw
    fields = (*EAGLE3_FIELDS, *PEAGLE_FIELDS)
    return {**raw["transformer_layer_config"], **{k: raw[k] for k in fields if k in raw}}


def eagle3_state(raw: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    """The head's tensors under this project's keys: `model.` stripped, speculators' and SpecForge's
    `layers.0.` -> `midlayer.` (layers 1..N-1 keep their names); the embedding kept apart (see
    `load_eagle3`)."""
    state = {}
    own = ("fc.", "fc_norm.", "midlayer.", "layers.", "norm.", "lm_head.", "embed_tokens.", "d2t", "t2d")
    for key, value in raw.items():
        key = key.removeprefix("model.")
        key = "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if not key.startswith(own) and key not in ("mask_hidden", "mask_embedding"):
            raise InputError(f"{file}: unexpected tensor {key!r} for an EAGLE-3 head")
        state[key] = value
    for key in ("fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight"):
        if key not in state:
            raise InputError(f"{file}: no {key}: not a complete EAGLE-3 head")
    return state


def check_matches(head: Eagle3Head, state: dict[str, torch.Tensor], target, file: Path) -> None:
    """A head for another target: a clear error, not a shape error deep in a forward."""
    fc_in = int(state["fc.weight"].shape[1])
    if head.config.hidden_size != target.hidden_size or fc_in != 3 * target.hidden_size:
        raise InputError(
            f"{file}: EAGLE-3 head of hidden size {head.config.hidden_size} fusing {fc_in} features does not "
            f"match the target's {target.hidden_size} ({target.source}): trained for another model"
        )
    if head.config.vocab_size != target.vocab_size:
        raise InputError(
            f"{file}: head vocabulary {head.config.vocab_size} does not match the target's {target.vocab_size}"
        )


def load_eagle3(
    raw_config: dict[str, Any],
    raw_state: dict[str, torch.Tensor],
    file: Path,
    target,
    llama: LlamaConfig,
    mask_token_id: int | None = None,
) -> Eagle3Head:
    """An EAGLE-3 (or P-EAGLE) head for `target` from any layout (this project's, vLLM / SGLang /
    reference exports, SpecForge's, speculators', NeMo's). The aux layer ids are the recorded ones, else
    the reference's default for the target's depth (what vLLM and SGLang assume); d2t / t2d absent = the
    whole vocabulary; the layer count is the weights'. A P-EAGLE head's mask token is `mask_token_id`
    (the caller's) or the one its config.json records (`load_mask_token`)."""
    raw = flat_config(raw_config)
    state = eagle3_state(raw_state, file)
    recorded = recorded_aux_layers(raw)
    aux = resolve_aux_layers(recorded or reference_aux_layers(target.num_layers), target.num_layers)
    if recorded is None:
        log.warning("%s names no aux layers: using the reference's %s for this target", file, aux)
    llama.num_hidden_layers = 1 + max(
        (int(k.split(".")[1]) for k in state if k.startswith("layers.")), default=0
    )
    if "mask_hidden" in state or is_peagle_config(raw):
        mask = load_mask_token(raw, file, mask_token_id, target)
        head = peagle_from_config(llama, raw, aux, mask)
        check_placeholder_tensors(head, state, file)
    else:
        head = eagle3_from_config(llama, raw, aux)
    check_matches(head, state, target, file)
    embed = state.pop("embed_tokens.weight", None)
    if head.kind == "peagle" and "mask_embedding" not in state:  # an engine layout: the row in the embedding
        state["mask_embedding"] = (embed if embed is not None else target.embed_tokens.weight)[
            head.mask_token_id
        ]
    if "d2t" in state and "t2d" not in state:
        state["t2d"] = t2d_from_d2t(state["d2t"], target.vocab_size)
    if "d2t" not in state:
        if head.draft_vocab_size != target.vocab_size:
            raise InputError(f"{file}: a reduced draft vocabulary ({head.draft_vocab_size}) needs d2t")
        state["d2t"], state["t2d"] = head.d2t.clone(), torch.ones(target.vocab_size, dtype=torch.bool)
    try:
        missing, unexpected = head.load_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=False
        )
    except RuntimeError as err:  # shapes that do not fit the config
        raise InputError(f"{file}: tensors do not match its config.json: {err}") from err
    missing = [k for k in missing if k in head.trainable_state_dict()]
    if missing or unexpected:
        raise InputError(f"{file}: missing tensors {missing}, unexpected tensors {unexpected}")
    if embed is None:
        head.share_target_weights(target)
    else:  # shipped with the head: what vLLM and the reference use too (its own, never the target's)
        head.hold_frozen(frozen_modules(embed.float()))
    return head


def load_mask_token(raw: dict[str, Any], file: Path, given: int | None, target) -> int:
    """A P-EAGLE head's mask token: `given` (it must agree with a recorded one), else the one config.json
    records; either is checked against the target (`check_placeholder_token`: inside its vocabulary, none
    of its BOS / EOS / PAD / stop ids), naming the file and the key. SpecForge's exports record none, and
    no guess is safe (the head learned ONE token's row): an InputError asking for it."""
    special = target_special_ids(target)
    recorded = recorded_mask_token(raw, file.parent / CONFIG_NAME, target.vocab_size, special)
    if given is not None:
        given = check_placeholder_token(given, target.vocab_size, special, "draft.mask_token_id")
    if given is not None and recorded is not None and given != recorded:
        raise InputError(f"{file}: its config.json records mask token {recorded}, not the given {given}")
    if given is None and recorded is None:
        raise InputError(
            f"{file.parent / CONFIG_NAME}: mask_token_id: missing: a P-EAGLE head (mask_hidden) whose config.json "
            "names no mask token "
            "(SpecForge writes none): pass the id it was trained with (draft.type=peagle "
            "draft.mask_token_id=N, or `mask_token_id` in its config.json); a wrong id drafts garbage"
        )
    return given if given is not None else recorded
