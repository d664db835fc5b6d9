"""The model families the project proves end to end: each one's tiny shape and its real switches.

A `Family` names transformers' own config class, the real tokenizer (eagle_train.families.tokenizers), the
published generation ids and the architectural switches that make the family what it is (sliding windows of
16 tokens, so prompts and answers go past them; qkv bias; q/k norm; MoE; MLA; sinks; scaled embeddings;
fused projections; recurrent layers). Every shape has hidden 64 and head_dim 32 or 64 (vLLM's CPU attention
runs them as they are). The values cited are the published config.json / generation_config.json of the
model named in `source`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WINDOW = 16  # every sliding window of the tiny families: prompts and answers go past it
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One family's tiny instance: config class, fields, tokenizer and generation ids."""

    name: str
    config_class: str  # a transformers config class
    tokenizer: str  # a key of eagle_train.families.tokenizers.TOKENIZERS
    vocab_size: int  # the published config's (>= the tokenizer's length)
    bos_token_id: int | None
    eos_token_ids: list[int]  # generation_config.json's eos_token_id
    source: str  # the published model the ids and switches are read from
    fields: dict = field(default_factory=dict)  # config fields beyond TINY
    pad_token_id: int | None = None
    switches: str = ""  # what this family exercises, for the matrix
    refused: str | None = None  # why the built-in decoder is expected to refuse it (None: it must run)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            "llama3", "LlamaConfig", "llama3_1", 128256, 128000, [128001, 128008, 128009],
            "meta-llama/Llama-3.1-8B-Instruct",
            dict(tie_word_embeddings=False, max_position_embeddings=131072, rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=8192)),
            switches="llama3 rope scaling, untied head",
        ),
        Family(
            "llama3_tied", "LlamaConfig", "llama3_1", 128256, 128000, [128001, 128008, 128009],
            "meta-llama/Llama-3.2-1B-Instruct (tied embeddings)",
            dict(tie_word_embeddings=True, max_position_embeddings=131072, rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=8192)),
            switches="llama3 rope scaling, tied head",
        ),
        Family(
            "qwen2_5", "Qwen2Config", "qwen2_5", 152064, 151643, [151645, 151643],
            "Qwen/Qwen2.5-7B-Instruct",  # Qwen2's attention ignores head_dim: 2 heads of 64 / 2 = 32
            dict(tie_word_embeddings=False, rope_theta=1000000.0, num_attention_heads=2, num_key_value_heads=1),
            pad_token_id=151643, switches="qkv bias",
        ),
        Family(
            "qwen3", "Qwen3Config", "qwen3", 151936, 151643, [151645, 151643],
            "Qwen/Qwen3-8B", dict(tie_word_embeddings=False, rope_theta=1000000.0),
            pad_token_id=151643, switches="q/k norm, thinking template",
        ),
        Family(
            "qwen3_moe", "Qwen3MoeConfig", "qwen3", 151936, 151643, [151645, 151643],
            "Qwen/Qwen3-30B-A3B",
            dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True, decoder_sparse_step=1),
            pad_token_id=151643, switches="MoE (4 experts, top 2), q/k norm",
        ),
        Family(
            "mistral", "MistralConfig", "mistral_nemo", 131072, 1, [2],
            "mistralai/Mistral-7B-v0.1 (sliding window; the tokenizer: Mistral-Nemo's tekken)",
            dict(tie_word_embeddings=False, sliding_window=WINDOW),
            switches=f"sliding window {WINDOW} on every layer",
        ),
        Family(
            "gemma3", "Gemma3TextConfig", "gemma3", 262208, 2, [1, 106],
            "google/gemma-3-27b-it (text part)",
            dict(tie_word_embeddings=True, sliding_window=WINDOW, query_pre_attn_scalar=48,
                 layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                 final_logit_softcapping=None, attn_logit_softcapping=None),
            pad_token_id=0,
            switches=f"sliding/global layers (window {WINDOW}), scaled embeddings, tied head, "
            "query_pre_attn_scalar 48 != head_dim 32",
        ),
        Family(
            "gpt_oss", "GptOssConfig", "gptoss", 201088, 199998, [200002, 199999, 200012],
            "openai/gpt-oss-20b",
            dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                 layer_types=["sliding_attention", "full_attention"] * 2, attention_bias=True),
            pad_token_id=199999,
            switches=f"MoE, attention sinks, alternating sliding window {WINDOW}, harmony template",
        ),
        Family(
            "deepseek_v3", "DeepseekV3Config", "deepseek_v3", 129280, 0, [1],
            "deepseek-ai/DeepSeek-V3",
            dict(tie_word_embeddings=False, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                 head_dim=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1, n_group=1,
                 topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                 # the published config's routing keys: transformers routes this way always, vLLM only
                 # when the config says so (without them it drops the router's correction bias and fails)
                 topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True),
            switches="MLA (q/kv LoRA ranks 32, q/k heads 32 = rope 16 + nope 16, v 32), MoE with a shared expert",
        ),
        Family(
            "phi3", "Phi3Config", "phi3", 32064, 1, [32000, 32001, 32007],
            "microsoft/Phi-3-mini-4k-instruct (sliding_window 2047 there)",
            dict(tie_word_embeddings=False, sliding_window=WINDOW, num_key_value_heads=4),
            pad_token_id=32000, switches=f"fused qkv / gate_up projections, sliding window {WINDOW}",
        ),
        Family(
            "qwen3_next", "Qwen3NextConfig", "qwen3", 151936, 151643, [151645, 151643],
            "Qwen/Qwen3-Next-80B-A3B-Instruct",
            dict(tie_word_embeddings=False, head_dim=64, num_attention_heads=2, num_key_value_heads=1,
                 layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                 linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                 shared_expert_intermediate_size=64),
            pad_token_id=151643,
            switches="hybrid: Gated DeltaNet (recurrent) + gated attention layers, MoE",
            refused="recurrent layers: tree verification with a 4-D mask cannot be exact through recurrent state",
        ),
    ]
}  # fmt: skip

# (family, head) -> vLLM's own error, in the words of each CPU it was measured on (any one of them is the
# expected refusal: which one a machine gives depends on the backend vLLM picks for its CPU); the engine test
# expects one of them, the matrix tables say "not served by vLLM"
_MLA_REFUSED = (
    # a CPU with AMX: vLLM picks its amx_mla backend, which takes only DeepSeek's published sizes (kv_lora_rank
    # 512 + rope 64 = 576) and then only bfloat16 weights (measured: "expect weight to be bfloat16"), which
    # the exact float32 comparison cannot use; the tiny MLA's sizes stop it earlier, in its weight packing
    "invalid weight input features",
    # any other CPU: its generic CPU MLA backend takes head sizes 320, 512 and 576 only (MLACommonBackend)
    "is not supported by MLA",
)
NOT_SERVED: dict[tuple[str, str], tuple[str, ...]] = {
    # vLLM's Gemma3ForCausalLM does not implement SupportsEagle3 (no aux hidden states); its EAGLE-1 head runs
    ("gemma3", "eagle3"): ("Model does not support EAGLE3 interface",),
    ("deepseek_v3", "eagle1"): _MLA_REFUSED,
    ("deepseek_v3", "eagle3"): _MLA_REFUSED,
}


def not_served(error: str, family: str | None = None, head: str | None = None) -> bool:
    """`error` is a refusal NOT_SERVED records (for (family, head) when given, else for any entry)."""
    entries = [NOT_SERVED.get((family, head), ())] if family is not None else list(NOT_SERVED.values())
    return any(words in error for words_of_one in entries for words in words_of_one)
