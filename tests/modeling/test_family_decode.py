"""The decode-time forward is the MODEL for every attention family, or the target is refused.

Tiny random instances of each family, built with transformers' own config classes (4 layers, d 64,
head_dim 32, stories260K's tokenizer; sliding windows of 16 so prompts and answers run past them; weights
with std 0.2 so the window visibly changes the logits). For each: the load-time probe passes
(`check_decode`), plain decoding in this harness (`ar`, the cache and mask code every speculative method
shares) gives the tokens of the model's own Hugging Face `generate`, and EAGLE-2 with a head gives the same
tokens again. Without the window in the masks the probe refuses the target (the check can fail), and
hybrid recurrent models are refused naming the reason. The real-tokenizer family matrix (trained heads,
vLLM) is tests/families/.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf

from eagle_train.config.decode import DecodeConfig
from eagle_train.config.target import TargetConfig
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.modeling.attention_layout import AttentionLayout, UnsupportedAttention, attention_layout
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.eagle3 import Eagle3Head
from eagle_train.modeling.target import load_target
from tests.conftest import STORIES260K

SHAPE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, tie_word_embeddings=False,
)  # fmt: skip
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=64)
FAMILIES = {
    "llama3": (tf.LlamaConfig, dict(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "qwen2": (tf.Qwen2Config, dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
    "qwen3": (tf.Qwen3Config, {}),
    "qwen3_moe": (tf.Qwen3MoeConfig, dict(num_experts=4, **MOE)),
    "mistral": (tf.MistralConfig, dict(sliding_window=16)),
    "gemma3": (tf.Gemma3TextConfig, dict(sliding_window=16, query_pre_attn_scalar=32, tie_word_embeddings=True)),
    "gpt_oss": (tf.GptOssConfig, dict(sliding_window=16, num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": (tf.DeepseekV3Config, dict(
        head_dim=16, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=4, first_k_dense_replace=1, n_group=1,
        topk_group=1, **MOE)),
    "phi3": (tf.Phi3Config, dict(sliding_window=16)),
}  # fmt: skip
WINDOWED = ("qwen2", "mistral", "gemma3", "gpt_oss", "phi3")
PROMPT, NEW = 40, 48  # both past the 16-token windows


def save_family(name: str, path, config_cls=None, extra=None):
    """A tiny random `name` model saved with stories260K's tokenizer; returns its TargetConfig."""
    config_cls, extra = (config_cls, extra) if config_cls else FAMILIES[name]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config_cls(**{**SHAPE, **extra}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tf.AutoTokenizer.from_pretrained(STORIES260K).save_pretrained(path)
    return TargetConfig(name=name, path=str(path), chat_template="plain")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    cfg = save_family(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, cfg, load_target(cfg)


def prompt_ids(seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(target, prompt: list[int]) -> list[int]:
    """The model's own greedy continuation (Hugging Face generate, its own cache and masks)."""
    ids = torch.tensor([prompt])
    out = target.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, PROMPT:].tolist()


def decode(target, head, method: str, prompt: list[int]) -> list[int]:
    cfg = DecodeConfig(method=method, max_new_tokens=NEW, depth=3, top_k=4, total_tokens=12)
    target.cfg = dataclasses.replace(target.cfg, stop_token_ids=[])
    return SpeculativeDecoder(target, head, cfg).generate(prompt).tokens


def test_family_decodes_as_the_model_itself(family):
    """ar and EAGLE-2 (EAGLE-1 and EAGLE-3 heads) give the tokens of the model's own generate, past the
    sliding window, on three prompts."""
    name, _, target = family
    target.model.generation_config.eos_token_id = None
    target.tokenizer.eos_token_id = None  # answers run the full length: no stop token
    eagle1 = DraftHead.from_target(target.config, target=target)
    eagle3 = Eagle3Head.from_target(target.config, target.aux_layers, 64, target=target)
    for seed in range(3):
        prompt = prompt_ids(seed)
        reference = generate(target, prompt)
        assert decode(target, None, "ar", prompt) == reference, f"{name}: ar differs from generate"
        for head in (eagle1.eval(), eagle3.eval()):
            assert decode(target, head, "dynamic_tree", prompt) == reference, f"{name}: dynamic tree differs"


@pytest.mark.parametrize("name", WINDOWED)
def test_the_probe_refuses_a_decode_path_without_the_window(name, tmp_path, monkeypatch):
    """The load-time check can fail: with the sliding windows left out of the masks (the bug every
    method shared before), the first decode-time use refuses the target, naming the difference."""
    target = load_target(save_family(name, tmp_path))
    assert target.attention_layout.max_window == 16
    monkeypatch.setitem(
        target.__dict__, "attention_layout", AttentionLayout({"all": None}, per_layer_type=False)
    )
    with pytest.raises(UnsupportedAttention, match="does not reproduce the model's own forward"):
        target.new_cache(64)


def test_mla_cache_holds_what_the_model_writes(tmp_path):
    """DeepSeek-V3's MLA caches its compressed latents, one head: kv_lora_rank = 32 wide "keys" and
    qk_rope_head_dim = 16 wide "values" (transformers 5.x); the cache takes each at its own width."""
    target = load_target(save_family("deepseek_v3", tmp_path))
    assert target.cache_shape == (1, 32, 16)
    cache = target.new_cache(16)
    assert cache.keys.shape[1:] == (1, 1, 16, 32) and cache.values.shape[1:] == (1, 1, 16, 16)


@pytest.mark.parametrize(
    "config_cls, extra, reason",
    [
        (tf.Qwen3NextConfig, dict(num_experts=4, **MOE), "linear_attention"),
        (tf.Llama4TextConfig, dict(attention_chunk_size=16, num_local_experts=2), "chunked attention"),
    ],
)
def test_architectures_the_decoder_cannot_reproduce_are_refused(config_cls, extra, reason):
    """Recurrent layers (Qwen3-Next's gated delta-net) and chunked attention (Llama-4) are refused with the
    architecture and the reason, at the first decode-time use: never decoded silently wrong."""
    with pytest.raises(UnsupportedAttention, match=reason):
        attention_layout(config_cls(**{**SHAPE, **extra}))


def test_hybrid_target_loads_for_extraction_and_is_refused_by_the_decoder(tmp_path):
    """Qwen3-Next: plain forwards (extraction, training) run; the decoder refuses it before decoding."""
    target = load_target(save_family("qwen3_next", tmp_path, tf.Qwen3NextConfig, dict(num_experts=4, **MOE)))
    logits, hidden = target.features(torch.tensor([prompt_ids()]))
    assert logits.shape == (1, PROMPT, 512) and hidden.shape == (1, PROMPT, 64)
    with pytest.raises(UnsupportedAttention, match="qwen3_next: layers with recurrent state"):
        SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=4)).generate(prompt_ids())


def test_gpt_oss_loads_with_eager_by_default_and_sdpa_is_refused_clearly(tmp_path):
    """gpt-oss has no sdpa attention (its sinks): unset attn_implementation loads eager; sdpa asked for
    explicitly is a clear error instead of transformers' traceback."""
    cfg = save_family("gpt_oss", tmp_path)
    assert load_target(cfg).attention == "eager"
    with pytest.raises(ValueError, match="GptOssForCausalLM has no sdpa attention"):
        load_target(dataclasses.replace(cfg, attn_implementation="sdpa"))


def test_scaled_embedding_target_gives_the_head_the_raw_table(tmp_path):
    """Gemma's embedding module multiplies by sqrt(d); vLLM's and SGLang's drafts share the target's
    embedding TABLE (vLLM applies Gemma's normalizer outside the module), so the head embeds with the raw
    table: the same vectors in training, in our decoder and in the engine."""
    target = load_target(save_family("gemma3", tmp_path))
    ids = torch.tensor([[5, 6, 7]])
    table = target.embed_tokens.weight[ids]
    assert not torch.allclose(target.embed_tokens(ids), table)  # the module scales
    assert torch.equal(DraftHead.from_target(target.config, target=target).embed_tokens(ids), table)
    eagle3 = Eagle3Head.from_target(target.config, target.aux_layers, 64, target=target)
    assert torch.equal(eagle3.embed_tokens(ids), table)
