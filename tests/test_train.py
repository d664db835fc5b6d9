"""The training stage on the real stories260K target and a real feature store (built by extraction)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle_train.config.base import to_schema
from eagle_train.config.data import DataConfig
from eagle_train.config.extract import ExtractConfig
from eagle_train.config.train import TrainConfig
from eagle_train.entry import compose
from eagle_train.store import StoreMismatchError
from eagle_train.train import run
from tests.conftest import STORIES260K


def make_cfg(store: Path | None, out_dir: Path, *overrides: str) -> TrainConfig:
    """The real composed config: conf/train.yaml + the CPU preset + test overrides."""
    cfg = compose(
        "train",
        overrides=[
            "+recipe=stories260k_cpu",
            f"features={store}",
            f"out_dir={out_dir}",
            "progress=false",
            "data.eval_fraction=0.1",
            "max_tokens=1024",
            "max_batch_size=4",
            "eval_max_samples=8",
            *overrides,
        ],
    )
    return to_schema(cfg, TrainConfig)


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- fast units


def test_shipped_configs_compose(tmp_path):
    cfg = make_cfg(tmp_path / "store", tmp_path)
    assert cfg.optim.lr == 1e-3 and cfg.loss.token_weight == 0.1 and cfg.loss.soft
    default = to_schema(compose("train", overrides=["features=x"]), TrainConfig)
    assert default.optim.lr == 3e-5 and default.optim.betas == [0.9, 0.95] and default.optim.clip == "value"
    with pytest.raises(ValueError, match="features=DIR"):
        TrainConfig()


def test_old_loss_weight_names_are_accepted_with_a_deprecation_message():
    with pytest.warns(DeprecationWarning, match="loss.w_p is deprecated: use loss.token_weight"):
        cfg = to_schema(compose("train", ["features=x", "loss.w_v=2.0", "loss.w_p=0.5"]), TrainConfig)
    assert (cfg.loss.feature_weight, cfg.loss.token_weight) == (2.0, 0.5)
    assert cfg.loss.w_v is None and cfg.loss.w_p is None  # one value, under its new name
    new = to_schema(compose("train", ["features=x", "loss.token_weight=0.5"]), TrainConfig)
    assert new.loss.token_weight == 0.5 and new.loss.feature_weight == 1.0


def test_schema_keys_need_no_plus_on_the_command_line():
    """Every schema key exists in the composed config (the README's target.* overrides work as written)."""
    cfg = to_schema(
        compose(
            "train",
            ["features=x", "target.trust_remote_code=true", "target.max_len=256", "target.revision=main"],
        ),
        TrainConfig,
    )
    assert cfg.target.trust_remote_code and cfg.target.max_len == 256 and cfg.target.revision == "main"
    with pytest.raises(Exception, match="no_such_key"):
        compose("train", ["features=x", "optim.no_such_key=1"])


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_loss_falls_and_checkpoints_are_written(tiny_store, tmp_path):
    out = tmp_path / "run"
    final = run(
        make_cfg(
            tiny_store,
            out,
            "max_steps=60",
            "optim.warmup_steps=5",
            "log_every=10",
            "eval_every=20",
            "save_every=30",
            "keep_last=1",
        )
    )
    train_lines = [m for m in read_metrics(out) if "loss" in m]
    assert train_lines[-1]["loss"] < 0.85 * train_lines[0]["loss"]
    evals = [m for m in read_metrics(out) if "eval/loss" in m]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] and final["eval/top1"] > evals[0]["eval/top1"]
    assert {"lr", "grad_norm", "tokens_per_s", "smooth_l1", "ce"} <= set(train_lines[0])
    assert {"eval/top3", "eval/acc_step5", "eval/accept_len"} <= set(evals[0])
    # keep_last=1: only step 60; the head in the serving layout with the target in its meta
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_0000060"]
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["eagle_train"]["target"]["name"] == "stories260k"
    weights = load_file(str(out / "final" / "model.safetensors"))
    assert "fc.weight" in weights and not any(k.startswith(("lm_head", "embed_tokens")) for k in weights)


EAGLE3 = ("draft.type=eagle3", "draft.vocab_size=256", "loss.ttt_steps=3")


@pytest.mark.slow
@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_resume_matches_an_uninterrupted_run_step_for_step(request, tmp_path, head):
    store = request.getfixturevalue("tiny_store" if head == "eagle1" else "tiny_store_aux")
    args = ("max_steps=8", "log_every=1", "eval_every=0", "save_every=4", "grad_accum=2")
    args += EAGLE3 if head == "eagle3" else ()
    run(make_cfg(store, tmp_path / "whole", *args))
    run(make_cfg(store, tmp_path / "parts", *args, "stop_at_step=4"))
    assert not (tmp_path / "parts" / "final").exists()
    run(make_cfg(store, tmp_path / "parts", *args))  # resume=auto picks up step 4
    whole = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "whole") if "loss" in m}
    parts = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "parts") if "loss" in m}
    assert list(parts) == list(range(1, 9))
    assert parts == whole  # bit-identical losses, step for step
    a = load_file(str(tmp_path / "whole" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "parts" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_online_gives_the_offline_first_step_loss(request, tiny_conversations, tmp_path, head):
    store = request.getfixturevalue("tiny_store" if head == "eagle1" else "tiny_store_aux")
    args = ("max_steps=1", "log_every=1", "eval_every=0", "save_every=0", "data.eval_fraction=0.1")
    args += EAGLE3 if head == "eagle3" else ()
    run(make_cfg(store, tmp_path / "offline", *args))
    run(make_cfg(None, tmp_path / "online", *args, "data.source=online", f"data.path={tiny_conversations}"))
    offline, online = read_metrics(tmp_path / "offline")[0], read_metrics(tmp_path / "online")[0]
    # Same data, same batches, same noise; features computed per batch vs stored: fp32 rounding only.
    for key in ("loss", "ce") + (("smooth_l1",) if head == "eagle1" else ("ce_step2", "ce_step3")):
        assert online[key] == pytest.approx(offline[key], rel=1e-5), key
    assert online["tokens_per_s"] > 0


def test_a_store_from_another_target_is_refused(tiny_store, tmp_path):
    for field, value in (("hidden_size", 128), ("config_hash", "0123456789abcdef")):
        other = tmp_path / field
        shutil.copytree(tiny_store, other)
        manifest = json.loads((other / "manifest.json").read_text())
        manifest["target"][field] = value
        (other / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(StoreMismatchError, match=f"target.{field}"):
            run(make_cfg(other, tmp_path / f"run_{field}", "max_steps=1"))
        assert not (tmp_path / f"run_{field}" / "checkpoints").exists()


@pytest.mark.slow
def test_a_store_extracted_from_a_real_other_model_is_refused(tiny_conversations, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from eagle_train.config.target import TargetConfig
    from eagle_train.extract import run as extract

    model_dir = tmp_path / "tiny_qwen2"
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(STORIES260K / name, model_dir / name)
    other = TargetConfig(name="tiny_qwen2", path=str(model_dir), chat_template="plain")
    data = DataConfig(name="tinystories", path=str(tiny_conversations), limit=8)
    extract(
        ExtractConfig(
            target=other, data=data, out_dir=str(tmp_path / "store"), dtype="float32", progress=False
        )
    )
    with pytest.raises(StoreMismatchError, match="target.hidden_size: expected 64, found 32") as err:
        run(make_cfg(tmp_path / "store", tmp_path / "run", "max_steps=1"))
    assert "target.config_hash" in str(err.value)


@pytest.mark.slow
def test_eagle3_loss_falls_and_its_serving_layout_is_written(tiny_store_aux, tmp_path):
    out = tmp_path / "run"
    final = run(
        make_cfg(
            tiny_store_aux,
            out,
            *EAGLE3,
            "max_steps=60",
            "optim.warmup_steps=5",
            "log_every=10",
            "eval_every=30",
        )
    )
    lines = [m for m in read_metrics(out) if "loss" in m]
    assert lines[-1]["loss"] < 0.8 * lines[0]["loss"]
    assert {"ce_step1", "ce_step3", "train_ttt_acc_step3", "vocab_coverage", "tokens_per_s"} <= set(lines[0])
    evals = [m for m in read_metrics(out) if "eval/loss" in m]
    assert final["eval/top1"] > evals[0]["eval/top1"] and "eval/ttt_acc_step3" in final
    assert final["eval/accept_len"] >= 1.0 and final["eval/vocab_coverage"] > 0.9  # 256 of 512 tokens
    weights = load_file(str(out / "final" / "model.safetensors"))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(
        weights
    )
    assert weights["lm_head.weight"].shape == (256, 64) and int(weights["t2d"].sum()) == 256
    assert not any(k.startswith("embed_tokens") for k in weights)
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 256
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert config["eagle_train"]["type"] == "eagle3"


def test_eagle3_refuses_a_store_without_its_layers(tiny_store, tiny_store_aux, tmp_path):
    with pytest.raises(
        StoreMismatchError,
        match=r"holds no aux layers; draft.type=eagle3 needs the inputs of layers \[1, 2, 4\]",
    ):
        run(make_cfg(tiny_store, tmp_path / "run", *EAGLE3, "max_steps=1"))
    with pytest.raises(
        StoreMismatchError, match=r"holds the inputs of target layers \[1, 2, 4\]; .* needs .* \[0, 2, 4\]"
    ):
        run(make_cfg(tiny_store_aux, tmp_path / "run", *EAGLE3, "max_steps=1", "target.aux_layers=[0,2,4]"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_eagle1_head_trains_on_an_eagle3_store_exactly_as_on_its_own(tiny_store, tiny_store_aux, tmp_path):
    """One store serves both heads: EAGLE-1 reads its last hidden states and never the aux features."""
    args = ("max_steps=1", "log_every=1", "eval_every=0", "save_every=0")
    run(make_cfg(tiny_store, tmp_path / "plain", *args))
    run(make_cfg(tiny_store_aux, tmp_path / "aux", *args))
    plain, aux = read_metrics(tmp_path / "plain")[0], read_metrics(tmp_path / "aux")[0]
    assert (plain["loss"], plain["smooth_l1"], plain["ce"]) == (aux["loss"], aux["smooth_l1"], aux["ce"])
