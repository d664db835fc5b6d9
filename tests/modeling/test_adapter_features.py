"""The target adapter returns the LM head's input: lm_head(hidden) == logits, on real and random models."""

from __future__ import annotations

import shutil
from dataclasses import replace

import huggingface_hub.constants
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from eagle_train.config import TargetConfig
from eagle_train.config.base import CONF_DIR, to_schema
from eagle_train.modeling.frozen import load_frozen_target
from eagle_train.modeling.target import load_target
from eagle_train.runtime.errors import InputError
from tests.conftest import STORIES260K, TINY_SHAPE


def test_stories260k_hidden_is_lm_head_input(target):
    ids = torch.tensor([[1, 403, 407, 261, 378, 432, 383, 286, 261]])
    logits, hidden = target.features(ids)
    assert hidden.shape == (1, 9, 64) and logits.shape == (1, 9, 512)
    assert torch.equal(target.lm_head(hidden), logits)
    # and it is the stock model's own output, with the stock config's output_hidden_states path
    out = target.model(ids, output_hidden_states=True)
    assert torch.equal(out.hidden_states[-1], hidden)
    assert torch.allclose(out.logits, logits)


def test_target_is_frozen_and_in_eval_mode(target):
    assert not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())
    assert target.hidden_size == 64 and target.vocab_size == 512 and target.max_len == 512
    assert target.stop_token_ids[0] == 1 and 2 in target.stop_token_ids


def test_padding_does_not_change_real_positions(target):
    ids = torch.tensor([[1, 403, 407, 261, 378], [1, 403, 407, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    _, hidden = target.features(ids, mask)
    _, alone = target.features(ids[1:, :3])
    torch.testing.assert_close(hidden[1, :3], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "config_cls, model_cls",
    [(Qwen2Config, Qwen2ForCausalLM), (MistralConfig, MistralForCausalLM)],
    ids=["qwen2", "mistral"],
)
def test_random_models_hidden_is_lm_head_input(tmp_path, config_cls, model_cls):
    torch.manual_seed(0)
    cfg = config_cls(**TINY_SHAPE, max_position_embeddings=128, tie_word_embeddings=False)
    model_cls(cfg).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(STORIES260K).save_pretrained(tmp_path)
    target = load_target(TargetConfig(name="tiny", path=str(tmp_path), chat_template="plain"))
    ids = torch.randint(3, 512, (2, 11))
    logits, hidden = target.features(ids)
    assert torch.equal(target.lm_head(hidden), logits)
    torch.testing.assert_close(target.model(ids).logits, logits)
    assert target.max_len == 128
    shutil.rmtree(tmp_path)


def _layer_inputs(target, ids):
    """The input of every decoder layer, captured by forward pre-hooks on the stock modules."""
    captured = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: captured.__setitem__(
                i, (args[0] if args else kwargs["hidden_states"])
            ),
            with_kwargs=True,
        )
        for i, layer in enumerate(target.decoder.layers)
    ]
    try:
        target.hidden_states(ids)
    finally:
        for h in hooks:
            h.remove()
    return captured


def test_aux_hidden_states_are_the_inputs_of_the_chosen_layers(target):
    """EAGLE-3's features: the pre-norm INPUT of layers low/mid/high (vLLM's and SGLang's aux hidden
    state i), next to the last hidden state; the shallow default for 5 layers is distinct."""
    ids = torch.tensor([[1, 403, 407, 261, 378, 432, 383, 286, 261]])
    inputs = _layer_inputs(target, ids)
    assert target.aux_layers == [1, 2, 4]
    hidden, aux = target.aux_hidden_states(ids, None, [4, 0, 2])
    assert aux.shape == (1, 9, 3 * 64)
    assert torch.equal(aux, torch.cat([inputs[4], inputs[0], inputs[2]], -1))
    assert torch.equal(hidden, target.hidden_states(ids))


def test_decode_returns_the_aux_features_of_new_tokens(target):
    ids = torch.tensor([[1, 403, 407, 261, 378, 432]])
    _, aux = target.aux_hidden_states(ids, None, target.aux_layers)
    cache = target.new_cache(16)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    logits, feats = target.decode(
        ids[:, :4], torch.arange(4)[None], causal[:, :, :4, :4], cache, target.aux_layers
    )
    cache.advance(4)
    _, more = target.decode(
        ids[:, 4:], torch.arange(4, 6)[None], causal[:, :, 4:, :6], cache, target.aux_layers
    )
    torch.testing.assert_close(torch.cat([feats, more], 1), aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, target.features(ids[:, :4])[0], rtol=1e-5, atol=1e-5)


def test_aux_layers_are_checked_against_the_target(target_cfg):
    from dataclasses import replace

    from eagle_train.config.target import (
        check_eagle3_aux_layers,
        default_aux_layers,
        reference_aux_layers,
        resolve_aux_layers,
    )

    assert reference_aux_layers(32) == default_aux_layers(32) == [2, 16, 29]
    assert reference_aux_layers(5) == [2, 2, 2] and default_aux_layers(5) == [1, 2, 4]
    assert default_aux_layers(6) == [1, 3, 5] and default_aux_layers(3) == [0, 1, 2]
    assert resolve_aux_layers([0, 3, 4], 5) == [0, 3, 4]
    with pytest.raises(ValueError, match=r"ids \[5\] are not layers of this 5-layer target"):
        resolve_aux_layers([1, 2, 5], 5)
    # a store may hold any layers (a DFlash head's); an EAGLE-3 or P-EAGLE head fuses exactly three
    assert replace(target_cfg, aux_layers=[1, 2]).aux_layers == [1, 2]
    with pytest.raises(ValueError, match="3 layer ids"):
        check_eagle3_aux_layers([1, 2])
    with pytest.raises(ValueError, match="layer ids >= 0"):
        replace(target_cfg, aux_layers=[1, -2])


@pytest.mark.parametrize("path", ["/no/such/model", "runs/models/missing", "./missing", ""])
def test_a_missing_local_target_path_is_named_not_sent_to_the_hub(path):
    """A local path that does not exist is named as a missing directory, not sent to the hub as a
    repository id."""
    with pytest.raises(FileNotFoundError, match=rf"target.path='{path}': no such directory"):
        load_target(TargetConfig(path=path))


def test_what_target_path_names_is_said_when_it_is_no_model(tmp_path, monkeypatch):
    """A file, an empty directory, a directory of other files and a hub id the hub cannot provide (offline
    here): each an InputError naming target.path and what was found there, never transformers' own."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    cases = [
        (str(STORIES260K / "config.json"), r"config.json is a file, not a model directory"),
        (str(empty), r"empty has no config.json \(it is empty\)"),
        (str(tmp_path / "notes"), r"notes has no config.json \(it holds a.txt\)"),
        ("someone/no-such-model-here", r"no local directory of that name, and the hub cannot provide it"),
    ]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at import
    for path, message in cases:
        with pytest.raises(InputError, match=rf"^target.path='{path}': .*{message}"):
            load_target(TargetConfig(path=path))
        with pytest.raises(InputError, match=rf"^target.path='{path}': .*{message}"):
            load_frozen_target(TargetConfig(path=path))


def test_a_preset_for_another_model_is_refused_naming_it_and_the_id():
    """target=qwen3_8b pointed at stories260K (512 tokens): its stop ids are outside the vocabulary; a
    preset whose fallback chat template marks turns with tokens this tokenizer lacks is refused too; the
    model's own preset loads."""
    qwen = to_schema(OmegaConf.load(CONF_DIR / "target" / "qwen3_8b.yaml"), TargetConfig)
    qwen = replace(qwen, path=str(STORIES260K), dtype="float32")
    message = (
        r"target=qwen3-8b \(target.path=.*stories260K\): stop_token_ids holds 151645, outside .* 512 tokens"
    )
    for load in (load_target, load_frozen_target):
        with pytest.raises(InputError, match=message):
            load(qwen)
    chatml = replace(qwen, stop_token_ids=[2])
    with pytest.raises(
        InputError, match=r"chat_template=chatml marks turns with <\|im_end\|>, which is no token"
    ):
        load_target(chatml)
    stories = to_schema(OmegaConf.load(CONF_DIR / "target" / "stories260k.yaml"), TargetConfig)
    assert load_frozen_target(stories).vocab_size == 512
