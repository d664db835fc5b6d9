"""The head a training run starts from: fresh (seeded) for the configured type, or the one at draft.path.

An EAGLE-3 head's draft vocabulary (`t2d`, `d2t`) is the `draft.vocab_size` most frequent assistant
tokens of the TRAINING split (held-out sequences excluded), counted from token ids alone (no hidden
state is read); its LM head starts from the target's rows of those tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eagle_train.config.base import resolve_path
from eagle_train.config.draft import DraftConfig
from eagle_train.interop.layouts import warn_other_target
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.draft_vocab import count_assistant_tokens, default_draft_vocab_size, top_tokens
from eagle_train.modeling.eagle3 import Eagle3Head
from eagle_train.modeling.head_checkpoint import load_head
from eagle_train.modeling.target import TargetParts
from eagle_train.training.data import Source


def draft_vocabulary(source: Source, indices: Sequence[int], vocab_size: int, size: int) -> torch.Tensor:
    """t2d [vocab] of the `size` most frequent assistant tokens of the samples `indices`."""
    counts = count_assistant_tokens((source.tokens(i) for i in indices), vocab_size)
    return top_tokens(counts, size)


def fresh_head(cfg: DraftConfig, target: TargetParts, source: Source, train: Sequence[int], seed: int):
    """A new head of type `cfg.type` (weights seeded by `seed`)."""
    torch.manual_seed(seed)
    if cfg.type == "eagle1":
        return DraftHead.from_target(target.config, cfg.num_layers, cfg.has_fc_bias, target=target)
    size = cfg.vocab_size or default_draft_vocab_size(target.vocab_size)
    head = Eagle3Head.from_target(
        target.config, target.aux_layers, size, cfg.fc_norm, cfg.norm_output, target=target
    )
    head.set_vocabulary(draft_vocabulary(source, train, target.vocab_size, size), target.lm_head.weight)
    return head


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
            raise ValueError(f"draft.path {cfg.path} is an {head.kind} head, but draft.type={cfg.type}")
        if head.kind == "eagle3" and head.aux_layers != target.aux_layers:
            raise ValueError(
                f"draft.path {cfg.path} reads target layers {head.aux_layers}, target.aux_layers "
                f"resolves to {target.aux_layers}: set target.aux_layers={head.aux_layers}"
            )
        warn_other_target(resolve_path(cfg.path), meta, target)  # initial weights for another target
    else:
        head = fresh_head(cfg, target, source, train, seed)
    for module in head.children():  # the registered (trained) modules; the frozen parts are not among them
        module.float()
    head.share_target_weights(target, frozen_dtype)
    return head
