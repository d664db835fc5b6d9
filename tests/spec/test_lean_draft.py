"""The lean decode-time draft forward equals DraftHead.forward (cache, tree mask, positions)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from eagle_train.kv_cache import StaticKVCache
from eagle_train.modeling.draft import DraftHead
from eagle_train.spec.lean_draft import LeanDraft, supports


@pytest.mark.parametrize(
    "num_layers, kv_heads, fc_bias, attention_bias",
    [(1, 2, True, False), (2, 4, False, False), (1, 2, False, True)],
)
@torch.no_grad()
def test_lean_forward_equals_head_forward(num_layers, kv_heads, fc_bias, attention_bias):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=40,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=8,
        max_position_embeddings=128,
        attention_bias=attention_bias,
    )
    head = DraftHead.from_target(cfg, num_layers=num_layers, fc_bias=fc_bias).eval()
    for layer in head.layers:  # non-trivial norms and biases (the vLLM export folds an fc bias into them)
        layer.post_attention_layernorm.weight.data.uniform_(0.5, 1.5)
        for proj in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
        ):
            if proj.bias is not None:
                proj.bias.data.uniform_(-0.5, 0.5)
    assert supports(head)
    lean = LeanDraft(head, 128)
    caches = [StaticKVCache(num_layers, kv_heads, 8, 64) for _ in range(2)]
    # a causal prefix of 9 pairs, then a 5-input tree step with an arbitrary ancestor mask
    tokens, feats = torch.randint(0, 50, (9,)), torch.randn(9, 32)
    ref = head(tokens[None], feats[None], torch.arange(9)[None], None, caches[0])[0]
    got = lean.forward(tokens, feats, torch.arange(9), None, caches[1])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for c in caches:
        c.advance(9)
    tree = torch.tensor(
        [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [0, 1, 0, 0, 1]]
    ).bool()
    mask = torch.cat([torch.ones(5, 9, dtype=torch.bool), tree], 1)[None, None]
    positions = torch.tensor([9, 9, 10, 11, 10])
    tokens, feats = torch.randint(0, 50, (5,)), torch.randn(5, 32)
    ref = head(tokens[None], feats[None], positions[None], mask, caches[0])[0]
    got = lean.forward(tokens, feats, positions, mask, caches[1])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        lean.log_probs(got), torch.log_softmax(head.logits(ref), -1), rtol=1e-5, atol=1e-5
    )
