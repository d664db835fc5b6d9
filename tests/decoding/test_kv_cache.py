"""The preallocated KV cache: write after the committed slots, commit, crop, compact."""

from __future__ import annotations

import pytest
import torch

from eagle_train.decoding.kv_cache import StaticKVCache


def entries(n: int, start: float) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) + start).view(1, 1, n, 1).expand(1, 2, n, 3)


def test_update_advance_crop():
    cache = StaticKVCache(2, 2, 3, 10)
    for layer in range(2):
        k, v = cache.update(layer, entries(4, 0), entries(4, 100))
        assert k.shape == (1, 2, 4, 3) and v[0, 0, :, 0].tolist() == [100, 101, 102, 103]
    cache.advance(4)
    k, _ = cache.update(0, entries(2, 10), entries(2, 110))
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 3, 10, 11]
    cache.crop(2)
    k, _ = cache.update(0, entries(1, 20), entries(1, 120))
    assert k[0, 0, :, 0].tolist() == [0, 1, 20]


def test_update_kv_equals_update():
    """The fused writer (keys and values stacked, from a strided view) writes what `update` writes."""
    caches = [StaticKVCache(2, 2, 3, 10) for _ in range(2)]
    for step, (q, layer) in enumerate([(4, 0), (4, 1), (2, 1)]):
        k, v = entries(q, 10 * step), entries(q, 100 + 10 * step)
        kv = torch.stack([k, v]).transpose(3, 4).contiguous().transpose(3, 4)  # a non-contiguous layout
        assert not kv.is_contiguous()
        want = caches[0].update(layer, k, v)
        got = caches[1].update_kv(layer, kv)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)
        if layer == 1:
            for c in caches:
                c.advance(q)
    assert torch.equal(caches[0].kv, caches[1].kv) and caches[1].seq_len == 6


def test_compact_keeps_accepted_slots_in_order():
    cache = StaticKVCache(1, 2, 3, 12)
    cache.update(0, entries(3, 0), entries(3, 0))
    cache.advance(3)
    cache.update(0, entries(6, 10), entries(6, 50))  # a 6-node tree after 3 committed slots
    cache.compact(3, torch.tensor([0, 2, 5]))
    assert cache.seq_len == 6
    assert cache.keys[0, 0, 0, :6, 0].tolist() == [0, 1, 2, 10, 12, 15]
    assert cache.values[0, 0, 1, :6, 0].tolist() == [0, 1, 2, 50, 52, 55]


def test_overflow_is_refused():
    cache = StaticKVCache(1, 1, 1, 4)
    with pytest.raises(ValueError, match="overflow"):
        cache.update(0, torch.zeros(1, 1, 5, 1), torch.zeros(1, 1, 5, 1))
    with pytest.raises(ValueError, match="overflow"):
        cache.advance(5)


def test_attention_shape_defaults_like_transformers():
    from transformers import LlamaConfig

    from eagle_train.decoding.kv_cache import AttentionShape, attention_shape

    explicit = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8, "hidden_size": 64}
    assert attention_shape(explicit) == AttentionShape(heads=8, kv_heads=4, head_dim=8)
    assert attention_shape({"num_attention_heads": 8, "hidden_size": 64}) == AttentionShape(8, 8, 8)
    assert attention_shape({**explicit, "head_dim": 32}).head_dim == 32  # a head wider than hidden/heads
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert attention_shape(config) == AttentionShape(4, 2, 16) == attention_shape(config.to_dict())
