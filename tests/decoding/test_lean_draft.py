"""The lean decode-time draft forward equals DraftHead.forward (cache, tree mask, positions)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from eagle_train.decoding.kv_cache import StaticKVCache
from eagle_train.decoding.lean_draft import LeanDraft, supports
from eagle_train.modeling.draft import DraftHead


def config(kv_heads: int, attention_bias: bool = False) -> LlamaConfig:
    """A small Llama shape (4 heads of 8, kv_heads key/value heads) for the heads under test."""
    return LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=40,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=8,
        max_position_embeddings=128,
        attention_bias=attention_bias,
        num_hidden_layers=1,
    )


@pytest.mark.parametrize(
    "num_layers, kv_heads, fc_bias, attention_bias",
    [(1, 2, True, False), (2, 4, False, False), (1, 2, False, True)],
)
@torch.no_grad()
def test_lean_forward_equals_head_forward(num_layers, kv_heads, fc_bias, attention_bias):
    torch.manual_seed(0)
    head = DraftHead.from_target(
        config(kv_heads, attention_bias), num_layers=num_layers, fc_bias=fc_bias
    ).eval()
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


@pytest.mark.parametrize(
    "fc_norm, norm_output, kv_heads, layers, kind, mlp",
    [(False, False, 2, 1, "eagle3", None), (True, True, 4, 1, "eagle3", None), (False, True, 2, 1, "eagle3", None),
     (False, False, 2, 3, "eagle3", None), (True, False, 4, 2, "peagle", None), (False, False, 2, 2, "peagle", 200)],
)  # fmt: skip
@torch.no_grad()
def test_lean_eagle3_forward_equals_head_forward(fc_norm, norm_output, kv_heads, layers, kind, mlp):
    """The EAGLE-3 lean forward: target features (3d, through fc) for a causal prefix, then a tree step
    fed the head's own states (d wide, fc skipped), log-probs over the draft vocabulary; multi-layer heads
    (layers 1..N-1 plain pre-norm layers), P-EAGLE heads (the learned row of the mask token, which the
    prefix holds twice) and an MLP wider than the target's alike."""
    from eagle_train.decoding.lean_draft import LeanEagle3, lean_forward
    from eagle_train.modeling.eagle3 import Eagle3Head
    from eagle_train.modeling.peagle import PEagleHead

    torch.manual_seed(0)
    shape = config(kv_heads)
    shape.num_hidden_layers = layers
    shape.intermediate_size = mlp or shape.intermediate_size  # draft.intermediate_size: a wider MLP
    if kind == "peagle":
        head = PEagleHead(shape, [0, 1, 2], 20, mask_token_id=7, fc_norm=fc_norm).eval()
        head.mask_embedding.data.normal_()  # unlike the embedding's own row 7
    else:
        head = Eagle3Head(shape, [0, 1, 2], 20, fc_norm=fc_norm, norm_output=norm_output).eval()
    for name, p in head.named_parameters():
        if "norm" in name:
            p.data.uniform_(0.5, 1.5)
    lean = lean_forward(head, 128)
    assert isinstance(lean, LeanEagle3) and len(lean.layers) == layers
    caches = [StaticKVCache(layers, kv_heads, 8, 64) for _ in range(2)]
    tokens, feats = torch.randint(0, 50, (9,)), torch.randn(9, 96)
    tokens[[3, 8]] = 7
    ref = head(tokens[None], feats[None], torch.arange(9)[None], None, caches[0])[0]
    got = lean.forward(tokens, feats, torch.arange(9), None, caches[1])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for c in caches:
        c.advance(9)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).bool()
    mask = torch.cat([torch.ones(3, 9, dtype=torch.bool), tree], 1)[None, None]
    positions = torch.tensor([9, 10, 10])
    tokens, states = torch.randint(0, 50, (3,)), ref[[8, 8, 7]]  # fed-back states
    ref = head(tokens[None], states[None], positions[None], mask, caches[0])[0]
    got = lean.forward(tokens, states, positions, mask, caches[1])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    expected = torch.log_softmax(head.logits(ref), -1)
    assert expected.shape == (3, 20)
    torch.testing.assert_close(lean.log_probs(got), expected, rtol=1e-5, atol=1e-5)
