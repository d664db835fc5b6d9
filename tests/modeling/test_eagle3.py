"""The EAGLE-3 head: parity with a slow plain reference written from the facts (full sequence and cached
steps fed its own states, EAGLE-3.1 switches), the exact serving keys, the draft vocabulary, frozen and
trained parameters."""

from __future__ import annotations

import pytest
import torch

from eagle_train.decoding.kv_cache import StaticKVCache
from eagle_train.modeling.draft_vocab import d2t_from_t2d
from eagle_train.modeling.eagle3 import Eagle3Head
from tests.reference import eagle3_reference_logits, tiny_head_config

CONFIG = tiny_head_config(50, rms_norm_eps=1e-6, rope_theta=10000.0)
KEPT = torch.tensor([0, 2, 3, 7, 11, 12, 20, 21, 30, 33, 40, 41, 45, 47, 48, 49])  # a draft vocabulary of 16


def make_head(fc_norm=False, norm_output=False, seed=0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(CONFIG, [0, 1, 2], len(KEPT), fc_norm=fc_norm, norm_output=norm_output)
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[KEPT] = True
    head.set_vocabulary(t2d)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn_like(p) * 0.4 + (1.0 if "norm" in name else 0.0))
    return head.double().eval()  # (transformers' RMSNorm and RoPE still round through float32)


SWITCHES = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("fc_norm, norm_output", SWITCHES)
@torch.no_grad()
def test_full_sequence_equals_the_reference(fc_norm, norm_output):
    head = make_head(fc_norm, norm_output)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (7,), generator=g)
    feats = torch.randn(7, 48, generator=g, dtype=torch.float64)
    state = head(tokens[None], feats[None])[0]
    ref_logits, ref_states = eagle3_reference_logits(
        head.trainable_state_dict(), head.embed_tokens.weight, tokens.tolist(), list(feats), 4, 2, 1e-6, 1e4,
        fc_norm, norm_output,
    )  # fmt: skip
    torch.testing.assert_close(head.logits(state), torch.stack(ref_logits), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, torch.stack(ref_states), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fc_norm, norm_output", SWITCHES)
@torch.no_grad()
def test_cached_steps_fed_own_states_equal_the_reference(fc_norm, norm_output):
    """A prefix of target features, then two draft steps each fed the previous step's state (d wide: fc
    skipped), through a static KV cache, as the decoder drafts a chain."""
    head = make_head(fc_norm, norm_output, seed=2)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50, (7,), generator=g)
    feats = torch.randn(5, 48, generator=g, dtype=torch.float64)
    cache = StaticKVCache(1, 2, 4, 16, dtype=torch.float64)
    states = [head(tokens[None, :5], feats[None], None, None, cache)[0]]
    cache.advance(5)
    fed = [*feats]
    for i in (5, 6):
        fed.append(states[-1][-1])
        states.append(
            head(tokens[None, i : i + 1], states[-1][None, -1:], torch.tensor([[i]]), None, cache)[0]
        )
        cache.advance(1)
    got = head.logits(torch.cat(states))
    ref_logits, _ = eagle3_reference_logits(
        head.trainable_state_dict(), head.embed_tokens.weight, tokens.tolist(), fed, 4, 2, 1e-6, 1e4, fc_norm, norm_output
    )  # fmt: skip
    torch.testing.assert_close(got, torch.stack(ref_logits), rtol=1e-4, atol=1e-5)


def test_serving_keys_and_shapes():
    head = Eagle3Head(CONFIG, [0, 1, 2], 16, fc_norm=True)
    shapes = {k: tuple(v.shape) for k, v in head.trainable_state_dict().items()}
    assert shapes == {
        "fc.weight": (16, 48),
        "fc_norm.0.weight": (16,),
        "fc_norm.1.weight": (16,),
        "fc_norm.2.weight": (16,),
        "midlayer.input_layernorm.weight": (16,),
        "midlayer.hidden_norm.weight": (16,),
        "midlayer.self_attn.q_proj.weight": (16, 32),
        "midlayer.self_attn.k_proj.weight": (8, 32),
        "midlayer.self_attn.v_proj.weight": (8, 32),
        "midlayer.self_attn.o_proj.weight": (16, 16),
        "midlayer.mlp.gate_proj.weight": (24, 16),
        "midlayer.mlp.up_proj.weight": (24, 16),
        "midlayer.mlp.down_proj.weight": (16, 24),
        "midlayer.post_attention_layernorm.weight": (16,),
        "norm.weight": (16,),
        "lm_head.weight": (16, 16),
        "d2t": (16,),
        "t2d": (50,),
    }
    assert head.fc.bias is None and head.d2t.dtype == torch.int64 and head.t2d.dtype == torch.bool


def test_vocabulary_maps_draft_ids_to_target_ids_and_starts_the_lm_head_from_the_targets_rows():
    head = Eagle3Head(CONFIG, [0, 1, 2], 16)
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[KEPT] = True
    target_lm_head = torch.randn(50, 16)
    head.set_vocabulary(t2d, target_lm_head)
    assert torch.equal(head.vocab_map, KEPT) and torch.equal(head.d2t, KEPT - torch.arange(16))
    assert torch.equal(head.t2d, t2d) and torch.equal(d2t_from_t2d(t2d), head.d2t)
    assert torch.equal(head.lm_head.weight, target_lm_head[KEPT])
    with pytest.raises(ValueError, match="keeps 3 of 50 tokens"):
        head.set_vocabulary(torch.arange(50) < 3)


def test_only_the_embedding_is_frozen(target):
    head = Eagle3Head.from_target(target.config, target.aux_layers, 128)
    head.share_target_weights(target)
    assert head.embed_tokens.weight.data_ptr() == target.embed_tokens.weight.data_ptr()  # shared, no copy
    assert not head.embed_tokens.weight.requires_grad
    # held outside the head's parameters and state (modeling.draft.FrozenParts): never trained, never saved
    assert all(p.requires_grad for p in head.parameters())
    assert not any(k.startswith("embed_tokens") for k in head.state_dict())
    assert head.aux_layers == [1, 2, 4] and head.fc.weight.shape == (64, 192)
    assert head.lm_head.weight.shape == (128, 64) and "lm_head.weight" in head.trainable_state_dict()
