"""Training data for the draft head: held-out split by id, batch plans and collation.

A *source* is any sequence of samples {"id", "input_ids" [L], "loss_mask" [L], "hidden" [L, d]?,
"aux" [L, 3d]?} with `lengths` and `ids` (the feature store, or tokenized conversations in online mode,
where the frozen target fills "hidden" and "aux" at collation); `tokens(i)` gives a sample's ids and
loss mask alone. Batches are lists of sample indices; an epoch's plan is
a pure function of (lengths, seed, epoch), so a run resumes from (epoch, cursor) alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from eagle_train.data.batching import bucket_batches, cut_batches
from eagle_train.data.sharegpt import is_eval_id
from eagle_train.loss import shift_sequence


class Source(Protocol):
    """What training reads: per-sample dicts plus their lengths and ids."""

    lengths: list[int]
    ids: list[str]

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, Any]: ...

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def split_by_id(
    ids: Sequence[str], lengths: Sequence[int], eval_fraction: float
) -> tuple[list[int], list[int]]:
    """(train, eval) sample indices, held out by id hash as the data stage does (stable across runs,
    processes, offline and online); sequences shorter than 3 tokens carry no trainable position."""
    train, held_out = [], []
    for i, (sample_id, length) in enumerate(zip(ids, lengths, strict=True)):
        if length < 3:
            continue
        (held_out if is_eval_id(sample_id, eval_fraction) else train).append(i)
    return train, held_out


def plan_epoch(
    indices: Sequence[int],
    lengths: Sequence[int],
    max_tokens: int,
    max_batch_size: int | None,
    bucket: bool,
    seed: int,
    jitter: float = 0.0,
) -> list[list[int]]:
    """One epoch's micro-batches (sample indices) under a padded-token budget.

    bucket: similar lengths together (eagle_train.data.batching), batch order shuffled; with `jitter`
    (a share of the length) the batches' content changes with the seed too, i.e. every epoch.
    Otherwise: samples shuffled, then cut greedily in that order under the same budget.
    """
    sub_lengths = [lengths[i] for i in indices]
    if bucket:
        local = bucket_batches(
            sub_lengths, max_tokens, max_batch_size, shuffle=True, seed=seed, jitter=jitter
        )
    else:
        order = list(range(len(indices)))
        random.Random(seed).shuffle(order)
        local = cut_batches(order, sub_lengths, max_tokens, max_batch_size)
    return [[indices[j] for j in batch] for batch in local]


def pad_stack(tensors: Sequence[torch.Tensor], value: float | int | bool = 0) -> torch.Tensor:
    """Right-pad tensors [L_i, ...] along dim 0 to [batch, max L, ...]."""
    longest = max(t.shape[0] for t in tensors)
    out = tensors[0].new_full((len(tensors), longest, *tensors[0].shape[1:]), value)
    for row, t in enumerate(tensors):
        out[row, : t.shape[0]] = t
    return out


def collate(
    samples: Sequence[dict[str, Any]], feature_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Shift every sequence (eagle_train.loss.shift_sequence) and right-pad to one batch.

    Right padding needs no attention mask: a causal head never attends from a real position to a
    later padded one, and padded positions carry loss_mask False.
    Returns input_ids [b, n], features [b, n, d] (EAGLE-3 samples with "aux": [b, n, 3d]),
    target_hidden [b, n, d], target_ids [b, n], loss_mask [b, n], positions [b] (real head positions per row).
    """
    shifted = [
        shift_sequence(
            s["input_ids"],
            s["loss_mask"],
            s["hidden"].to(feature_dtype),
            s["aux"].to(feature_dtype) if "aux" in s else None,
        )
        for s in samples
    ]
    batch = {key: pad_stack([s[key] for s in shifted]) for key in shifted[0]}
    batch["positions"] = torch.tensor([s["input_ids"].shape[0] for s in shifted])
    return batch


def online_collate(
    samples: Sequence[dict[str, Any]],
    features_fn: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Online mode: run the frozen target (`features_fn(ids [b, L], mask [b, L]) -> {"hidden" [b, L, d],
    "aux" [b, L, 3d] (EAGLE-3 only)}`) on the right-padded batch, then collate as if the features came
    from the store."""
    ids = pad_stack([s["input_ids"].long() for s in samples]).to(device)
    attention = pad_stack([torch.ones_like(s["input_ids"], dtype=torch.long) for s in samples]).to(device)
    states = {k: v.float().cpu() for k, v in features_fn(ids, attention).items()}  # [b, L, *]
    filled = [
        {**s, **{k: v[row, : s["input_ids"].shape[0]] for k, v in states.items()}}
        for row, s in enumerate(samples)
    ]
    return collate(filled)


def batch_to(
    batch: dict[str, torch.Tensor], device: torch.device | str, float_dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Move every tensor of a batch to `device`; floating ones to `float_dtype` if given (the head's
    parameter dtype: DeepSpeed bf16 keeps bf16 weights, DDP/autocast keeps fp32)."""
    return {
        k: v.to(device, dtype=float_dtype if float_dtype is not None and v.is_floating_point() else v.dtype)
        for k, v in batch.items()
    }
