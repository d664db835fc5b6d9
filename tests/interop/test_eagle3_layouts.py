"""EAGLE-3 export layouts (exact keys, shapes and config fields per consumer) and the importer (round
trips, the reference's and SpecForge's published layouts, speculators, refusals)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_train.interop.layouts import export_head, load_draft, load_input_embedding
from eagle_train.modeling.eagle3 import Eagle3Head
from eagle_train.modeling.head_checkpoint import load_head, save_head
from tests.conftest import STORIES260K
from tests.interop.test_layouts import reference_config_json

D, V, VD = 64, 512, 256
KEPT = torch.arange(0, 512, 2)  # a 256-token draft vocabulary: the even ids
META = {
    "target": "stories260k",
    "target_source": str(STORIES260K),
    "max_len": 512,
    "target_architectures": ["LlamaForCausalLM"],
}
MIDLAYER = {
    "midlayer.input_layernorm.weight": (D,),
    "midlayer.hidden_norm.weight": (D,),
    "midlayer.self_attn.q_proj.weight": (D, 2 * D),
    "midlayer.self_attn.k_proj.weight": (32, 2 * D),
    "midlayer.self_attn.v_proj.weight": (32, 2 * D),
    "midlayer.self_attn.o_proj.weight": (D, D),
    "midlayer.mlp.gate_proj.weight": (172, D),
    "midlayer.mlp.up_proj.weight": (172, D),
    "midlayer.mlp.down_proj.weight": (D, 172),
    "midlayer.post_attention_layernorm.weight": (D,),
}
SERVING = {
    "fc.weight": (D, 3 * D),
    **MIDLAYER,
    "norm.weight": (D,),
    "lm_head.weight": (VD, D),
    "d2t": (VD,),
    "t2d": (V,),
}


def make_head(target, vocab=VD, fc_norm=False, norm_output=False, seed=0, aux=(1, 2, 4)) -> Eagle3Head:
    """Every trained weight random (norms too), a reduced vocabulary, the target's embedding shared."""
    torch.manual_seed(seed)
    head = Eagle3Head.from_target(target.config, list(aux), vocab, fc_norm, norm_output)
    randomize(head)
    head.share_target_weights(target)
    return head.eval()


def randomize(head) -> None:
    """Every trained weight random (norms near 1) and the draft vocabulary KEPT (or the whole one)."""
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[KEPT if head.draft_vocab_size == VD else torch.arange(V)] = True
    head.set_vocabulary(t2d)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad:
                p.copy_(
                    torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.2) + (1.0 if "norm" in name else 0.0)
                )


def outputs(head) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft logits of a 2-step unroll [2, 7, draft vocab], the target ids of the top-1) on fixed inputs."""
    g = torch.Generator().manual_seed(1)
    ids, feats = torch.randint(0, V, (2, 7), generator=g), torch.randn(2, 7, 3 * D, generator=g)
    with torch.no_grad():
        state = head(ids, feats)
        logits = head.logits(head(ids, state, torch.arange(1, 8)[None]))
    return logits, head.vocab_map[logits.argmax(-1)]


def shapes(state: dict) -> dict:
    return {k: tuple(v.shape) for k, v in state.items()}


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_vllm_and_sglang_layouts(target, tmp_path, fmt):
    head = make_head(target)
    out = export_head(head, fmt, tmp_path / fmt, meta=META)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    state = load_file(str(out / "model.safetensors"))
    assert shapes(state) == SERVING
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert torch.equal(state["d2t"] + torch.arange(VD), KEPT)  # target id = i + d2t[i]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == V and config["draft_vocab_size"] == VD
    assert config["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 4],
        "use_aux_hidden_state": True,
    }
    assert config["target_hidden_size"] == D and config["tie_word_embeddings"] is False
    assert (
        config["fc_norm"] is False
        and config["norm_output"] is False
        and config["norm_before_residual"] is False
    )
    assert "bias" not in config and config["eagle_train"]["type"] == "eagle3"
    imported = load_draft(out, target)
    assert isinstance(imported, Eagle3Head) and imported.aux_layers == [1, 2, 4]
    assert all(torch.equal(a, b) for a, b in zip(outputs(imported), outputs(head), strict=True))


def test_eagle31_switches_go_to_vllm_and_speculators_only(target, tmp_path):
    head = make_head(target, fc_norm=True, norm_output=True)
    out = export_head(head, "vllm", tmp_path / "v", meta=META)
    state = load_file(str(out / "model.safetensors"))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(state)
    config = json.loads((out / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    imported = load_draft(out, target)
    assert imported.fc_norm_enabled and imported.norm_output
    assert all(torch.equal(a, b) for a, b in zip(outputs(imported), outputs(head), strict=True))
    for fmt in ("sglang", "eagle"):
        with pytest.raises(ValueError, match="no fc_norm / norm_output"):
            export_head(head, fmt, tmp_path / fmt, embed_tokens=target.embed_tokens.weight)
        assert not (tmp_path / fmt).exists()


def test_speculators_layout(target, tmp_path):
    head = make_head(target, fc_norm=True)
    out = export_head(head, "speculators", tmp_path / "s", meta=META, speculative_tokens=5)
    config = json.loads((out / "config.json").read_text())
    assert "model_type" not in config  # vLLM reads a top-level model_type instead of speculators_config
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == V
    assert layer["hidden_size"] == D and layer["head_dim"] == 8 and layer["num_key_value_heads"] == 4
    assert config["draft_vocab_size"] == VD and config["target_hidden_size"] == D
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4] and config["fc_norm"] is True
    assert config["norm_before_residual"] is False  # the format's default is True: another head
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"] == {"name_or_path": str(STORIES260K), "architectures": ["LlamaForCausalLM"]}
    state = load_file(str(out / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in SERVING.items()}
    assert shapes(state) == {**renamed, **{f"fc_norm.{i}.weight": (D,) for i in range(3)}}
    imported = load_draft(out, target)
    assert all(torch.equal(a, b) for a, b in zip(outputs(imported), outputs(head), strict=True))


def test_speculators_has_no_eagle1_type(target, tmp_path):
    from eagle_train.modeling.draft import DraftHead

    with pytest.raises(ValueError, match="no EAGLE-1 head type"):
        export_head(DraftHead.from_target(target.config), "speculators", tmp_path / "s")


def test_eagle_reference_layout(target, tmp_path):
    head = make_head(target)
    embed = load_input_embedding(STORIES260K)
    out = export_head(head, "eagle", tmp_path / "e", meta=META, embed_tokens=embed, dtype=torch.float16)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "pytorch_model.bin"]
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert shapes(state) == {**SERVING, "embed_tokens.weight": (V, D)}
    assert all(v.dtype == torch.float16 for k, v in state.items() if k not in ("d2t", "t2d"))
    config = json.loads((out / "config.json").read_text())
    # the reference loads the base model's embedding only without target_hidden_size; it gets the file's
    assert "target_hidden_size" not in config and "fc_norm" not in config
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == VD
    assert config["rope_scaling"] is None and "rope_parameters" not in config
    imported = load_draft(out, target)
    logits, _ = outputs(imported)
    torch.testing.assert_close(logits, outputs(head)[0], rtol=0.05, atol=0.05)  # fp16 weights


def test_a_full_vocabulary_head_ships_no_map(target, tmp_path):
    head = make_head(target, vocab=V)
    out = export_head(head, "vllm", tmp_path / "v", meta=META)
    state = load_file(str(out / "model.safetensors"))
    assert "d2t" not in state and "t2d" not in state  # vLLM builds no draft-to-target map for it
    imported = load_draft(out, target)
    assert torch.equal(imported.vocab_map, torch.arange(V)) and bool(imported.t2d.all())
    assert all(torch.equal(a, b) for a, b in zip(outputs(imported), outputs(head), strict=True))


def test_project_checkpoint_round_trip(target, tmp_path):
    head = make_head(target, norm_output=True)
    save_head(head, tmp_path / "ckpt", {"target": {"name": "stories260k"}})
    loaded, meta = load_head(tmp_path / "ckpt")
    loaded.share_target_weights(target)
    assert meta["type"] == "eagle3" and loaded.norm_output and loaded.aux_layers == [1, 2, 4]
    assert all(torch.equal(a, b) for a, b in zip(outputs(loaded.eval()), outputs(head), strict=True))
    assert all(
        torch.equal(a, b)
        for a, b in zip(outputs(load_draft(tmp_path / "ckpt", target)), outputs(head), strict=True)
    )


def reference_eagle3_config(**extra) -> dict:
    """config.json as the reference (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) and SpecForge
    (configs/llama3-8B-eagle3.json) publish it: the EAGLE-1 keys, the EAGLE-3 architecture and draft
    vocabulary, no aux layer ids."""
    return reference_config_json(
        **{
            "architectures": ["LlamaForCausalLMEagle3"],
            "rope_theta": 10000.0,
            "draft_vocab_size": VD,
            **extra,
        }
    )


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.safetensors"])
def test_reference_and_specforge_heads_import_with_the_reference_layers(target, tmp_path, weights):
    """No layer ids in the config: the reference's (2, L//2, L-3), here [2, 2, 2], as vLLM and SGLang
    assume; the reference's `model.`-less keys, SpecForge's identical ones."""
    head = make_head(target, aux=(2, 2, 2))
    state = {k: v.clone() for k, v in head.trainable_state_dict().items()}
    if weights.endswith(".bin"):
        torch.save(state, tmp_path / weights)
    else:
        save_file(state, str(tmp_path / weights))
    (tmp_path / "config.json").write_text(json.dumps(reference_eagle3_config()))
    imported = load_draft(tmp_path, target)
    assert imported.aux_layers == [2, 2, 2] and imported.draft_vocab_size == VD
    assert all(torch.equal(a, b) for a, b in zip(outputs(imported), outputs(head), strict=True))
    # and it decodes: the EAGLE-2 tree with it emits plain decoding's tokens
    from eagle_train.config.decode import DecodeConfig
    from eagle_train.decoding.decoder import SpeculativeDecoder

    prompt = [1, 403, 407, 261, 378, 432, 383, 286, 261, 280, 294, 426]
    ar = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=24)).generate(prompt)
    tree = DecodeConfig(method="dynamic_tree", depth=3, top_k=4, total_tokens=12, max_new_tokens=24)
    assert SpeculativeDecoder(target, imported, tree).generate(prompt).tokens == ar.tokens


def test_a_full_vocabulary_reference_head_without_d2t(target, tmp_path):
    """The reference drops d2t/t2d when draft_vocab_size == vocab_size."""
    head = make_head(target, vocab=V, aux=(2, 2, 2))
    state = {k: v for k, v in head.trainable_state_dict().items() if k not in ("d2t", "t2d")}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(reference_eagle3_config(draft_vocab_size=V)))
    imported = load_draft(tmp_path, target)
    assert all(torch.equal(a, b) for a, b in zip(outputs(imported), outputs(head), strict=True))


def test_bad_eagle3_heads_are_refused(target, tmp_path):
    head = make_head(target)
    state = dict(head.trainable_state_dict())
    (tmp_path / "config.json").write_text(json.dumps(reference_eagle3_config()))
    save_file(
        {k: v for k, v in state.items() if k != "d2t" and k != "t2d"}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(ValueError, match="needs d2t"):
        load_draft(tmp_path, target)
    save_file({**state, "fc.weight": torch.zeros(D, 2 * D)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fusing 128 features does not match the target's 64"):
        load_draft(tmp_path, target)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(reference_eagle3_config(norm_before_residual=True)))
    with pytest.raises(ValueError, match="norm_before_residual"):
        load_draft(tmp_path, target)
    (tmp_path / "config.json").write_text(
        json.dumps(reference_eagle3_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}))
    )
    with pytest.raises(ValueError, match=r"ids \[9\] are not layers of this 5-layer target"):
        load_draft(tmp_path, target)
