"""Export layouts (exact keys, shapes, config fields per consumer) and the importer (round trips,
reference heads, bad input)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_train.interop.layouts import export_head, load_draft, load_input_embedding
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.head_checkpoint import save_head
from tests.conftest import STORIES260K

D, V = 64, 512
LAYER_KEYS = {
    "layers.0.self_attn.q_proj.weight": (64, 64),
    "layers.0.self_attn.k_proj.weight": (32, 64),
    "layers.0.self_attn.v_proj.weight": (32, 64),
    "layers.0.self_attn.o_proj.weight": (64, 64),
    "layers.0.mlp.gate_proj.weight": (172, 64),
    "layers.0.mlp.up_proj.weight": (172, 64),
    "layers.0.mlp.down_proj.weight": (64, 172),
    "layers.0.post_attention_layernorm.weight": (64,),
}
ATTN_BIAS_KEYS = {
    f"layers.0.self_attn.{p}_proj.bias": (n,) for p, n in (("q", 64), ("k", 32), ("v", 32), ("o", 64))
}


def make_head(target, fc_bias: bool = True, seed: int = 0, num_layers: int = 1) -> DraftHead:
    """A head with every trainable weight random (norms and the fc bias too), sharing the target's weights."""
    torch.manual_seed(seed)
    head = DraftHead.from_target(target.config, num_layers=num_layers, fc_bias=fc_bias)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("fc.", "layers.")):
                p.copy_(
                    torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.2) + (1.0 if "norm" in name else 0.0)
                )
    head.share_target_weights(target)
    return head.eval()


def head_outputs(head: DraftHead, seed: int = 1) -> torch.Tensor:
    """Draft logits [2, 7, vocab] on fixed random features and tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 7), generator=g)
    feats = torch.randn(2, 7, D, generator=g)
    with torch.no_grad():
        return head.logits(head(ids, feats))


def shapes(state: dict) -> dict:
    return {k: tuple(v.shape) for k, v in state.items()}


META = {"target": "stories260k", "target_source": str(STORIES260K), "max_len": 512}


def test_sglang_layout(target, tmp_path):
    head = make_head(target, fc_bias=True)
    out = export_head(head, "sglang", tmp_path / "sg", meta=META)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    state = load_file(str(out / "model.safetensors"))
    assert shapes(state) == {"fc.weight": (D, 2 * D), "fc.bias": (D,), **LAYER_KEYS}
    assert torch.equal(state["fc.bias"], head.fc.bias.detach())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == D and config["vocab_size"] == V
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None
    assert config["eagle_train"]["target"] == "stories260k" and config["eagle_train"]["max_len"] == 512
    assert "bias" not in config  # vLLM/SGLang read a top-level `bias` as ATTENTION bias
    assert not config["attention_bias"]


def test_sglang_gets_a_zero_fc_bias_when_trained_without(target, tmp_path):
    head = make_head(target, fc_bias=False)
    state = load_file(str(export_head(head, "sglang", tmp_path / "sg") / "model.safetensors"))
    assert torch.equal(state["fc.bias"], torch.zeros(D))
    torch.testing.assert_close(head_outputs(load_draft(tmp_path / "sg", target)), head_outputs(head))


def test_vllm_layout_without_bias_is_plain(target, tmp_path):
    head = make_head(target, fc_bias=False)
    out = export_head(head, "vllm", tmp_path / "v", meta=META)
    state = load_file(str(out / "model.safetensors"))
    assert shapes(state) == {"fc.weight": (D, 2 * D), **LAYER_KEYS}
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["attention_bias"] is False
    assert torch.equal(head_outputs(load_draft(out, target)), head_outputs(head))


def test_vllm_folds_a_trained_fc_bias_exactly(target, tmp_path):
    head = make_head(target, fc_bias=True)
    out = export_head(head, "vllm", tmp_path / "v", meta=META)
    state = load_file(str(out / "model.safetensors"))
    assert shapes(state) == {"fc.weight": (D, 2 * D), **LAYER_KEYS, **ATTN_BIAS_KEYS}  # no fc.bias
    config = json.loads((out / "config.json").read_text())
    assert config["attention_bias"] is True and config["eagle_train"]["fc_bias_folded"] is True
    imported = load_draft(out, target)
    assert imported.fc.bias is None
    torch.testing.assert_close(
        head_outputs(imported), head_outputs(head), rtol=1e-4, atol=1e-4
    )  # rounding only
    # dropping the bias instead (what vLLM does to an unfolded fc.bias) really changes the outputs
    with torch.no_grad():
        imported.layers[0].self_attn.o_proj.bias.zero_()
    assert not torch.allclose(head_outputs(imported), head_outputs(head), atol=1e-3)


def test_vllm_fold_with_two_layers(target, tmp_path):
    head = make_head(target, fc_bias=True, num_layers=2)
    state = load_file(str(export_head(head, "vllm", tmp_path / "v") / "model.safetensors"))
    assert "layers.1.input_layernorm.weight" in state and "layers.0.input_layernorm.weight" not in state
    assert torch.equal(
        state["layers.1.self_attn.o_proj.bias"], torch.zeros(D)
    )  # attention_bias: every layer has one
    imported = load_draft(tmp_path / "v", target)
    assert len(imported.layers) == 2
    torch.testing.assert_close(head_outputs(imported), head_outputs(head), rtol=1e-4, atol=1e-4)


def test_vllm_refuses_a_bias_when_asked(target, tmp_path):
    with pytest.raises(ValueError, match="draft.fc_bias=false"):
        export_head(make_head(target), "vllm", tmp_path / "v", fold_bias=False)
    assert not (tmp_path / "v").exists()


def test_eagle_reference_layout(target, tmp_path):
    head = make_head(target, fc_bias=True)
    embed = load_input_embedding(STORIES260K)
    assert torch.equal(embed, target.embed_tokens.weight)
    out = export_head(head, "eagle", tmp_path / "e", meta=META, embed_tokens=embed, dtype=torch.float16)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "pytorch_model.bin"]
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert shapes(state) == {
        "fc.weight": (D, 2 * D),
        "fc.bias": (D,),
        "embed_tokens.weight": (V, D),
        **LAYER_KEYS,
    }
    assert all(v.dtype == torch.float16 for v in state.values())
    config = json.loads((out / "config.json").read_text())
    assert config["bias"] is True and config["rope_scaling"] is None and config["rope_theta"] == 10000.0
    assert config["num_hidden_layers"] == 1 and config["torch_dtype"] == "float16"
    assert "rope_parameters" not in config
    imported = load_draft(out, target)
    torch.testing.assert_close(
        head_outputs(imported), head_outputs(head), rtol=0.05, atol=0.05
    )  # fp16 weights


def test_eagle_export_needs_the_embedding(target, tmp_path):
    with pytest.raises(ValueError, match="embed_tokens"):
        export_head(make_head(target), "eagle", tmp_path / "e")


def test_unknown_format(target, tmp_path):
    with pytest.raises(ValueError, match="unknown export format 'onnx'"):
        export_head(make_head(target), "onnx", tmp_path / "x")


def test_project_checkpoint_round_trip(target, tmp_path):
    head = make_head(target, fc_bias=True)
    save_head(head, tmp_path / "ckpt", META)
    assert torch.equal(head_outputs(load_draft(tmp_path / "ckpt", target)), head_outputs(head))


def reference_config_json(**extra) -> dict:
    """config.json as the reference publishes its EAGLE-1/2 heads (transformers 4 era, EConfig keys)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": D,
        "initializer_range": 0.02,
        "intermediate_size": 172,
        "max_position_embeddings": 512,
        "model_type": "llama",
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": V,
        **extra,
    }


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.safetensors"])
def test_reference_head_import(target, tmp_path, weights):
    head = make_head(target, fc_bias=True)
    state = {k: v.clone() for k, v in head.trainable_state_dict().items()}
    state["embed_tokens.weight"] = torch.randn(V, D)  # ignored: the target's embedding is used
    if weights.endswith(".bin"):
        torch.save(state, tmp_path / weights)
    else:
        save_file(state, str(tmp_path / weights))
    (tmp_path / "config.json").write_text(json.dumps(reference_config_json()))
    imported = load_draft(tmp_path, target)
    assert torch.equal(imported.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(head_outputs(imported), head_outputs(head))


def test_an_incomplete_eagle3_head_is_refused(target, tmp_path):
    """EAGLE-3 heads are imported (tests/interop/test_eagle3_layouts.py); a partial one is refused."""
    save_file(
        {
            "fc.weight": torch.zeros(D, 3 * D),
            "midlayer.self_attn.q_proj.weight": torch.zeros(D, 2 * D),
            "d2t": torch.zeros(V, dtype=torch.long),
        },
        str(tmp_path / "model.safetensors"),
    )
    (tmp_path / "config.json").write_text(
        json.dumps(reference_config_json(architectures=["LlamaForCausalLMEagle3"]))
    )
    with pytest.raises(ValueError, match="no norm.weight: not a complete EAGLE-3 head"):
        load_draft(tmp_path, target)


def test_hidden_size_mismatch_is_refused(target, tmp_path):
    torch.save(
        {
            "fc.weight": torch.zeros(128, 256),
            "fc.bias": torch.zeros(128),
            "layers.0.post_attention_layernorm.weight": torch.ones(128),
        },
        tmp_path / "pytorch_model.bin",
    )
    (tmp_path / "config.json").write_text(json.dumps(reference_config_json(hidden_size=128)))
    with pytest.raises(ValueError, match="hidden size 128 .* does not match the target's 64"):
        load_draft(tmp_path, target)


def test_missing_files_and_pickles_with_code(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_draft(tmp_path / "nope", target)
    (tmp_path / "config.json").write_text(json.dumps(reference_config_json()))
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_draft(tmp_path, target)
    torch.save(
        {"fc.weight": torch.zeros(D, 2 * D), "evil": torch.nn.Linear(2, 2)}, tmp_path / "pytorch_model.bin"
    )
    with pytest.raises(ValueError, match="pytorch_model.bin: not a plain tensor state dict"):
        load_draft(tmp_path, target)


def sglang_parameters(config: dict) -> set[str]:
    """The parameters SGLang's LlamaForCausalLMEagle builds for this config, as read in its source
    (srt/models/llama_eagle.py + llama.py): fused qkv/gate_up, layer 0 without input_layernorm, MLP without
    bias, attention biases iff attention_bias (or `bias`), fc with a bias; embed_tokens/lm_head come from the target."""
    params = {"model.fc.weight", "model.fc.bias"}
    attn_bias = bool(config.get("attention_bias") or config.get("bias"))
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        params |= {
            prefix + n
            for n in (
                "self_attn.qkv_proj.weight",
                "self_attn.o_proj.weight",
                "mlp.gate_up_proj.weight",
                "mlp.down_proj.weight",
                "post_attention_layernorm.weight",
            )
        }
        if attn_bias:
            params |= {prefix + "self_attn.qkv_proj.bias", prefix + "self_attn.o_proj.bias"}
        if i > 0:
            params.add(prefix + "input_layernorm.weight")
    return params


def sglang_loaded_name(key: str) -> str:
    """What SGLang's load_weights turns a file key into ("model." prefix, stacked projections)."""
    name = key if "lm_head" in key else "model." + key
    for shard, fused in (
        (".q_proj", ".qkv_proj"),
        (".k_proj", ".qkv_proj"),
        (".v_proj", ".qkv_proj"),
        (".gate_proj", ".gate_up_proj"),
        (".up_proj", ".gate_up_proj"),
    ):
        if shard in name:
            return name.replace(shard, fused)
    return name


@pytest.mark.parametrize("fc_bias,num_layers", [(True, 1), (False, 1), (True, 2)])
def test_sglang_export_fills_every_parameter_its_loader_builds(target, tmp_path, fc_bias, num_layers):
    """No key SGLang would warn about or skip, and no parameter of its module left unloaded."""
    out = export_head(make_head(target, fc_bias=fc_bias, num_layers=num_layers), "sglang", tmp_path / "sg")
    config = json.loads((out / "config.json").read_text())
    loaded = {sglang_loaded_name(k) for k in load_file(str(out / "model.safetensors"))}
    assert loaded == sglang_parameters(config)
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["hidden_act"] == "silu"


def test_sglang_refuses_what_its_layer_cannot_hold(target, tmp_path):
    head = make_head(target)
    head.config.mlp_bias = True
    with pytest.raises(ValueError, match="SGLang's LlamaMLP has no biases"):
        export_head(head, "sglang", tmp_path / "sg")
