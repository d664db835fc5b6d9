"""The draft head: parity of its decoder layer with transformers' Llama layer, frozen shared weights,
the serving key layout, and the cache/mask paths used by decoding and the chain metrics."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from eagle_train.modeling.draft import DraftHead, draft_llama_config
from tests.reference import ChainCache


def _gqa_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        attn_implementation="eager",
    )


def test_decoder_layer_equals_llama_layer_without_input_norm():
    torch.manual_seed(0)
    config = _gqa_config()
    reference = LlamaDecoderLayer(config, layer_idx=0).eval()
    reference.input_layernorm = nn.Identity()  # EAGLE: layer 0 takes the fc output un-normalised
    for p in reference.parameters():
        nn.init.normal_(p, std=0.2)
    head = DraftHead(draft_llama_config(config, 1)).eval()
    head.layers[0].load_state_dict(reference.state_dict(), strict=True)  # same key names, none left over
    x = torch.randn(2, 9, config.hidden_size)  # [batch, seq, hidden]
    positions = torch.arange(9)[None].expand(2, 9)
    cos_sin = LlamaRotaryEmbedding(config)(x, positions)
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected = reference(x, attention_mask=causal, position_ids=positions, position_embeddings=cos_sin)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = head.layers[0](x, head.rotary_emb(x, positions))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_shapes_come_from_the_target_config_of_any_family():
    qwen = Qwen2Config(
        vocab_size=50,
        hidden_size=24,
        intermediate_size=40,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    head = DraftHead.from_target(qwen, num_layers=2)
    assert head.fc.weight.shape == (24, 48)
    assert head.layers[0].self_attn.k_proj.weight.shape == (2 * 4, 24)
    assert not hasattr(head.layers[0], "input_layernorm") and hasattr(head.layers[1], "input_layernorm")
    out = head(torch.randint(0, 50, (1, 5)), torch.randn(1, 5, 24))
    assert out.shape == (1, 5, 24)


def test_embedding_and_lm_head_are_shared_frozen_and_not_saved(target):
    head = DraftHead.from_target(target.config)
    head.share_target_weights(target)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight)
    assert torch.equal(head.embed_tokens.weight, target.embed_tokens.weight)
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("fc.", "layers.")) for n in trainable)
    keys = set(head.trainable_state_dict())
    assert "fc.weight" in keys and "fc.bias" in keys and "layers.0.post_attention_layernorm.weight" in keys
    assert not any(k.startswith(("lm_head", "embed_tokens", "layers.0.input_layernorm")) for k in keys)


def test_cached_step_equals_full_forward(target):
    torch.manual_seed(1)
    head = DraftHead.from_target(target.config).eval()
    ids, feats = torch.randint(0, 512, (1, 8)), torch.randn(1, 8, target.hidden_size)
    with torch.no_grad():
        full = head(ids, feats)
        cache = ChainCache()
        first = head(ids[:, :5], feats[:, :5], cache=cache)
        rest = head(ids[:, 5:], feats[:, 5:], position_ids=torch.arange(5, 8)[None], cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=1e-5, atol=1e-5)
