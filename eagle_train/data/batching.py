"""Length-bucketed batching: samples of similar length share a batch, so little compute goes to padding.

Used by extraction (the frozen target's forward) and training (the draft head). Pure Python over a
list of lengths; the random generator is passed in, so the order is reproducible and resumable.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def bucket_batches(
    lengths: Sequence[int],
    max_tokens: int,
    max_batch_size: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    jitter: float = 0.0,
) -> list[list[int]]:
    """Group sample indices into batches of similar length.

    Indices are sorted by length and cut greedily so that a batch's padded size
    (batch_size * longest length) stays within `max_tokens` and its size within `max_batch_size`.
    A sample longer than `max_tokens` gets a batch of its own. With `shuffle`, the order of the
    batches is shuffled with `random.Random(seed)`, and with `jitter` > 0 their content too: samples
    are sorted by length * (1 + U(0, jitter)), so samples within about that share of each other's
    length meet in other batches for another seed (a training epoch), at a little more padding.
    """
    rng = random.Random(seed)
    if shuffle and jitter > 0:
        keys = [length * (1.0 + jitter * rng.random()) for length in lengths]
        order = sorted(range(len(lengths)), key=lambda i: (keys[i], i))
    else:
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches = cut_batches(order, lengths, max_tokens, max_batch_size)
    if shuffle:
        rng.shuffle(batches)
    return batches


def cut_batches(
    order: Sequence[int], lengths: Sequence[int], max_tokens: int, max_batch_size: int | None = None
) -> list[list[int]]:
    """Cut `order` (sample indices) greedily, keeping its order, into batches whose padded size
    (batch_size * longest length) stays within `max_tokens` and size within `max_batch_size`."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        too_many = max_batch_size is not None and len(current) >= max_batch_size
        if current and (new_longest * (len(current) + 1) > max_tokens or too_many):
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


def padding_fraction(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Share of the padded batch area that is padding (0 = none)."""
    total = sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
    real = sum(lengths[i] for b in batches for i in b)
    return 0.0 if total == 0 else 1.0 - real / total
