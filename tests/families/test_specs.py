"""The tiny family configs (transformers' own classes) have the switches each family is there to prove, in
vLLM's CPU head sizes, with the published vocabulary sizes; no download (the models are made in memory)."""

from __future__ import annotations

import pytest
import torch
import transformers

from eagle_train.families.specs import FAMILIES, WINDOW
from eagle_train.families.tiny import family_config

# family -> (a parameter name the model must have, what it shows)
MARKERS = {
    "llama3": ("model.layers.0.self_attn.q_proj.weight", "plain Llama projections"),
    "qwen2_5": ("model.layers.0.self_attn.q_proj.bias", "qkv bias"),
    "qwen3": ("model.layers.0.self_attn.q_norm.weight", "q/k norm"),
    "qwen3_moe": ("model.layers.0.mlp.gate.weight", "MoE router"),
    "gpt_oss": ("model.layers.0.self_attn.sinks", "attention sinks"),
    "deepseek_v3": ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "MLA"),
    "phi3": ("model.layers.0.self_attn.qkv_proj.weight", "fused qkv"),
    "qwen3_next": ("model.layers.0.linear_attn.conv1d.weight", "recurrent (Gated DeltaNet) layer"),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiny_config_has_the_family_switches(name):
    family = FAMILIES[name]
    config = family_config(family)
    assert type(config).__name__ == family.config_class and config.hidden_size == 64
    assert config.vocab_size == family.vocab_size
    head_dim = getattr(config, "qk_head_dim", None) or getattr(config, "head_dim", None)  # MLA: nope + rope
    assert head_dim in (32, 64)  # vLLM's CPU attention runs it without re-expression
    types = getattr(config, "layer_types", None) or []
    if getattr(config, "sliding_window", None):
        assert config.sliding_window == WINDOW
    if name in ("gemma3", "gpt_oss"):
        assert "sliding_attention" in types and "full_attention" in types
    if name == "qwen3_next":
        assert "linear_attention" in types and family.refused
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters())
    if name in MARKERS:
        assert MARKERS[name][0] in params, MARKERS[name][1]
    attention = model.model.layers[-1].self_attn  # the head size the model really uses
    if hasattr(attention, "head_dim") and name != "deepseek_v3":
        assert attention.head_dim in (32, 64), f"{name}: attention head_dim {attention.head_dim}"
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert tied == family.fields["tie_word_embeddings"]


def test_gemma3_embeds_scaled_and_scales_queries_by_its_own_scalar():
    config = family_config(FAMILIES["gemma3"])
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.tensor([[5, 9]])
    scaled = model.get_input_embeddings()(ids)
    assert torch.allclose(scaled, model.get_input_embeddings().weight[ids] * config.hidden_size**0.5)
    assert config.query_pre_attn_scalar != config.head_dim  # a head_dim**-0.5 scaling would be caught
