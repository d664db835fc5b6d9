"""Training data for the draft head: held-out split by id, batch plans, the loader and collation.

A *source* is any sequence of samples {"id", "input_ids" [L], "loss_mask" [L], "hidden" [L, d]?,
"aux" [L, 3d]?} with `lengths` and `ids` (the feature store: features in their stored dtype, fp8 with
"hidden_scale" / "aux_scale"; or tokenized conversations in online mode, where the frozen target
computes "hidden" and "aux" on the device); `tokens(i)` gives a sample's ids and loss mask alone.
Batches are lists of sample indices; an epoch's plan is a pure function of (lengths, seed, epoch), so a
run resumes from (epoch, cursor) alone.

The path of a micro-batch: `step_schedule` (the epoch plans, in the order the loop consumes them) is the
batch sampler of a `torch.utils.data.DataLoader`, whose workers read the samples and `pad_samples` them
(stored dtype, right padding) while the device computes; `head_batch` then moves the padded batch to the
device, decodes the features there (or runs the target there: online) and shifts it
(eagle_train.training.loss.shift_batch). Nothing is upcast on the host.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset

from eagle_train.data.batching import bucket_batches, cut_batches
from eagle_train.data.sharegpt import is_eval_id
from eagle_train.runtime.errors import UserError
from eagle_train.store.codec import decode
from eagle_train.training.loss import shift_batch

FEATURES = ("hidden", "aux")  # feature keys a sample may carry (each with an optional "<key>_scale")


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
    """Right-pad tensors [L_i, ...] along dim 0 to [batch, max L, ...] (any dtype, fp8 included)."""
    longest = max(t.shape[0] for t in tensors)
    out = torch.zeros((len(tensors), longest, *tensors[0].shape[1:]), dtype=tensors[0].dtype)
    if value:
        out.fill_(value)
    for row, t in enumerate(tensors):
        out[row, : t.shape[0]] = t
    return out


def pad_samples(samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Samples -> one right-padded batch on the host, features in their stored dtype (what a loader
    worker builds): input_ids [b, T] long, loss_mask [b, T] bool, lengths [b], and each feature present
    ("hidden" [b, T, d], fp8 scales "hidden_scale" [b, T, g], "aux" [b, T, 3d] ...)."""
    batch = {
        "input_ids": pad_stack([s["input_ids"].long() for s in samples]),
        "loss_mask": pad_stack([s["loss_mask"].bool() for s in samples]),
        "lengths": torch.tensor([s["input_ids"].shape[0] for s in samples]),
    }
    for name in FEATURES:
        for key in (name, f"{name}_scale"):
            if key in samples[0]:
                batch[key] = pad_stack([s[key] for s in samples])
    return batch


def head_batch(
    padded: dict[str, torch.Tensor],
    device: torch.device | str,
    dtype: torch.dtype,
    features_fn: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """A padded host batch -> the head's batch on `device` (eagle_train.training.loss.shift_batch),
    features in `dtype` (the head's parameter dtype: fp32 under DDP / autocast, bf16 under DeepSpeed bf16).

    Stored features are decoded on the device; online (`features_fn(ids [b, T], attention [b, T]) ->
    {"hidden" [b, T, d], "aux" [b, T, 3d] (EAGLE-3 only)}`, the frozen target) they are computed there
    and never leave it. Right padding needs no attention mask for the head: a causal head never attends
    from a real position to a later padded one, and padded positions carry loss_mask False. Returns
    input_ids [b, n], features [b, n, d] (EAGLE-3: [b, n, 3d]), target_hidden [b, n, d], target_ids
    [b, n], loss_mask [b, n], positions [b]."""
    moved = {k: v.to(device, non_blocking=True) for k, v in padded.items()}
    ids, lengths = moved["input_ids"], moved["lengths"]
    if features_fn is not None:
        attention = (torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]).long()
        states = {k: v.to(dtype) for k, v in features_fn(ids, attention).items()}  # [b, T, d | 3d]
    else:
        states = {
            name: decode(moved[name], moved.get(f"{name}_scale"), dtype) for name in FEATURES if name in moved
        }
    return shift_batch(ids, moved["loss_mask"], states["hidden"], lengths, states.get("aux"))


def collate(samples: Sequence[dict[str, Any]], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Samples with features -> the head's batch on the host (`head_batch` of `pad_samples`)."""
    return head_batch(pad_samples(samples), "cpu", dtype)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of the schedule: its optimizer step's place in the epoch plan (epoch, cursor),
    its rank among this process's micro-batches of that step (k of count) and its sample indices."""

    epoch: int
    cursor: int
    k: int
    count: int
    indices: tuple[int, ...]


def step_schedule(
    plan_of: Callable[[int], list[list[int]]],
    epoch: int,
    cursor: int,
    per_step: int,
    rank: int,
    world: int,
    steps: int,
) -> Iterator[MicroBatch]:
    """This process's micro-batches of the next `steps` optimizer steps from (epoch, cursor), in order.

    A step takes the next `per_step` micro-batches of the epoch's plan (`plan_of(epoch)`) and this
    process every `world`-th of them from `rank`; an epoch ends when fewer than `per_step` are left (its
    remainder dropped). The one home of this rule, so a resumed run gets the same batches in the same
    order from its (epoch, cursor)."""
    plan = plan_of(epoch)
    for _ in range(steps):
        if cursor + per_step > len(plan):
            epoch, cursor = epoch + 1, 0
            plan = plan_of(epoch)
            if len(plan) < per_step:
                raise RuntimeError(f"epoch {epoch}: {len(plan)} micro-batches < {per_step} per step")
        mine = plan[cursor : cursor + per_step][rank::world]
        for k, batch in enumerate(mine):
            yield MicroBatch(epoch, cursor, k, len(mine), tuple(batch))
        cursor += per_step


class PlanDataset(Dataset):
    """A source fetched one micro-batch at a time: the loader hands `__getitems__` a MicroBatch (the batch
    sampler's item) and gets (the MicroBatch, its padded batch) back."""

    def __init__(self, source: Source):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.source[i]

    def __getitems__(self, micro: MicroBatch) -> tuple[MicroBatch, dict[str, torch.Tensor] | UserError]:
        """(micro, its padded batch); a user error reading it (a damaged shard) comes back as the value, so
        the loop raises it as it is, not wrapped in a worker's traceback."""
        try:
            return micro, pad_samples([self.source[i] for i in micro.indices])
        except UserError as err:
            return micro, err


def _as_is(item):
    return item


def make_loader(
    source: Source, schedule: Iterator[MicroBatch], workers: int, prefetch: int, pin_memory: bool
) -> Iterator[tuple[MicroBatch, dict[str, torch.Tensor]]]:
    """(MicroBatch, padded host batch) in schedule order, read by `workers` processes (0: in this one),
    each keeping `prefetch` micro-batches ahead, pinned for an asynchronous copy when `pin_memory`. A user
    error met reading a micro-batch (eagle_train.runtime.errors) is raised here as it was raised there."""
    loader = DataLoader(
        PlanDataset(source),
        batch_sampler=_Sampler(schedule),
        collate_fn=_as_is,
        num_workers=workers,
        prefetch_factor=prefetch if workers else None,
        pin_memory=pin_memory,
    )
    for micro, padded in loader:
        if isinstance(padded, UserError):
            raise padded
        yield micro, padded


class _Sampler:
    """A batch sampler over a schedule (iterated once: the schedule already spans the run)."""

    def __init__(self, schedule: Iterator[MicroBatch]):
        self.schedule = schedule

    def __iter__(self) -> Iterator[MicroBatch]:
        return self.schedule
