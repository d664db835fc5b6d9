"""Training a DFlash head (draft.type=dflash) with the train stage on the real stories260K target and real
feature stores: the loss falls, the per-slot figures are logged, the checkpoint loads back to the trained
head, a resumed run is exact, and a store without the head's layers is refused naming them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle_train.config.data import DataConfig
from eagle_train.config.extract import ExtractConfig
from eagle_train.extract import run as extract
from eagle_train.modeling.head_checkpoint import load_head
from eagle_train.runtime.errors import InputError
from eagle_train.store.manifest import StoreMismatchError
from eagle_train.train import run
from tests.test_train import make_cfg, read_metrics

# blocks of 4 from the outputs of layers 0, 1, 3: the inputs of layers 1, 2, 4, which tiny_store_aux holds
DFLASH = ("draft.type=dflash", "draft.block_size=4", "draft.target_layer_ids=[0,1,3]", "loss.num_anchors=24")


@pytest.fixture(scope="module")
def default_store(tiny_conversations, target_cfg, tmp_path_factory):
    """A store of the layer a one-layer DFlash head reads by default on this 5-layer target: the output of
    layer 5 // 2 = 2, the input of layer 3 (aux=true target.aux_layers=[3])."""
    out = tmp_path_factory.mktemp("store_dflash") / "features"
    target_cfg = type(target_cfg)(**{**vars(target_cfg), "aux_layers": [3]})
    data = DataConfig(name="tinystories", path=str(tiny_conversations))
    extract(
        ExtractConfig(
            target=target_cfg, data=data, out_dir=str(out), dtype="float32", progress=False, aux=True
        )
    )
    return out


@pytest.mark.quick
def test_dflash_loss_falls_and_its_checkpoint_loads_back_to_the_trained_head(default_store, target, tmp_path):
    out = tmp_path / "run"
    args = ("draft.type=dflash", "draft.block_size=4", "loss.num_anchors=24", "max_steps=40")
    args += ("optim.warmup_steps=5", "log_every=10", "eval_every=20", "save_every=20")
    final = run(make_cfg(default_store, out, *args))
    lines = [m for m in read_metrics(out) if "loss" in m]
    assert lines[-1]["loss"] < 0.8 * lines[0]["loss"]
    assert {"acc_slot1", "acc_slot3", "ce_slot2", "accept_len"} <= set(lines[0])
    assert {"eval/acc_slot1", "eval/accept_len", "eval/loss"} <= set(final)
    # blocks of 4: 1 (the bonus token) + up to 3 drafted, at least one per slot-1 hit
    assert 1.0 + final["eval/acc_slot1"] <= final["eval/accept_len"] + 1e-9 <= 4.0 + 1e-9
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["eagle_train"]["type"] == "dflash" and config["block_size"] == 4
    assert config["dflash_config"] == {
        "mask_token_id": 0,
        "target_layer_ids": [2],
    }  # <unk>: never in the data
    weights = load_file(str(out / "final" / "model.safetensors"))
    assert weights["fc.weight"].shape == (64, 64) and "layers.0.self_attn.q_norm.weight" in weights
    head, _ = load_head(out / "final", target=target)
    assert head.kind == "dflash" and head.target_layer_ids == [2]
    assert all(torch.equal(head.trainable_state_dict()[k], v) for k, v in weights.items())
    assert set(head.trainable_state_dict()) == set(weights)


def test_resume_matches_an_uninterrupted_run_step_for_step(tiny_store_aux, tmp_path):
    """The anchors come from the micro-batches' seeds, so the resumed run draws the same blocks."""
    args = (*DFLASH, "max_steps=6", "log_every=1", "eval_every=0", "save_every=3", "grad_accum=2")
    run(make_cfg(tiny_store_aux, tmp_path / "whole", *args))
    run(make_cfg(tiny_store_aux, tmp_path / "parts", *args, "stop_at_step=3"))
    run(make_cfg(tiny_store_aux, tmp_path / "parts", *args))  # resume=auto picks up step 3
    whole = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "whole") if "loss" in m}
    parts = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "parts") if "loss" in m}
    assert list(parts) == list(range(1, 7)) and parts == whole  # bit-identical, step for step
    a = load_file(str(tmp_path / "whole" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "parts" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_store_without_the_heads_layers_is_refused_naming_them(tiny_store, tiny_store_aux, tmp_path):
    with pytest.raises(
        StoreMismatchError,
        match=r"holds the inputs of target layers \[1, 2, 4\]; draft.type=dflash needs the inputs of layers "
        r"\[3\] \(target.aux_layers\): extract with aux=true target.aux_layers=\[3\]",
    ):
        run(make_cfg(tiny_store_aux, tmp_path / "run", "draft.type=dflash", "max_steps=1"))
    with pytest.raises(
        StoreMismatchError, match=r"holds no aux layers; draft.type=dflash needs .* \[1, 2, 4\]"
    ):
        run(make_cfg(tiny_store, tmp_path / "run", *DFLASH, "max_steps=1"))
    with pytest.raises(InputError, match=r"draft.target_layer_ids \[4\]: ids \[4\] are not layers"):
        run(make_cfg(tiny_store_aux, tmp_path / "run", "draft.type=dflash", "draft.target_layer_ids=[4]"))
    with pytest.raises(InputError, match="draft.mask_token_id: 1 is the target's BOS token"):
        run(make_cfg(tiny_store_aux, tmp_path / "run", *DFLASH, "draft.mask_token_id=1", "max_steps=1"))
    assert not (tmp_path / "run").exists()


def test_a_dflash_head_loaded_with_other_layers_is_refused(tiny_store_aux, tiny_conversations, tmp_path):
    """Online (no store to refuse first): the loaded head reads layers the settings do not resolve to."""
    run(make_cfg(tiny_store_aux, tmp_path / "first", *DFLASH, "max_steps=1", "eval_every=0", "save_every=0"))
    other = ("draft.type=dflash", f"draft.path={tmp_path / 'first' / 'final'}", "max_steps=1")
    other += ("data.source=online", f"data.path={tiny_conversations}")
    with pytest.raises(
        InputError, match=r"reads the outputs of target layers \[0, 1, 3\], .* resolves to \[2\]"
    ):
        run(make_cfg(None, tmp_path / "second", *other))


def test_online_gives_the_offline_first_step_loss(default_store, tiny_conversations, tmp_path):
    """The target's layer outputs computed per batch (online) or read from the store: fp32 rounding only."""
    args = ("draft.type=dflash", "draft.block_size=4", "max_steps=1", "log_every=1", "eval_every=0")
    args += ("save_every=0",)
    run(make_cfg(default_store, tmp_path / "offline", *args))
    run(make_cfg(None, tmp_path / "online", *args, "data.source=online", f"data.path={tiny_conversations}"))
    offline, online = read_metrics(tmp_path / "offline")[0], read_metrics(tmp_path / "online")[0]
    for key in ("loss", "ce", "ce_slot1", "ce_slot3"):
        assert online[key] == pytest.approx(offline[key], rel=1e-5), key


def test_the_engine_evaluation_takes_a_dflash_head(tmp_path):
    """Its export and vLLM's `method: dflash` exist (tests/engines/test_vllm_dflash.py)."""
    cfg = make_cfg(tmp_path / "store", tmp_path / "run", "draft.type=dflash", "eval_engine=vllm")
    assert cfg.eval_engine == "vllm" and cfg.draft.type == "dflash"
