"""The DFlash head (eagle_train.modeling.dflash) on the real stories260K target: all blocks in one forward
under the block mask equal each block run alone after its own context; its checkpoint holds vLLM's names
and its mask token and loads back identical; load_draft (the evaluate stage's) loads it and the file z-lab
and vLLM use (the export's round trips: tests/test_export.py)."""

from __future__ import annotations

import json

import pytest
import torch

from eagle_train.config.decode import DecodeConfig
from eagle_train.config.target import dflash_aux_layers, dflash_layer_ids, resolve_dflash_layers
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.interop.layouts import load_draft
from eagle_train.modeling.dflash import DFlashHead
from eagle_train.modeling.head_checkpoint import head_model, load_head, save_head
from eagle_train.runtime.errors import InputError
from eagle_train.training.dflash import Blocks, block_attention_mask, block_positions
from tests.conftest import untrained_dflash_head


@pytest.fixture(scope="module")
def head(target):
    return untrained_dflash_head(target, 4, seed=0)


def test_the_published_target_layer_rule():
    assert dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, as published
    assert (
        dflash_layer_ids(36, 1) == [18] and dflash_layer_ids(5, 1) == [2] and dflash_layer_ids(5, 2) == [1, 2]
    )
    assert dflash_aux_layers([1, 9]) == [2, 10]  # the output of layer i is the input of layer i + 1
    assert resolve_dflash_layers([0, 3], 5, 2) == [0, 3]
    with pytest.raises(ValueError, match=r"ids \[4\] are not layers .* \(0 <= i <= 3\)"):
        resolve_dflash_layers([1, 4], 5, 2)


def test_all_blocks_in_one_forward_equal_each_block_alone(head):
    """Two rows of different lengths, two blocks each (one padding block): every real block's states under
    the block mask equal a forward of that block alone after its own context (no mask)."""
    g = torch.Generator().manual_seed(1)
    n, size = 12, 4
    features = torch.randn(2, n, 2 * 64, generator=g)
    anchors = Blocks(torch.tensor([[2, 7], [5, 0]]), torch.tensor([[True, True], [True, False]]))
    ids = torch.randint(1, 512, (2, 2, size), generator=g)
    ids[..., 1:] = head.mask_token_id
    positions = block_positions(anchors, size)
    with torch.no_grad():
        together = head(ids.flatten(1), features, positions, None, block_attention_mask(anchors, n, size))
        for r, i in ((0, 0), (0, 1), (1, 0)):
            j = int(anchors.anchor[r, i])
            alone = head(
                ids[r, i][None], features[r : r + 1, : j + 1], positions[r : r + 1, i * size : (i + 1) * size]
            )
            assert torch.allclose(together[r, i * size : (i + 1) * size], alone[0], atol=1e-5), (r, i)


def test_the_block_is_bidirectional_and_the_context_only_keys(head):
    """A later slot changes an earlier slot's state (bidirectional); the context is never a query: the
    output has one row per block slot whatever the context's length."""
    features = torch.randn(1, 6, 2 * 64)
    ids = torch.tensor([[5, 0, 0, 0]])
    positions = torch.arange(6, 10)[None]
    with torch.no_grad():
        a = head(ids, features, positions)
        b = head(torch.tensor([[5, 0, 0, 7]]), features, positions)
    assert a.shape == (1, 4, 64) and not torch.allclose(a[0, 0], b[0, 0])


def test_a_saved_head_has_vllms_names_and_its_mask_token_and_loads_back_identical(head, target, tmp_path):
    save_head(head, tmp_path / "h", {"target": "stories260k"})
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    assert head_model(raw) is DFlashHead and raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [1, 2]} and raw["block_size"] == 4
    names = set(head.trainable_state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert {"layers.0.self_attn.q_norm.weight", "layers.0.mlp.gate_proj.weight"} <= names
    assert not any(k.startswith(("embed", "lm_head", "model.")) for k in names)
    loaded, _ = load_head(tmp_path / "h", target=target)
    assert loaded.target_layer_ids == [1, 2] and loaded.block_size == 4 and loaded.mask_token_id == 0
    for name, tensor in head.trainable_state_dict().items():
        assert torch.equal(loaded.trainable_state_dict()[name], tensor), name
    raw["dflash_config"]["mask_token_id"] = 9999
    (tmp_path / "h" / "config.json").write_text(json.dumps({**raw, "eagle_train": {"type": "dflash"}}))
    with pytest.raises(InputError, match=r"dflash_config.mask_token_id: 9999 is outside the vocabulary"):
        load_head(tmp_path / "h")


def test_load_draft_loads_the_checkpoint_and_a_z_lab_style_file(head, target, tmp_path):
    """The evaluate stage loads its head with load_draft (decoding: tests/decoding/test_dflash_decoding.py);
    a z-lab-style directory (Qwen3 config.json with `DFlashDraftModel`, `dflash_config`, `block_size`,
    no `eagle_train` block, no checksum) loads the same head."""
    save_head(head, tmp_path / "h", {"target": "stories260k"})
    loaded = load_draft(tmp_path / "h", target)
    assert type(loaded) is DFlashHead and not loaded.training and loaded.block_size == 4
    for name, tensor in head.trainable_state_dict().items():
        assert torch.equal(loaded.trainable_state_dict()[name], tensor), name
    assert SpeculativeDecoder(target, loaded, DecodeConfig(method="chain")).generate([1, 5]).tokens
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    del raw["eagle_train"]
    (tmp_path / "h" / "config.json").write_text(json.dumps({**raw, "model_type": "qwen3", "auto_map": {}}))
    z_lab = load_draft(tmp_path / "h", target)
    assert z_lab.target_layer_ids == [1, 2] and z_lab.mask_token_id == 0
    for name, tensor in head.trainable_state_dict().items():
        assert torch.equal(z_lab.trainable_state_dict()[name], tensor), name
