"""What a kind of draft head is, in one object (`HeadKind`); the registry of kinds is the package's
`KINDS` (eagle_train.heads)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eagle_train.config.draft import DraftConfig
from eagle_train.config.train import LossConfig
from eagle_train.modeling.logit_transform import LogitTransform
from eagle_train.modeling.target import TargetParts
from eagle_train.training.data import Source
from eagle_train.training.objective import Objective


def _no_check(head, cfg: DraftConfig, target: TargetParts, source: Source) -> None:
    return None


def _aux_layers(cfg: DraftConfig, target: TargetParts) -> list[int]:
    return target.aux_layers


@dataclass(frozen=True)
class HeadKind:
    """One kind of draft head: its model class, whose class attributes are the contract the decoder,
    the metrics and the checkpoints read (`reads_aux`: fed the target's auxiliary layers, so the
    feature store holds them; `own_lm_head`: its own LM head over a draft vocabulary;
    `drafts_in_catch_up`: a round's drafts come from its catch-up forward; `drafts_block`: they come
    from one forward of a block over its cached context (DFlash); `recognise`: whether a
    config.json is one of its checkpoints), and what training and export ask of it:

    fresh(cfg, target, source, train)  a new head for draft settings `cfg` (torch seeded by the caller),
                                       `train` the training samples of `source` (a draft vocabulary is
                                       counted on them)
    objective(loss, lm_weight, transform, head)  its training objective (`lm_weight`: the target's
                                       frozen LM head, EAGLE-1: the head's own copy of it)
    check_loaded(head, cfg, target, source)  InputError when a head loaded from draft.path cannot be
                                       trained on this target and data
    on_shared_weights(head)            a fresh head's last step once it holds the target's frozen parts
    ships_embedding                    its exports carry the target's input embedding (`hold_embedding`
                                       puts it into the head, after its checks)
    feature_layers(cfg, target)        the target layers (the feature store's `aux_layers`: inputs of
                                       layers) a head of draft settings `cfg` reads; default: EAGLE-3's
                                       `target.aux_layers` when it reads aux features, else None
    chain_metrics                      held-out chains drafted as the decoder drafts them
                                       (training.metrics); DFlash: its objective's per-slot figures only
    """

    model: type[nn.Module]
    title: str  # what the user reads: "EAGLE-1/2", "EAGLE-3", "P-EAGLE"
    fresh: Callable[[DraftConfig, TargetParts, Source, Sequence[int]], nn.Module]
    objective: Callable[[LossConfig, torch.Tensor, LogitTransform, nn.Module], Objective]
    check_loaded: Callable[[nn.Module, DraftConfig, TargetParts, Source], None] = _no_check
    on_shared_weights: Callable[[nn.Module], None] | None = None
    ships_embedding: bool = False
    hold_embedding: Callable[[nn.Module, torch.Tensor, dict, str | Path, Path], None] | None = None
    feature_layers: Callable[[DraftConfig, TargetParts], list[int] | None] = _aux_layers
    chain_metrics: bool = True

    @property
    def name(self) -> str:
        return self.model.kind

    def layers_read(self, cfg: DraftConfig, target: TargetParts) -> list[int] | None:
        """The aux layers the feature store must hold for a head of `cfg`, or None (the last hidden state)."""
        return self.feature_layers(cfg, target) if self.reads_aux else None

    @property
    def reads_aux(self) -> bool:
        return bool(self.model.reads_aux)

    @property
    def own_lm_head(self) -> bool:
        return bool(self.model.own_lm_head)

    @property
    def drafts_in_catch_up(self) -> bool:
        return bool(self.model.drafts_in_catch_up)
