"""The training stage on the real stories260K target and a real feature store (built by extraction)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from eagle_train.config.base import CONF_DIR, to_schema
from eagle_train.config.data import DataConfig
from eagle_train.config.extract import ExtractConfig
from eagle_train.config.train import OptimConfig, TrainConfig
from eagle_train.data.tinystories import build_tinystories_conversations
from eagle_train.store import StoreMismatchError
from eagle_train.train import run
from eagle_train.training.data import collate, plan_epoch, split_by_id
from eagle_train.training.optim import lr_at

STORIES260K = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("conv") / "tinystories.jsonl"
    build_tinystories_conversations(out_path=path, limit=64)
    return path


@pytest.fixture(scope="module")
def store(conversations, target_cfg, tmp_path_factory) -> Path:
    from eagle_train.extract import run as extract

    out = tmp_path_factory.mktemp("store") / "features"
    data = DataConfig(name="tinystories", path=str(conversations))
    extract(ExtractConfig(target=target_cfg, data=data, out_dir=str(out), dtype="float32", progress=False))
    return out


def make_cfg(store: Path | None, out_dir: Path, *overrides: str) -> TrainConfig:
    """The real composed config: conf/train.yaml + the CPU preset + test overrides."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
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
    assert cfg.optim.lr == 1e-3 and cfg.loss.w_p == 0.1 and cfg.loss.soft
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        default = to_schema(compose("train", overrides=["features=x"]), TrainConfig)
    assert default.optim.lr == 3e-5 and default.optim.betas == [0.9, 0.95] and default.optim.clip == "value"
    with pytest.raises(ValueError, match="features=DIR"):
        TrainConfig()


def test_schedule_warms_up_then_decays():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, schedule="linear", min_lr_ratio=0.0)
    assert lr_at(0, 110, cfg) == pytest.approx(0.1) and lr_at(9, 110, cfg) == pytest.approx(1.0)
    assert lr_at(60, 110, cfg) == pytest.approx(0.5) and lr_at(110, 110, cfg) == pytest.approx(0.0)
    cosine = OptimConfig(lr=1.0, warmup_steps=0, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(0, 100, cosine) == pytest.approx(1.0) and lr_at(50, 100, cosine) == pytest.approx(0.55)
    assert lr_at(100, 100, cosine) == pytest.approx(0.1)


def test_batch_plans_cover_the_split_once_and_respect_the_budget():
    lengths = [5, 50, 7, 48, 9, 51, 6, 49, 30, 2]
    indices = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    for bucket in (True, False):
        plan = plan_epoch(indices, lengths, max_tokens=100, max_batch_size=3, bucket=bucket, seed=1)
        assert sorted(i for b in plan for i in b) == indices
        assert all(len(b) <= 3 and (len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 100) for b in plan)
    assert plan_epoch(indices, lengths, 100, 3, True, 1) == plan_epoch(indices, lengths, 100, 3, True, 1)
    train, held = split_by_id([f"c{i}" for i in range(10)], lengths, 0.3)
    assert 9 not in train + held and set(train).isdisjoint(held)  # length 2: no trainable position


def test_collate_pads_right_and_masks_padding():
    samples = [
        {
            "input_ids": torch.tensor([1, 2, 3, 4]),
            "loss_mask": torch.tensor([0, 1, 1, 1]).bool(),
            "hidden": torch.ones(4, 2),
        },
        {
            "input_ids": torch.tensor([5, 6, 7]),
            "loss_mask": torch.tensor([0, 1, 1]).bool(),
            "hidden": torch.ones(3, 2),
        },
    ]
    batch = collate(samples)
    assert batch["input_ids"].tolist() == [[2, 3, 4], [6, 7, 0]]
    assert batch["loss_mask"].tolist() == [[True, True, False], [True, False, False]]
    assert batch["target_ids"].tolist() == [[3, 4, 0], [7, 0, 0]]
    assert batch["positions"].tolist() == [3, 2] and batch["features"].shape == (2, 3, 2)


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_loss_falls_and_checkpoints_are_written(store, tmp_path):
    out = tmp_path / "run"
    final = run(
        make_cfg(
            store,
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


@pytest.mark.slow
def test_resume_matches_an_uninterrupted_run_step_for_step(store, tmp_path):
    args = ("max_steps=8", "log_every=1", "eval_every=0", "save_every=4", "grad_accum=2")
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
def test_online_gives_the_offline_first_step_loss(store, conversations, tmp_path):
    args = ("max_steps=1", "log_every=1", "eval_every=0", "save_every=0", "data.eval_fraction=0.1")
    run(make_cfg(store, tmp_path / "offline", *args))
    run(make_cfg(None, tmp_path / "online", *args, "data.source=online", f"data.path={conversations}"))
    offline, online = read_metrics(tmp_path / "offline")[0], read_metrics(tmp_path / "online")[0]
    # Same data, same batches, same noise; features computed per batch vs stored: fp32 rounding only.
    for key in ("loss", "smooth_l1", "ce"):
        assert online[key] == pytest.approx(offline[key], rel=1e-5), key
    assert online["tokens_per_s"] > 0


def test_a_store_from_another_target_is_refused(store, tmp_path):
    for field, value in (("hidden_size", 128), ("config_hash", "0123456789abcdef")):
        other = tmp_path / field
        shutil.copytree(store, other)
        manifest = json.loads((other / "manifest.json").read_text())
        manifest["target"][field] = value
        (other / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(StoreMismatchError, match=f"target.{field}"):
            run(make_cfg(other, tmp_path / f"run_{field}", "max_steps=1"))
        assert not (tmp_path / f"run_{field}" / "checkpoints").exists()


@pytest.mark.slow
def test_a_store_extracted_from_a_real_other_model_is_refused(conversations, tmp_path):
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
    data = DataConfig(name="tinystories", path=str(conversations), limit=8)
    extract(
        ExtractConfig(
            target=other, data=data, out_dir=str(tmp_path / "store"), dtype="float32", progress=False
        )
    )
    with pytest.raises(StoreMismatchError, match="target.hidden_size: expected 64, found 32") as err:
        run(make_cfg(tmp_path / "store", tmp_path / "run", "max_steps=1"))
    assert "target.config_hash" in str(err.value)
