"""target.compile_frozen: the decode-time forward of a few new tokens as frozen, autotuned graphs
(modeling.frozen_step) computes what the stock forward computes, on the real stories260K target."""

from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from eagle_train.decoding.tree import build_tree
from eagle_train.modeling.frozen_step import QUERY_BUCKETS, pad_queries, query_bucket


def test_queries_pad_to_the_next_bucket():
    assert [query_bucket(q) for q in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert query_bucket(QUERY_BUCKETS[-1] + 1) is None


def test_padding_rows_attend_to_themselves_and_no_real_row_sees_them():
    ids, positions = torch.tensor([[7, 8, 9]]), torch.tensor([[4, 5, 5]])
    mask = torch.ones(1, 1, 3, 4 + 3, dtype=torch.bool).tril(4)
    padded_ids, padded_positions, padded = pad_queries(ids, positions, mask, 8)
    assert padded_ids.tolist() == [[7, 8, 9, 9, 9, 9, 9, 9]]
    assert padded_positions.tolist() == [[4, 5, 5, 5, 5, 5, 5, 5]]
    assert padded.shape == (1, 1, 8, 4 + 8)
    assert torch.equal(padded[0, 0, :3, :7], mask[0, 0])  # the real rows as they were ...
    assert not padded[0, 0, :3, 7:].any()  # ... blind to the padding
    assert not padded[0, 0, 3:, :7].any()  # padding sees neither the context nor the real rows ...
    assert torch.equal(padded[0, 0, 3:, 7:], torch.eye(5, dtype=torch.bool))  # ... only itself
    assert pad_queries(ids, positions, mask, 3)[2] is mask


@pytest.mark.parametrize("chunk", [8, 4])
@pytest.mark.slow
def test_frozen_graphs_compute_the_stock_forward(target, chunk):
    """A tree of 7 drafted tokens (padded to 8; whole, or in chunks of 4 and 3 padded to 4, the first's keys
    and values in the cache before the second attends to them) and a one-token step after it, through the
    frozen graphs and the stock forward from the same cache: the same logits and features, the same keys and
    values in the real slots, nothing committed by the padding; a cache of another capacity builds no new
    graph. About 70 s: three graphs autotuned and compiled, the chunking of the 8-query bucket measured."""
    frozen = replace(target, cfg=replace(target.cfg, compile_decode=True, compile_frozen=True))
    assert frozen._frozen_decoder is not None and target._frozen_decoder is None
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 500, (1, 11), generator=g)
    tree = build_tree(torch.randint(3, 500, (7,), generator=g), [-1, 0, 0, 1, 1, 2, 4])
    tree_mask = torch.cat([torch.ones(7, 11, dtype=torch.bool), tree.attention_mask], dim=1)[None, None]
    runs = []
    with torch.inference_mode():
        for model in (target, frozen):
            cache = target.new_cache(32)
            target.decode(
                prefix, torch.arange(11)[None], torch.ones(11, 11, dtype=torch.bool).tril()[None, None], cache
            )
            cache.advance(11)
            assert model._frozen_decoder is None or model._frozen_decoder.fits(7, cache)
            tree_out = model.decode(tree.tokens[None], (tree.depth + 11)[None], tree_mask, cache)
            if model is frozen:  # measured at the first forward of the bucket: whole or in chunks of 4
                assert frozen._frozen_decoder.chunks[8] in (4, 8)
                frozen._frozen_decoder.chunks[8] = chunk
                tree_out = model.decode(tree.tokens[None], (tree.depth + 11)[None], tree_mask, cache)
            real_slots = cache.kv[:, :, :, :, : 11 + 7].clone()
            cache.compact(11, torch.tensor([0, 1, 3]))  # the accepted path root -> 1 -> 3
            step = torch.tensor([[int(tree_out[0][0, 3].argmax())]])
            step_out = model.decode(
                step, torch.tensor([[14]]), torch.ones(1, 1, 1, 15, dtype=torch.bool), cache
            )
            runs.append((tree_out, step_out, real_slots, cache.kv[:, :, :, :, :15].clone()))
    stock, compiled = runs
    # another generation's cache (another capacity: prompt + budget) runs the graphs already built
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        cache = target.new_cache(48)
        target.decode(
            prefix, torch.arange(11)[None], torch.ones(11, 11, dtype=torch.bool).tril()[None, None], cache
        )
        cache.advance(11)
        again = frozen.decode(tree.tokens[None], (tree.depth + 11)[None], tree_mask, cache)
    assert counters["stats"]["unique_graphs"] == graphs
    torch.testing.assert_close(again[0], stock[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled[0], stock[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled[1], stock[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled[2], stock[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled[3], stock[3], rtol=1e-5, atol=1e-5)
    assert torch.equal(compiled[0][0].argmax(-1), stock[0][0].argmax(-1))
