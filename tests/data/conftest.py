"""Helpers shared by the data tests."""

from __future__ import annotations


def masked_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded text of each contiguous run of masked tokens."""
    runs, current = [], []
    for token, m in zip(ids + [None], mask + [0], strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs
