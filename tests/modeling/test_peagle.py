"""Multi-layer EAGLE-3 heads and P-EAGLE heads: the module, checkpoints, the engine layouts (exact keys and
config fields vLLM 0.32 reads), the importers (this project's, speculators', SpecForge's, NeMo's) and the
mask token chosen for training."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_train.heads.peagle import choose_mask_token
from eagle_train.interop.layouts import export_head, load_draft
from eagle_train.modeling.eagle3 import Eagle3Head
from eagle_train.modeling.head_checkpoint import load_head, save_head
from eagle_train.modeling.peagle import PEagleHead, target_special_ids
from eagle_train.runtime.errors import InputError
from tests.conftest import STORIES260K
from tests.interop.test_eagle3_layouts import META, VD, V, randomize

MASK = 0  # stories260K's <unk>: its tokenizer has no mask token and no unused row


def make_head(target, kind: str = "peagle", layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "peagle":
        head = PEagleHead.from_target(target.config, [1, 2, 4], VD, MASK, target=target, num_layers=layers)
    else:
        head = Eagle3Head.from_target(target.config, [1, 2, 4], VD, target=target, num_layers=layers)
    randomize(head)
    return head.eval()


def inputs(seed: int = 1, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (the mask token among them) and three random target features per position."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (1, length), generator=g)
    ids[0, -3:] = MASK
    return ids, torch.randn(1, length, 3 * 64, generator=g)


@torch.no_grad()
def test_layers_after_the_first_are_plain_prenorm_layers_under_vllms_names(target):
    head = make_head(target, "eagle3", layers=3)
    keys = set(head.trainable_state_dict())
    assert {"layers.1.input_layernorm.weight", "layers.2.self_attn.q_proj.weight"} <= keys
    assert head.layers["1"].self_attn.q_proj.in_features == 64  # d wide, not the midlayer's 2d
    ids, feats = inputs()
    one = Eagle3Head.from_target(target.config, [1, 2, 4], VD, target=target)
    one.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("layers.")})
    # layer 2 computes x + attn(norm(x)) + mlp(...) on the midlayer's output: not the one-layer head's
    assert not torch.allclose(head(ids, feats), one(ids, feats))
    x = one(ids, feats)
    cos_sin = head.rotary_emb(x, torch.arange(12)[None])
    for layer in head.layers.values():
        x = layer(x, cos_sin)
    torch.testing.assert_close(head(ids, feats), x)


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
@torch.no_grad()
def test_checkpoint_round_trip_keeps_every_layer_and_the_mask(target, tmp_path, kind):
    head = make_head(target, kind, layers=3)
    save_head(head, tmp_path / "head", {"target": "stories260k"})
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["eagle_train"]["type"] == kind
    loaded, _ = load_head(tmp_path / "head", target=target)
    assert type(loaded) is type(head) and loaded.config.num_hidden_layers == 3
    ids, feats = inputs()
    torch.testing.assert_close(loaded(ids, feats), head(ids, feats))
    if kind == "peagle":
        assert config["mask_token_id"] == config["pard_token"] == MASK and loaded.mask_token_id == MASK
        assert set(load_file(str(tmp_path / "head" / "model.safetensors"))) >= {
            "mask_hidden",
            "mask_embedding",
        }


@torch.no_grad()
def test_only_the_mask_tokens_row_is_learned(target):
    head = make_head(target)
    ids, _ = inputs()
    embeds = head.embed(ids)[0]
    torch.testing.assert_close(embeds[:-3], target.embed_tokens.weight[ids[0, :-3]])
    assert torch.equal(embeds[-1], head.mask_embedding) and not torch.equal(
        head.mask_embedding, target.embed_tokens.weight[MASK]
    )
    assert not any(p is target.embed_tokens.weight for p in head.parameters())  # the rest stays frozen
    assert head.mask_hidden.shape == (1, 1, 3 * 64) and head.mask_embedding.shape == (64,)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
@torch.no_grad()
def test_engine_layouts_carry_what_vllm_loads_for_parallel_drafting(target, tmp_path, fmt):
    head = make_head(target)
    out = export_head(head, fmt, tmp_path / fmt, META, speculative_tokens=5)
    state, config = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    assert state["mask_hidden"].shape == (1, 1, 192) and "mask_embedding" not in state
    embed = state["embed_tokens.weight"]  # the whole embedding: vLLM keeps its own when it differs
    assert torch.equal(embed[MASK], head.mask_embedding) and torch.equal(
        embed[3:], target.embed_tokens.weight[3:]
    )
    first = "midlayer." if fmt == "vllm" else "layers.0."
    assert f"{first}hidden_norm.weight" in state and "layers.1.self_attn.q_proj.weight" in state
    assert state["layers.1.self_attn.q_proj.weight"].shape == (64, 64)
    if fmt == "vllm":  # route B: an EAGLE-3 directory with vLLM's pard_token (mask_token_id read first)
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 2
        assert config["pard_token"] == config["mask_token_id"] == MASK
    else:  # route A: vLLM maps peagle to eagle3 + parallel_drafting, mask_token_id to pard_token
        assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == MASK
        assert config["transformer_layer_config"]["num_hidden_layers"] == 2
        assert config["norm_before_residual"] is False
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    loaded = load_draft(out, target)
    ids, feats = inputs()
    assert isinstance(loaded, PEagleHead) and loaded.mask_token_id == MASK
    torch.testing.assert_close(loaded(ids, feats), head(ids, feats))


@pytest.mark.parametrize("fmt", ["sglang", "eagle"])
@pytest.mark.parametrize("kind, layers", [("eagle3", 2), ("peagle", 1)])
def test_layouts_that_would_run_another_function_are_refused(target, tmp_path, fmt, kind, layers):
    head = make_head(target, kind, layers=layers)
    with pytest.raises(ValueError, match=f"format={fmt}: .*export with format=vllm or format=speculators"):
        export_head(head, fmt, tmp_path / fmt, META, embed_tokens=target.embed_tokens.weight)
    assert not (tmp_path / fmt).exists()


def specforge_layout(head, target, path, mask_in_config: bool) -> None:
    """SpecForge's P-EAGLE export as its `PEagleDraftModel` saves it: `layers.0.*` for the first layer,
    its whole (trained) embedding, config.json without a mask token."""
    state = {k.replace("midlayer.", "layers.0."): v for k, v in head.trainable_state_dict().items()}
    state.pop("mask_embedding")
    state["embed_tokens.weight"] = head.serving_embedding()
    state["embed_tokens.weight"][5] += 1.0  # SpecForge trains every row: the file's, not the target's
    path.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    config = {**target.config.to_dict(), "architectures": ["PEagleDraftModel"], "num_hidden_layers": 2,
              "draft_vocab_size": VD, "eagle_aux_hidden_state_layer_ids": [1, 2, 4]}  # fmt: skip
    if mask_in_config:
        config["mask_token_id"] = MASK
    (path / "config.json").write_text(json.dumps(config))


@torch.no_grad()
def test_a_specforge_head_without_its_mask_token_asks_for_it(target, tmp_path):
    head = make_head(target)
    specforge_layout(head, target, tmp_path / "specforge", mask_in_config=False)
    with pytest.raises(ValueError, match="names no mask token .*draft.mask_token_id=N"):
        load_draft(tmp_path / "specforge", target)
    loaded = load_draft(tmp_path / "specforge", target, mask_token_id=MASK)
    ids, feats = inputs()
    ids[0, 0] = 5
    reference = head(ids, feats)  # differs from the file's at token 5 only
    assert not torch.allclose(loaded(ids, feats), reference)
    ids[0, 0] = 6
    torch.testing.assert_close(loaded(ids, feats), head(ids, feats))
    with pytest.raises(ValueError, match="records mask token 0, not the given 3"):
        specforge_layout(head, target, tmp_path / "named", mask_in_config=True)
        load_draft(tmp_path / "named", target, mask_token_id=3)


@torch.no_grad()
def test_a_nemo_head_with_model_prefixes_loads(target, tmp_path):
    head = make_head(target, layers=1)
    state = {
        f"model.{k.replace('midlayer.', 'layers.0.')}": v for k, v in head.trainable_state_dict().items()
    }
    state["lm_head.weight"] = state.pop("model.lm_head.weight")
    del state["model.mask_embedding"]
    state["model.embed_tokens.weight"] = head.serving_embedding()
    (tmp_path / "nemo").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "nemo" / "model.safetensors"))
    config = {**target.config.to_dict(), "architectures": ["LlamaPEagleDraftModel"], "draft_vocab_size": VD,
              "mask_token_id": MASK, "parallel_drafting": True, "eagle_aux_hidden_state_layer_ids": [1, 2, 4]}  # fmt: skip
    (tmp_path / "nemo" / "config.json").write_text(json.dumps(config))
    loaded = load_draft(tmp_path / "nemo", target)
    ids, feats = inputs()
    assert isinstance(loaded, PEagleHead) and loaded.config.num_hidden_layers == 1
    torch.testing.assert_close(loaded(ids, feats), head(ids, feats))


def test_the_mask_token_is_one_the_data_never_holds(target):
    tok, unused = target.tokenizer, torch.zeros(V, dtype=torch.bool)
    special = target_special_ids(target)
    assert special == {1: "the target's BOS token", 2: "the target's EOS token"}  # stop id 1 is BOS here
    assert choose_mask_token(tok, V, special, unused) == (0, "the unknown token")
    held = unused.clone()
    held[0] = True  # <unk> occurs in the data: no other candidate (no mask token, no free row)
    with pytest.raises(
        InputError, match=r"tried: the unknown token: 0 occurs in the training data.*draft.mask_token_id"
    ):
        choose_mask_token(tok, V, special, held)
    # a vocabulary padded past the tokenizer: the first free row comes before <unk>
    assert choose_mask_token(tok, V + 8, special, torch.zeros(V + 8, dtype=torch.bool))[0] == V
    assert choose_mask_token(tok, V, special, held, explicit=7) == (7, "draft.mask_token_id")
    for bad, why in ((0, "in the training data"), (1, "BOS"), (2, "EOS"), (V, "outside the vocabulary")):
        with pytest.raises(InputError, match=f"draft.mask_token_id: {bad} .*{why}"):
            choose_mask_token(tok, V, special, held, explicit=bad)


@pytest.mark.parametrize(
    "value, message",
    [
        (None, r"config.json: mask_token_id: missing"),
        ("zero", r"config.json: mask_token_id: 'zero' is not an integer token id"),
        (1, r"config.json: mask_token_id: 1 is the target's BOS token"),
        (2, r"config.json: mask_token_id: 2 is the target's EOS token"),
        (V + 5, rf"config.json: mask_token_id: {V + 5} is outside the vocabulary \[0, {V}\)"),
    ],
)
def test_a_head_whose_mask_token_the_target_emits_or_that_is_not_an_id_is_refused_at_import(
    target, tmp_path, value, message
):
    """A P-EAGLE checkpoint whose config.json records no mask token, a non-integer, an id outside the
    vocabulary or BOS / EOS: refused by both importers, naming the file and the key (this project's
    loader checks the type and range; the target's special ids need the target, which load_draft has)."""
    head = make_head(target)
    save_head(head, tmp_path / "head", {"target": "stories260k"})
    config_file = tmp_path / "head" / "config.json"
    config = json.loads(config_file.read_text())
    for key in ("mask_token_id", "pard_token"):
        config.pop(key)
    if value is not None:
        config["mask_token_id"] = value
    config_file.write_text(json.dumps(config))
    with pytest.raises(InputError, match=message):
        load_draft(tmp_path / "head", target)
    if value in (None, "zero", V + 5):
        with pytest.raises(InputError, match=message):
            load_head(tmp_path / "head", target=target)


@pytest.mark.parametrize("importer", ["load_head", "load_draft"])
def test_a_mask_hidden_of_the_wrong_shape_is_refused_naming_the_file(target, tmp_path, importer):
    head = make_head(target)
    save_head(head, tmp_path / "head", {"target": "stories260k"})
    weights = tmp_path / "head" / "model.safetensors"
    state = load_file(str(weights))
    state["mask_hidden"] = torch.zeros(1, 1, 64)  # one feature wide, not three
    save_file(state, str(weights))
    config_file = tmp_path / "head" / "config.json"
    config = json.loads(config_file.read_text())
    del config["eagle_train"]["weights_sha256"]  # edited on purpose
    config_file.write_text(json.dumps(config))
    with pytest.raises(
        InputError, match=r"model.safetensors: mask_hidden has shape \[1, 1, 64\]; .*\[1, 1, 192\]"
    ):
        if importer == "load_head":
            load_head(tmp_path / "head", target=target)
        else:
            load_draft(tmp_path / "head", target)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_export_refuses_a_head_whose_mask_token_the_target_emits(target, tmp_path, fmt):
    """A head trained with BOS as its placeholder would replace BOS's embedding row and give vLLM
    `pard_token: 1`: export refuses it, naming the checkpoint's config.json and the key, and writes nothing."""
    from eagle_train.config.base import to_schema
    from eagle_train.config.export import ExportConfig
    from eagle_train.export import run as export

    torch.manual_seed(0)
    head = PEagleHead.from_target(target.config, [1, 2, 4], VD, 1, target=target, num_layers=1)
    randomize(head)
    meta = {"target": {"name": "stories260k", "source": str(STORIES260K), "stop_token_ids": [1]}}
    save_head(head, tmp_path / "head", meta)
    cfg = to_schema(
        {"ckpt": str(tmp_path / "head"), "format": fmt, "out_dir": str(tmp_path / "out")}, ExportConfig
    )
    with pytest.raises(InputError, match=r"head/config.json: mask_token_id: 1 is the target's BOS token"):
        export(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
@torch.no_grad()
def test_a_wider_mlp_is_the_heads_own_and_loads_back_from_its_exports(target, tmp_path, kind):
    """draft.intermediate_size: the head's MLP width (the target's 172 by default); config.json records it,
    so this project's checkpoint and the vLLM export load back as the same function."""
    from eagle_train.config.draft import DraftConfig

    cls = PEagleHead if kind == "peagle" else Eagle3Head
    args = (MASK,) if kind == "peagle" else ()
    torch.manual_seed(0)
    head = cls.from_target(
        target.config, [1, 2, 4], VD, *args, target=target, num_layers=2, intermediate_size=96
    )
    randomize(head)
    head.eval()
    default = make_head(target, kind)
    assert default.midlayer.mlp.gate_proj.weight.shape == (172, 64)
    assert head.midlayer.mlp.gate_proj.weight.shape == head.layers["1"].mlp.up_proj.weight.shape == (96, 64)
    assert head.midlayer.mlp.down_proj.weight.shape == (64, 96)
    ids, feats = inputs()
    save_head(head, tmp_path / "head", {"target": "stories260k"})
    assert json.loads((tmp_path / "head" / "config.json").read_text())["intermediate_size"] == 96
    out = export_head(head, "vllm", tmp_path / "vllm", META, speculative_tokens=5)
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 96
    for path in (tmp_path / "head", out):
        loaded = load_draft(path, target)
        assert loaded.config.intermediate_size == 96
        torch.testing.assert_close(loaded(ids, feats), head(ids, feats))
    with pytest.raises(ValueError, match="draft.intermediate_size must be >= 1"):
        DraftConfig(type=kind, intermediate_size=0)
