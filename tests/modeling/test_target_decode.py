"""The target's decode path: stock HF model + static KV cache + 4-D mask + explicit positions."""

from __future__ import annotations

import pytest
import torch

from eagle_train.decoding.tree import build_tree
from eagle_train.modeling.target import load_target


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def any_target(request, target_cfg, target):
    if request.param == "sdpa":
        return target
    from dataclasses import replace

    return load_target(replace(target_cfg, attn_implementation="eager"))


def test_prefill_equals_features(any_target):
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = any_target.new_cache(64)
    logits, hidden = any_target.decode(ids, torch.arange(40)[None], causal(40), cache)
    ref_logits, ref_hidden = any_target.features(ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
    # lm_head(hidden) == logits: the feature is the LM head's input
    torch.testing.assert_close(any_target.lm_head(hidden), logits)


def test_tree_forward_equals_per_path_sequential_forwards(any_target):
    """One forward over a tree (4-D mask, positions prefix + depth) gives each node the logits and
    feature of a plain forward over prefix + its root-to-node path; compaction keeps a valid cache."""
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 500, (1, 17), generator=g)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6]
    tree = build_tree(torch.randint(3, 500, (len(parents),), generator=g), parents)
    cache = any_target.new_cache(64)
    any_target.decode(prefix, torch.arange(17)[None], causal(17), cache)
    cache.advance(17)
    n = tree.size
    mask = torch.cat([torch.ones(n, 17, dtype=torch.bool), tree.attention_mask], dim=1)[None, None]
    logits, hidden = any_target.decode(tree.tokens[None], (tree.depth + 17)[None], mask, cache)
    for leaf_path in tree.retrieve_indices.tolist():
        path = [i for i in leaf_path if i >= 0]
        seq = torch.cat([prefix[0], tree.tokens[path]])[None]
        ref_logits, ref_hidden = any_target.features(seq)
        torch.testing.assert_close(logits[0, path], ref_logits[0, 17:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hidden[0, path], ref_hidden[0, 17:], rtol=1e-4, atol=1e-4)
    # keep the path 0 -> 1 -> 3 -> 6, then one more token must see exactly prefix + that path
    keep = [0, 1, 3, 6]
    cache.compact(17, torch.tensor(keep))
    nxt = torch.tensor([[42]])
    out, _ = any_target.decode(nxt, torch.tensor([[21]]), torch.ones(1, 1, 1, 22, dtype=torch.bool), cache)
    seq = torch.cat([prefix[0], tree.tokens[keep], nxt[0]])[None]
    torch.testing.assert_close(out[0, -1], any_target.features(seq)[0][0, -1], rtol=1e-4, atol=1e-4)


def test_flash_attention_target_decodes_through_sdpa(target_cfg, target):
    """A target loaded with flash_attention_2 cannot take the tree's 4-D mask (flash reads it as a padding
    mask): decode-time forwards run sdpa instead, bit for bit the sdpa target's, and the model keeps its
    own implementation for everything else. (flash_attn cannot load on a CPU: the attribute is set here
    as loading with it sets it; eagle_train.diagnostics.gpu_checks.flash_attention_decoding checks the real
    kernel.)"""
    from eagle_train.config.decode import DecodeConfig
    from eagle_train.decoding.decoder import SpeculativeDecoder

    flash = load_target(target_cfg)
    flash.model.config._attn_implementation = "flash_attention_2"
    assert flash.decode_attention == "sdpa"
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 500, (1, 13), generator=g)
    tree = build_tree(torch.randint(3, 500, (6,), generator=g), [-1, 0, 0, 1, 2, 2])
    mask = torch.cat([torch.ones(6, 13, dtype=torch.bool), tree.attention_mask], dim=1)[None, None]
    outputs = []
    for model in (target, flash):
        cache = model.new_cache(32)
        model.decode(prefix, torch.arange(13)[None], causal(13), cache)
        cache.advance(13)
        outputs.append(model.decode(tree.tokens[None], (tree.depth + 13)[None], mask, cache))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    assert flash.model.config._attn_implementation == "flash_attention_2"  # restored after each forward
    prompt = prefix[0].tolist()
    ar = SpeculativeDecoder(flash, None, DecodeConfig(method="ar", max_new_tokens=30)).generate(prompt)
    eagle2 = DecodeConfig(method="dynamic_tree", depth=3, top_k=4, total_tokens=16, max_new_tokens=30)
    from eagle_train.modeling.draft import DraftHead

    head = DraftHead.from_target(flash.config)
    head.share_target_weights(flash)
    assert SpeculativeDecoder(flash, head.eval(), eagle2).generate(prompt).tokens == ar.tokens


def test_additive_mask_gives_the_boolean_masks_logits(target):
    """`decode` hands the stock model an additive float mask (sdpa would convert a boolean mask in every
    layer): the tree's logits are bit for bit those of the stock decoder given the boolean mask."""
    from eagle_train.modeling.target import HFCacheView

    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, 500, (1, 9), generator=g)
    tree = build_tree(torch.randint(3, 500, (6,), generator=g), [-1, 0, 0, 1, 2, 2])
    mask = torch.cat([torch.ones(6, 9, dtype=torch.bool), tree.attention_mask], dim=1)[None, None]
    cache = target.new_cache(32)
    target.decode(prefix, torch.arange(9)[None], causal(9), cache)
    cache.advance(9)
    logits, hidden = target.decode(tree.tokens[None], (tree.depth + 9)[None], mask, cache)
    with torch.no_grad():
        out = target.decoder(
            input_ids=tree.tokens[None],
            position_ids=(tree.depth + 9)[None],
            attention_mask=mask,
            use_cache=True,
            cache=HFCacheView(cache),
        )
    assert torch.equal(hidden, out.last_hidden_state) and torch.equal(logits, target.lm_head(hidden))
