"""EAGLE-3 (and 3.1) heads: fc over three target layers, the fusion midlayer and N-1 plain layers, their
own LM head over a reduced draft vocabulary (modeling.eagle3.Eagle3Head), trained with the training-time
test (Eagle3Objective).

The draft vocabulary (`t2d`, `d2t`) is the `draft.vocab_size` most frequent assistant tokens of the
TRAINING split (held-out sequences excluded), counted from token ids alone (no hidden state is read); its
LM head starts from the target's rows of those tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eagle_train.heads.kind import HeadKind
from eagle_train.modeling.draft_vocab import count_assistant_tokens, default_draft_vocab_size, top_tokens
from eagle_train.modeling.eagle3 import Eagle3Head
from eagle_train.runtime.errors import InputError
from eagle_train.training.data import Source
from eagle_train.training.objective import Eagle3Objective


def draft_vocabulary(source: Source, indices: Sequence[int], vocab_size: int, size: int) -> torch.Tensor:
    """t2d [vocab] of the `size` most frequent assistant tokens of the samples `indices`."""
    counts = count_assistant_tokens((source.tokens(i) for i in indices), vocab_size)
    return top_tokens(counts, size)


def draft_vocab_size(cfg, target) -> int:
    """draft.vocab_size, or the default for the target's vocabulary; never more than it."""
    size = cfg.vocab_size or default_draft_vocab_size(target.vocab_size)
    if size > target.vocab_size:
        raise InputError(f"draft.vocab_size={size}: more than the target's {target.vocab_size} tokens")
    return size


def set_vocabulary(head, source: Source, train: Sequence[int], target, size: int):
    """`head` with its draft vocabulary counted on the training samples, its LM head from the target's."""
    head.set_vocabulary(draft_vocabulary(source, train, target.vocab_size, size), target.lm_head.weight)
    return head


def fresh(cfg, target, source, train) -> Eagle3Head:
    size = draft_vocab_size(cfg, target)
    head = Eagle3Head.from_target(
        target.config, target.aux_layers, size, cfg.fc_norm, cfg.norm_output, target=target,
        num_layers=cfg.num_layers, intermediate_size=cfg.intermediate_size,
    )  # fmt: skip
    return set_vocabulary(head, source, train, target, size)


def check_aux_layers(head, cfg, target, source) -> None:
    """A loaded head reads the layers the target resolves to, or is refused naming both."""
    if head.aux_layers != target.aux_layers:
        raise InputError(
            f"draft.path {cfg.path} reads target layers {head.aux_layers}, target.aux_layers "
            f"resolves to {target.aux_layers}: set target.aux_layers={head.aux_layers}"
        )


KIND = HeadKind(
    model=Eagle3Head,
    title="EAGLE-3",
    fresh=fresh,
    objective=Eagle3Objective,
    check_loaded=check_aux_layers,
)
