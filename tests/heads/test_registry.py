"""The kinds of draft head (eagle_train.heads): the registry, the model classes and the configuration
agree on which kinds exist; each kind's checkpoint is recognised as its own; each kind's contract is what
its model does (the features it reads, whose LM head, where it drafts)."""

from __future__ import annotations

import json

import pytest
import torch

from eagle_train.config.draft import DRAFT_TYPES, DraftConfig
from eagle_train.heads import KINDS, head_kind
from eagle_train.modeling.dflash import DFlashHead
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.eagle3 import Eagle3Head
from eagle_train.modeling.head_checkpoint import HEAD_MODELS, head_model, load_head, save_head
from eagle_train.modeling.peagle import PEagleHead


def test_the_registry_the_model_classes_and_the_configuration_name_the_same_kinds():
    assert set(KINDS) == set(DRAFT_TYPES) == {m.kind for m in HEAD_MODELS}
    assert all(KINDS[m.kind].model is m for m in HEAD_MODELS)
    for name in DRAFT_TYPES:
        DraftConfig(type=name)  # every registered kind is a valid draft.type
        assert head_kind(name).name == name
    with pytest.raises(ValueError, match="unknown draft head kind 'medusa'"):
        head_kind("medusa")


@pytest.fixture(scope="module")
def heads(target):
    torch.manual_seed(0)
    vocab = torch.arange(64)
    eagle3 = Eagle3Head.from_target(target.config, target.aux_layers, 64)
    peagle = PEagleHead.from_target(target.config, target.aux_layers, 64, 0)
    for head in (eagle3, peagle):
        head.set_vocabulary(
            torch.zeros(target.vocab_size, dtype=torch.bool).index_fill(0, vocab, True), target.lm_head.weight
        )
    dflash = DFlashHead.from_target(target.config, [1, 2], 4, 0, target=target, num_layers=2)
    return {
        "eagle1": DraftHead.from_target(target.config, 1, True),
        "eagle3": eagle3,
        "peagle": peagle,
        "dflash": dflash,
    }


@pytest.mark.parametrize("kind", DRAFT_TYPES)
def test_a_saved_head_is_recognised_as_its_own_kind_and_loads_as_it(kind, heads, target, tmp_path):
    head = heads[kind]
    assert head_kind(head) is KINDS[kind]
    save_head(head, tmp_path / kind, {"target": "stories260k"})
    raw = json.loads((tmp_path / kind / "config.json").read_text())
    assert head_model(raw) is KINDS[kind].model and raw["eagle_train"]["type"] == kind
    loaded, _ = load_head(tmp_path / kind, target=target)
    assert type(loaded) is type(head) and loaded.kind == kind
    for name, tensor in head.trainable_state_dict().items():
        assert torch.equal(loaded.trainable_state_dict()[name], tensor), name


def test_each_kinds_contract_is_what_its_model_does(heads, target):
    """reads_aux: the fc is as wide as the aux features (EAGLE-3: three target layers; DFlash: its
    target_layer_ids), not one hidden state; own_lm_head: logits over the draft vocabulary, not the
    target's; drafts_in_catch_up: P-EAGLE alone."""
    d = target.config.hidden_size
    for name, head in heads.items():
        kind = KINDS[name]
        width = len(head.aux_layers) * d if head.aux_layers else None
        assert kind.reads_aux == (head.fc.weight.shape[1] == width)
        state = torch.zeros(1, 1, d)
        width = head.logits(state).shape[-1]
        assert kind.own_lm_head == (width == 64) and (width == target.vocab_size) != kind.own_lm_head
        assert kind.drafts_in_catch_up == (name == "peagle")
