"""The head a training run starts from: fresh (seeded) for the configured kind, or the one at draft.path.

What differs between kinds (the fresh head's vocabulary and mask token, the checks on a loaded one) is
the kind's (eagle_train.heads); this module is what every kind shares.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eagle_train.config.base import resolve_path
from eagle_train.config.draft import DraftConfig
from eagle_train.heads import head_kind
from eagle_train.interop.layouts import warn_other_target
from eagle_train.modeling.head_checkpoint import load_head
from eagle_train.modeling.target import TargetParts
from eagle_train.runtime.errors import InputError
from eagle_train.training.data import Source


def fresh_head(cfg: DraftConfig, target: TargetParts, source: Source, train: Sequence[int], seed: int):
    """A new head of kind `cfg.type` (weights seeded by `seed`)."""
    torch.manual_seed(seed)
    return head_kind(cfg.type).fresh(cfg, target, source, train)


def build_head(
    cfg: DraftConfig,
    target: TargetParts,
    source: Source,
    train: Sequence[int],
    seed: int,
    frozen_dtype: torch.dtype = torch.float32,
):
    """A fresh head or the one at draft.path (its type and vocabulary kept), sharing the target's frozen
    embedding (EAGLE-1: and LM head, with its output processing).

    The trained weights are float32 (mixed precision keeps fp32 masters); the frozen vocabulary-sized
    matrices are held once, outside the head's state (modeling.draft.FrozenParts), in the working dtype
    (`frozen_dtype`: bf16 under bf16 mixed precision; no copy when the target's already are): at a 128k
    vocabulary an fp32 copy of each costs 2.1 GB per process."""
    if cfg.path:
        head, meta = load_head(resolve_path(cfg.path), target=target)
        if head.kind != cfg.type:
            raise InputError(f"draft.path {cfg.path} is an {head.kind} head, but draft.type={cfg.type}")
        head_kind(head).check_loaded(head, cfg, target, source)
        warn_other_target(resolve_path(cfg.path), meta, target)  # initial weights for another target
    else:
        head = fresh_head(cfg, target, source, train, seed)
    for module in head.children():  # the registered (trained) modules; the frozen parts are not among them
        module.float()
    head.share_target_weights(target, frozen_dtype)
    kind = head_kind(head)
    if kind.on_shared_weights is not None and not cfg.path:
        kind.on_shared_weights(head)
    return head
