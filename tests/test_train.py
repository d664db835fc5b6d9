"""The training stage on the real stories260K target and a real feature store (built by extraction)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle_train.cli import compose
from eagle_train.config.base import to_schema
from eagle_train.config.data import DataConfig
from eagle_train.config.extract import ExtractConfig
from eagle_train.config.train import TrainConfig
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.head_checkpoint import save_head
from eagle_train.runtime.errors import InputError
from eagle_train.store.manifest import StoreError, StoreMismatchError
from eagle_train.store.shard import ShardFile
from eagle_train.store.writer import shard_name
from eagle_train.train import run
from eagle_train.training.optim import NonFiniteError
from tests.conftest import STORIES260K, TINY_SHAPE, decoder_fine_tune, reseal


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
    assert cfg.optim.lr == 1e-2 and cfg.loss.token_weight == 0.1 and cfg.loss.soft
    default = to_schema(compose("train", overrides=["features=x"]), TrainConfig)
    assert default.optim.lr == 3e-5 and default.optim.betas == [0.9, 0.95] and default.optim.clip == "value"
    with pytest.raises(ValueError, match="features=DIR"):
        TrainConfig()


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


def vocabulary_storages(session) -> dict[int, torch.dtype]:
    """Distinct storages (data pointer -> dtype) of every vocabulary-sized tensor the session holds."""
    vocab = session.lm_weight.shape[0]
    head = session.accelerator.unwrap_model(session.model)
    tensors = [session.lm_weight, *(p for p in head.parameters() if p.shape[0] == vocab and p.ndim == 2)]
    return {t.untyped_storage().data_ptr(): t.dtype for t in tensors}


@pytest.mark.slow
@pytest.mark.parametrize("precision, frozen", [("bf16", torch.bfloat16), ("no", torch.float32)])
def test_one_frozen_copy_of_each_vocabulary_matrix_in_the_working_dtype(
    tiny_store, tmp_path, precision, frozen
):
    """The frozen embedding and LM head are held once per process, in the working dtype (bf16 under bf16
    mixed precision; at a 128k vocabulary an fp32 copy costs 2.1 GB), the loss reads the head's own LM
    head (no second copy on the device), the trained weights stay float32, and a bf16 run trains."""
    from accelerate.state import AcceleratorState

    from eagle_train.train import fit, make_accelerator, setup

    AcceleratorState._reset_state(True)
    try:
        cfg = make_cfg(tiny_store, tmp_path, f"mixed_precision={precision}", "max_steps=2", "log_every=1",
                       "eval_every=0", "save_every=0")  # fmt: skip
        session, state = setup(cfg, make_accelerator(cfg))
        head = session.accelerator.unwrap_model(session.model)
        assert vocabulary_storages(session) == {
            head.embed_tokens.weight.data_ptr(): frozen,
            head.lm_head.weight.data_ptr(): frozen,
        }
        assert session.lm_weight is head.lm_head.weight
        assert all(p.dtype == torch.float32 for p in head.parameters() if p.requires_grad)
        fit(cfg, session, state)
        losses = [m["loss"] for m in read_metrics(tmp_path) if "loss" in m]
        assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    finally:
        AcceleratorState._reset_state(True)


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
# a 2-layer P-EAGLE head drafting chains of 4 (COD over 4 depths)
PEAGLE = ("draft.type=peagle", "draft.vocab_size=256", "draft.num_layers=2", "loss.cod.num_depths=4")
HEAD_ARGS = {"eagle1": (), "eagle3": EAGLE3, "peagle": PEAGLE}


@pytest.mark.slow
@pytest.mark.quick
@pytest.mark.parametrize("head", ["eagle1", "eagle3", "peagle"])
def test_resume_matches_an_uninterrupted_run_step_for_step(request, tmp_path, head):
    """P-EAGLE too: its COD samples come from the micro-batches' seeds, so the resumed run draws the same."""
    store = request.getfixturevalue("tiny_store" if head == "eagle1" else "tiny_store_aux")
    args = ("max_steps=8", "log_every=1", "eval_every=0", "save_every=4", "grad_accum=2")
    args += HEAD_ARGS[head]
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


@pytest.mark.parametrize("head", ["eagle1", "eagle3", "peagle"])
def test_offline_training_never_builds_the_target_and_no_state_holds_frozen_tensors(
    request, tmp_path, monkeypatch, head
):
    """Offline training reads the target's config, embedding and LM head only (the whole
    model is never loaded), and neither the checkpoint nor accelerate's training state holds them (an
    EAGLE-3 head's own LM head over its draft vocabulary is trained, so it is saved; the embedding is not)."""
    import transformers

    store = request.getfixturevalue("tiny_store" if head == "eagle1" else "tiny_store_aux")

    def refuse(*args, **kwargs):
        raise AssertionError("offline training loaded the whole target")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    out = tmp_path / "run"
    args = ("max_steps=2", "save_every=2", "eval_every=0", "loader_workers=0")
    run(make_cfg(store, out, *args, *HEAD_ARGS[head]))
    state_dir = out / "checkpoints" / "step_0000002" / "training_state"
    assert list(state_dir.glob("model*.safetensors"))  # accelerate's copy of the model's state
    own = (
        ("fc.", "layers.")
        if head == "eagle1"
        else ("fc.", "midlayer.", "layers.", "norm.", "lm_head.", "d2t", "t2d")
    )
    own += ("mask_hidden", "mask_embedding") if head == "peagle" else ()  # one learned row, not the embedding
    for file in [*state_dir.glob("*.safetensors"), out / "final" / "model.safetensors"]:
        keys = set(load_file(str(file)))
        assert keys and all(k.startswith(own) for k in keys), (file, sorted(keys)[:4])
        assert not any(k.startswith("embed_tokens") for k in keys)
    if (
        head == "eagle1"
    ):  # the head's own size (~53.6K parameters, fp32), not the vocabulary's (512 x 64 each)
        assert sum(f.stat().st_size for f in state_dir.glob("model*.safetensors")) < 250_000


@pytest.mark.slow
def test_the_loader_workers_give_the_in_loop_run_exactly(tiny_store, tmp_path):
    """Micro-batches read ahead by DataLoader workers are the in-loop ones, in the same order."""
    args = ("max_steps=6", "log_every=1", "eval_every=0", "save_every=0", "grad_accum=2")
    run(make_cfg(tiny_store, tmp_path / "loop", *args, "loader_workers=0"))
    run(make_cfg(tiny_store, tmp_path / "workers", *args, "loader_workers=2", "loader_prefetch=2"))
    loop = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "loop") if "loss" in m}
    workers = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "workers") if "loss" in m}
    assert list(loop) == list(range(1, 7)) and workers == loop


@pytest.mark.slow
def test_epochs_run_over_each_epochs_own_plan(tiny_store, tmp_path):
    """epochs=2 without max_steps, where the second epoch's plan has fewer micro-batches than the first
    (unbucketed batches cut under a token budget; jittered buckets alike): the schedule's length is the
    sum of both epochs' plans and every step has its micro-batches (the first epoch's count would run
    the second past its end)."""
    from accelerate import Accelerator

    from eagle_train.train import epoch_plan, prepare_data

    args = ("max_steps=null", "epochs=2", "log_every=1", "eval_every=0", "save_every=0", "bucket=false",
            "max_batch_size=null", "max_tokens=700")  # fmt: skip
    data, _ = prepare_data(make_cfg(tiny_store, tmp_path, *args), Accelerator(cpu=True))
    for seed in range(50):  # a seed whose second epoch has fewer micro-batches than its first
        cfg = make_cfg(tiny_store, tmp_path, *args, f"seed={seed}")
        counts = [len(epoch_plan(cfg, data, e)) for e in range(2)]
        if counts[1] < counts[0]:
            break
    assert counts[1] < counts[0]
    run(cfg)
    lines = [m for m in read_metrics(tmp_path) if "loss" in m]
    assert [m["step"] for m in lines] == list(range(1, sum(counts) + 1))
    assert lines[-1]["epoch"] == 1 and all(m["tokens_per_s"] > 0 for m in lines)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["eagle1", "eagle3", "peagle"])
def test_online_gives_the_offline_first_step_loss(request, tiny_conversations, tmp_path, head):
    store = request.getfixturevalue("tiny_store" if head == "eagle1" else "tiny_store_aux")
    args = ("max_steps=1", "log_every=1", "eval_every=0", "save_every=0", "data.eval_fraction=0.1")
    args += HEAD_ARGS[head]
    run(make_cfg(store, tmp_path / "offline", *args))
    run(make_cfg(None, tmp_path / "online", *args, "data.source=online", f"data.path={tiny_conversations}"))
    offline, online = read_metrics(tmp_path / "offline")[0], read_metrics(tmp_path / "online")[0]
    # Same data, same batches, same noise; features computed per batch vs stored: fp32 rounding only.
    keys = {
        "eagle1": ("smooth_l1",),
        "eagle3": ("ce_step2", "ce_step3"),
        "peagle": ("ce_depth2", "ce_depth4"),
    }
    for key in ("loss", "ce") + keys[head]:
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
    config = Qwen2Config(**TINY_SHAPE, max_position_embeddings=512)
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


@pytest.mark.slow
def test_peagle_loss_falls_and_its_head_is_written_with_the_mask_token(tiny_store_aux, tmp_path):
    out = tmp_path / "run"
    args = ("max_steps=60", "optim.warmup_steps=5", "log_every=10", "eval_every=30", "eval_depth=4")
    final = run(make_cfg(tiny_store_aux, out, *PEAGLE, *args))
    lines = [m for m in read_metrics(out) if "loss" in m]
    assert lines[-1]["loss"] < 0.8 * lines[0]["loss"]
    depths = [f"ce_depth{d}" for d in range(1, 5)] + [f"train_cod_acc_depth{d}" for d in range(1, 5)]
    assert set(depths) <= set(lines[0]) and lines[0]["cod_elements_depth2"] < lines[0]["cod_elements_depth1"]
    # the chain simulated as vLLM drafts it, per position, beside the COD elements' own accuracy
    assert {"eval/acc_step4", "eval/accept_len", "eval/cod_acc_depth4"} <= set(final)
    assert final["eval/acc_step1"] > 0.15 and final["eval/accept_len"] > 1.1  # 60 steps: learning
    weights = load_file(str(out / "final" / "model.safetensors"))
    assert weights["mask_hidden"].shape == (1, 1, 192) and weights["mask_embedding"].shape == (64,)
    assert "layers.1.self_attn.q_proj.weight" in weights and not any(k.startswith("embed") for k in weights)
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["eagle_train"]["type"] == "peagle" and config["num_hidden_layers"] == 2
    assert config["mask_token_id"] == config["pard_token"] == 0  # <unk>: never in the data


def test_peagle_refuses_a_mask_token_the_target_emits(tiny_store_aux, tmp_path):
    with pytest.raises(InputError, match="draft.mask_token_id: 1 is the target's BOS token"):
        run(make_cfg(tiny_store_aux, tmp_path / "run", *PEAGLE, "draft.mask_token_id=1", "max_steps=1"))
    assert not (tmp_path / "run").exists()


def test_a_refused_run_leaves_no_out_dir(tiny_store, tmp_path):
    """A run refused by its checks (no feature store there; a store for other aux layers) creates nothing:
    no out_dir, no lock file left beside it."""
    with pytest.raises(StoreError, match="not a complete feature store"):
        run(make_cfg(tmp_path / "no-store", tmp_path / "run", "max_steps=1"))
    with pytest.raises(StoreMismatchError, match="holds no aux layers"):
        run(make_cfg(tiny_store, tmp_path / "run", "draft.type=eagle3", "max_steps=1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


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


# ---------------------------------------------------------------- nothing silently wrong


def copy_store(tiny_store: Path, to: Path) -> Path:
    shutil.copytree(tiny_store, to)
    return to


def hidden_region(store: Path, name: str = "hidden") -> tuple[int, int]:
    """[begin, end) of shard 0's hidden states (or `name`: "aux") in its file."""
    shard = ShardFile(store / shard_name(0))
    begin, end = shard.header[name]["data_offsets"]
    return shard.data_start + begin, shard.data_start + end


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_shard_stops_training_before_any_step(tiny_store, tmp_path, workers):
    """64 flipped bytes in a shard (NaNs in the hidden states) are caught by its checksum, with the store's
    own error whether the loop or a DataLoader worker read the shard (no worker traceback inside it)."""
    store = copy_store(tiny_store, tmp_path / "store")
    begin, _ = hidden_region(store)
    data = bytearray((store / shard_name(0)).read_bytes())
    data[begin + 4096 : begin + 4160] = b"\xff" * 64
    (store / shard_name(0)).write_bytes(bytes(data))
    with pytest.raises(
        StoreError, match=r"^\S*shard-00000.safetensors: its checksum \(sha256\) differs"
    ) as err:
        run(make_cfg(store, tmp_path / "run", "max_steps=2", "save_every=1", f"loader_workers={workers}"))
    assert "\n" not in str(err.value) and "Traceback" not in str(err.value)
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "final").exists()


@pytest.mark.parametrize("head", ["eagle1", "peagle"])
def test_a_non_finite_loss_stops_before_the_step_and_no_checkpoint_holds_it(request, tmp_path, head):
    """Features that are NaN with valid checksums (a bug upstream): the run stops at step 1 naming
    the step and the batch, before the optimizer step, and writes no checkpoint or head (P-EAGLE: NaN in
    the aux features its COD elements read)."""
    store = request.getfixturevalue("tiny_store" if head == "eagle1" else "tiny_store_aux")
    store = copy_store(store, tmp_path / "store")
    begin, end = hidden_region(store, "hidden" if head == "eagle1" else "aux")
    data = bytearray((store / shard_name(0)).read_bytes())
    data[begin:end] = np.full((end - begin) // 4, np.nan, dtype=np.float32).tobytes()
    (store / shard_name(0)).write_bytes(bytes(data))
    reseal(store, 0)
    with pytest.raises(
        NonFiniteError,
        match=r"non-finite training loss .* at step 1 \(epoch 0, micro-batches 0\.\.0 .*samples: ",
    ):
        run(make_cfg(store, tmp_path / "run", "max_steps=3", "save_every=1", *HEAD_ARGS[head]))
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "final").exists()


def test_a_head_with_non_finite_weights_is_never_saved(target, tmp_path):
    head = DraftHead.from_target(target.config)
    head.layers[0].mlp.down_proj.weight.data[3] = float("inf")
    with pytest.raises(ValueError, match=r"layers.0.mlp.down_proj.weight holds \d+ non-finite values"):
        save_head(head, tmp_path / "head")
    assert not (tmp_path / "head").exists()


def fine_tune(tmp_path: Path) -> Path:
    """stories260K with its LM head nudged (as a fine-tune changes it): the same config, other weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES260K)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01 * torch.randn_like(model.lm_head.weight))
    out = tmp_path / "stories260K_finetune"
    model.save_pretrained(out)
    for f in STORIES260K.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def test_a_store_from_a_fine_tune_of_the_same_shape_is_refused(tiny_store, tmp_path):
    """Same config hash, other weights: the fingerprint of the LM head tells them apart."""
    with pytest.raises(
        StoreMismatchError, match=r"target\.weights\.lm_head: expected '[0-9a-f]{16}', found"
    ) as err:
        run(make_cfg(tiny_store, tmp_path / "run", "max_steps=1", f"target.path={fine_tune(tmp_path)}"))
    assert "target.config_hash" not in str(err.value)  # the configs are the same


def test_a_store_from_a_decoder_only_fine_tune_is_refused(tiny_store, tmp_path):
    """Same config, same embedding and LM head, other decoder layers: the store's features
    are another model's. The sha256 of the weight files tells them apart (offline training reads them
    without loading a decoder layer)."""
    model = decoder_fine_tune(tmp_path / "model")
    with pytest.raises(
        StoreMismatchError, match=r"target\.weight_files\.model\.safetensors: expected '[0-9a-f]{64}'"
    ) as err:
        run(make_cfg(tiny_store, tmp_path / "run", "max_steps=1", f"target.path={model}"))
    assert "target.weights." not in str(err.value) and "config_hash" not in str(err.value)


@pytest.mark.slow
def test_online_resume_refuses_a_decoder_only_fine_tune(tiny_conversations, tmp_path):
    """A resumed online run must use the target its checkpoint was trained with, decoder
    layers included (target.path may move; the weights may not change)."""
    from eagle_train.training.resume import CheckpointError

    args = (
        "max_steps=2",
        "save_every=1",
        "eval_every=0",
        "data.source=online",
        f"data.path={tiny_conversations}",
    )
    run(make_cfg(None, tmp_path / "run", *args, "stop_at_step=1"))
    model = decoder_fine_tune(tmp_path / "model")
    with pytest.raises(CheckpointError, match=r"cannot resume: .*target\.weight_files\.model\.safetensors"):
        run(make_cfg(None, tmp_path / "run", *args, f"target.path={model}"))


def test_a_store_without_the_targets_weight_files_is_refused_naming_them(tiny_store, tmp_path):
    """A store whose manifest records no target.weight_files (the sha256 of each of the target's weight
    files, which tell a fine-tune of any layer apart) is refused, naming the missing field."""
    store = copy_store(tiny_store, tmp_path / "store")
    for name in ("manifest.json", "store_config.json"):
        recorded = json.loads((store / name).read_text())
        del recorded["target"]["weight_files"]
        (store / name).write_text(json.dumps(recorded))
    with pytest.raises(
        StoreMismatchError, match=r"target\.weight_files\.model\.safetensors: .*found '<missing>'"
    ):
        run(make_cfg(store, tmp_path / "run", "max_steps=1", "save_every=0", "eval_every=0"))


def test_bad_cadence_settings_fail_when_the_config_is_made(tmp_path):
    """Bad cadence settings (log_every=0, a negative save_every or eval_every, epochs=0) fail when the
    config is made, before the model or the store is loaded."""
    for bad in ("log_every=0", "save_every=-1", "eval_every=-5", "epochs=0"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            make_cfg(tmp_path / "store", tmp_path, bad)


def test_an_eagle3_head_trains_on_an_fp8_store_close_to_the_float32_one(
    tiny_conversations, target_cfg, tiny_store_aux, tmp_path
):
    """EAGLE-3's aux features in fp8 (one scale per token per state), decoded on the device: the first
    step's loss within the features' rounding of the float32 store's."""
    from eagle_train.config.data import DataConfig
    from eagle_train.config.extract import ExtractConfig
    from eagle_train.extract import run as extract

    data = DataConfig(name="tinystories", path=str(tiny_conversations))
    fp8 = tmp_path / "fp8"
    extract(
        ExtractConfig(target=target_cfg, data=data, out_dir=str(fp8), dtype="fp8", progress=False, aux=True)
    )
    args = ("max_steps=1", "log_every=1", "eval_every=0", "save_every=0", *EAGLE3)
    run(make_cfg(tiny_store_aux, tmp_path / "f32", *args))
    run(make_cfg(fp8, tmp_path / "run", *args))
    ref, got = read_metrics(tmp_path / "f32")[0], read_metrics(tmp_path / "run")[0]
    assert got["loss"] == pytest.approx(ref["loss"], rel=0.02)
