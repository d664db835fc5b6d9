"""A preallocated key/value cache shared by the target and the draft head at decode time.

One buffer `kv` `[2, layers, batch, kv_heads, capacity, head_dim]` (keys = kv[0], values = kv[1]),
allocated once per generation; when values are narrower than keys (MLA: DeepSeek-V3's values are
`v_head_dim` wide, its keys `qk_nope_head_dim + qk_rope_head_dim`) each is a view of its own width. `seq_len` is the number of committed slots. A forward writes its `q` new entries at
`[seq_len, seq_len + q)` in every layer (`update`) and attends over `[0, seq_len + q)`; the caller then
commits them (`advance`), drops them (`crop`) or keeps a subset (`compact`, used after tree
verification to keep the accepted path). Nothing is allocated per step.

Slots are storage order, not positions: a tree node's key is rotated with its own position
(prefix length + depth) when it is written, so moving an accepted node to the next free slot keeps it
valid. Pure torch: the Hugging Face adapter lives in `modeling/target.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionShape:
    """Query heads, key/value heads and the width of one head of a Llama-style attention."""

    heads: int
    kv_heads: int
    head_dim: int


def attention_shape(config: Any) -> AttentionShape:
    """The attention shape of a Hugging Face config (the object or its `to_dict()`): `head_dim` defaults
    to hidden_size // heads and the key/value heads to the query heads, as transformers does. The one
    home of that rule (caches, the draft head, imported heads)."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    heads = int(get("num_attention_heads"))
    return AttentionShape(
        heads=heads,
        kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or int(get("hidden_size")) // heads),
    )


class StaticKVCache:
    """Preallocated per-layer keys/values with a committed length `seq_len` (batch size is fixed)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        value_dim: int | None = None,
    ):
        # one buffer for keys and values: a compaction is one gather, a fused writer one copy (`update_kv`)
        value_dim = head_dim if value_dim is None else value_dim
        width = max(head_dim, value_dim)
        self.kv = torch.zeros(
            (2, num_layers, batch_size, num_kv_heads, capacity, width), dtype=dtype, device=device
        )
        # [layers, batch, kv_heads, capacity, head_dim / value_dim]
        self.keys, self.values = self.kv[0, ..., :head_dim], self.kv[1, ..., :value_dim]
        self.equal_widths = head_dim == value_dim
        self.capacity = capacity
        self.seq_len = 0
        # per-layer views: `update` runs once per layer per forward, and narrow() on a ready view is
        # cheaper than indexing the 6-D buffer each time
        self._layer_keys = [self.keys[i] for i in range(num_layers)]  # [batch, kv_heads, capacity, head_dim]
        self._layer_values = [self.values[i] for i in range(num_layers)]
        self._layer_kv = [
            self.kv[:, i] for i in range(num_layers)
        ]  # [2, batch, kv_heads, capacity, head_dim]

    def update(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys/values [batch, kv_heads, q, head_dim] after the committed slots of
        `layer_idx` and return the layer's keys/values so far [batch, kv_heads, seq_len + q, head_dim]."""
        start, q = self.seq_len, key.shape[2]
        if start + q > self.capacity:
            raise ValueError(f"KV cache overflow: {start + q} slots needed, capacity {self.capacity}")
        keys, values = self._layer_keys[layer_idx], self._layer_values[layer_idx]
        keys.narrow(2, start, q).copy_(key)
        values.narrow(2, start, q).copy_(value)
        return keys.narrow(2, 0, start + q), values.narrow(2, 0, start + q)

    def update_kv(self, layer_idx: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` for keys and values stacked as kv [2, batch, kv_heads, q, head_dim] (may be a strided
        view): one copy instead of two. Keys and values of one width only."""
        if not self.equal_widths:
            raise ValueError("update_kv: keys and values of this cache have different widths; use update")
        start, q = self.seq_len, kv.shape[3]
        if start + q > self.capacity:
            raise ValueError(f"KV cache overflow: {start + q} slots needed, capacity {self.capacity}")
        self._layer_kv[layer_idx].narrow(3, start, q).copy_(kv)
        return self._layer_keys[layer_idx].narrow(2, 0, start + q), self._layer_values[layer_idx].narrow(
            2, 0, start + q
        )

    def advance(self, num_tokens: int) -> None:
        """Commit the `num_tokens` entries written by the last forward."""
        if self.seq_len + num_tokens > self.capacity:
            raise ValueError(f"KV cache overflow: {self.seq_len + num_tokens} > capacity {self.capacity}")
        self.seq_len += num_tokens

    def crop(self, seq_len: int) -> None:
        """Forget every slot from `seq_len` on."""
        if not 0 <= seq_len <= self.capacity:
            raise ValueError(f"crop length {seq_len} outside [0, {self.capacity}]")
        self.seq_len = seq_len

    def compact(self, base: int, keep: torch.Tensor) -> None:
        """Keep the slots `base + keep` (ascending offsets, e.g. an accepted tree path) as slots
        `base, base + 1, ...` and make them the committed end of the cache."""
        n = int(keep.numel())
        # Gather first (index_select copies), so overlapping source/destination slots are safe.
        gathered = self.kv.narrow(4, base, self.capacity - base).index_select(4, keep.to(self.kv.device))
        self.kv[:, :, :, :, base : base + n] = gathered
        self.seq_len = base + n

    def reset(self) -> None:
        """Empty the cache (the buffers are kept)."""
        self.seq_len = 0
