"""DFlash heads: Qwen3-style layers that draft a block of B tokens in one forward, the target's context
(fc over the outputs of `draft.target_layer_ids`) injected as keys and values in every layer
(modeling.dflash.DFlashHead), trained on all blocks of a batch in one forward (DFlashObjective). Its mask
token is `draft.mask_token_id` or chosen as P-EAGLE's is (heads/peagle.choose_mask_token), never one the
data holds or the target emits. The built-in decoder drafts with it (`chain`); it is exported to vLLM's layout and the speculators format
(interop.dflash_layouts)."""

from __future__ import annotations

import logging

from eagle_train.config.target import dflash_aux_layers, resolve_dflash_layers
from eagle_train.heads.kind import HeadKind
from eagle_train.heads.peagle import check_mask_token, choose_mask_token, token_usage
from eagle_train.modeling.dflash import DFlashHead
from eagle_train.modeling.peagle import target_special_ids
from eagle_train.runtime.errors import InputError
from eagle_train.training.objective import DFlashObjective

log = logging.getLogger(__name__)


def target_layer_ids(cfg, target) -> list[int]:
    """draft.target_layer_ids checked against the target, or the published rule for draft.num_layers."""
    try:
        return resolve_dflash_layers(cfg.target_layer_ids, target.num_layers, cfg.num_layers)
    except ValueError as err:
        raise InputError(str(err)) from None


def feature_layers(cfg, target) -> list[int]:
    """The feature store's names (aux_layers: the input of layer i + 1) of the layers the head reads."""
    return dflash_aux_layers(target_layer_ids(cfg, target))


def fresh(cfg, target, source, train) -> DFlashHead:
    mask, why = choose_mask_token(
        target.tokenizer, target.vocab_size, target_special_ids(target),
        token_usage(source, target.vocab_size), cfg.mask_token_id,
    )  # fmt: skip
    log.info("DFlash mask token: %d (%s)", mask, why)
    return DFlashHead.from_target(
        target.config,
        target_layer_ids(cfg, target),
        cfg.block_size,
        mask,
        target=target,
        num_layers=cfg.num_layers,
        intermediate_size=cfg.intermediate_size,
    )


def check_loaded(head, cfg, target, source) -> None:
    """A loaded head reads the layers the settings resolve to, drafts blocks of draft.block_size, and its
    mask token is free in this target and data; else InputError naming both."""
    ids = target_layer_ids(cfg, target)
    if head.target_layer_ids != ids:
        raise InputError(
            f"draft.path {cfg.path} reads the outputs of target layers {head.target_layer_ids}, "
            f"draft.target_layer_ids resolves to {ids}: set draft.target_layer_ids={head.target_layer_ids}"
        )
    if head.block_size != cfg.block_size:
        raise InputError(
            f"draft.path {cfg.path} drafts blocks of {head.block_size}, draft.block_size={cfg.block_size}: "
            f"set draft.block_size={head.block_size}"
        )
    check_mask_token(head, cfg, target, source)


KIND = HeadKind(
    model=DFlashHead,
    title="DFlash",
    fresh=fresh,
    objective=DFlashObjective,
    check_loaded=check_loaded,
    feature_layers=feature_layers,
    chain_metrics=False,
)
