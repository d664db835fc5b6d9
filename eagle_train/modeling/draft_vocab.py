"""EAGLE-3's reduced draft vocabulary: the most frequent assistant tokens of the training data.

`t2d[v]` (bool [vocab]): token v is kept. `d2t[i]` (int64 [draft_vocab]): the offset of draft token i,
whose target id is i + d2t[i] (the kept ids in ascending order): the checkpoint layout of the reference,
SpecForge, vLLM and SGLang. Pure torch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

REFERENCE_DRAFT_VOCAB = 32000  # the reference's draft_vocab_size


def default_draft_vocab_size(vocab_size: int) -> int:
    """min(32000, the target's vocabulary)."""
    return min(REFERENCE_DRAFT_VOCAB, vocab_size)


def count_assistant_tokens(
    sequences: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int
) -> torch.Tensor:
    """How often each token id occurs where the loss mask is on (the tokens a head learns to predict):
    int64 [vocab] over (input_ids [L], loss_mask [L]) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for input_ids, loss_mask in sequences:
        counts += torch.bincount(input_ids[loss_mask.bool()].long(), minlength=vocab_size)[:vocab_size]
    return counts


def top_tokens(counts: torch.Tensor, size: int) -> torch.Tensor:
    """t2d: the `size` most frequent tokens (ties and unseen tokens broken by the lower id)."""
    if not 0 < size <= counts.numel():
        raise ValueError(
            f"draft vocabulary of {size} tokens: must be 1..{counts.numel()} (target vocabulary)"
        )
    # stable sort by descending count keeps ascending ids within equal counts
    order = torch.sort(counts, descending=True, stable=True).indices[:size]
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[order] = True
    return t2d


def d2t_from_t2d(t2d: torch.Tensor) -> torch.Tensor:
    """d2t [draft_vocab]: kept ids (ascending) minus their draft index."""
    kept = torch.nonzero(t2d.bool()).flatten()
    return kept - torch.arange(kept.numel())


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft token [draft_vocab]: d2t + arange (SGLang's hot_token_id)."""
    return d2t + torch.arange(d2t.numel(), device=d2t.device)


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d [vocab] from d2t (for heads shipped without t2d, e.g. the reference's full-vocabulary ones)."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids(d2t.long())] = True
    return t2d
