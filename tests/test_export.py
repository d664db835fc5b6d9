"""The export stage: Hydra config, run(cfg) on a real checkpoint, bad input, the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from eagle_train.cli import compose
from eagle_train.config.base import to_schema
from eagle_train.config.export import ExportConfig
from eagle_train.export import run
from eagle_train.interop.layouts import export_head, load_draft, load_input_embedding
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.head_checkpoint import load_head, save_head
from eagle_train.runtime.atomic_files import OutputError
from eagle_train.runtime.errors import InputError
from tests.conftest import STORIES260K


def export_cfg(*overrides: str) -> ExportConfig:
    return to_schema(compose("export", overrides=list(overrides)), ExportConfig)


@pytest.fixture
def ckpt(target, tmp_path):
    torch.manual_seed(0)
    head = DraftHead.from_target(target.config, fc_bias=True)
    # what training writes (eagle_train/training/sources.py: checkpoint_identity)
    meta = {
        "target": {"name": "stories260k", "source": str(STORIES260K), "config_hash": "x"},
        "max_len": 384,
        "step": 7,
    }
    return save_head(head, tmp_path / "ckpt", meta)


def test_shipped_config_composes():
    cfg = export_cfg()
    assert cfg.format == "vllm" and cfg.fc_bias == "fold" and cfg.ckpt == ""


@pytest.mark.parametrize(
    "fmt,weights",
    [("vllm", "model.safetensors"), ("sglang", "model.safetensors"), ("eagle", "pytorch_model.bin")],
)
def test_run_writes_each_layout(ckpt, tmp_path, fmt, weights):
    out = run(export_cfg(f"ckpt={ckpt}", f"format={fmt}", f"out_dir={tmp_path / fmt}"))
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", weights])
    text = (out / "config.json").read_text()
    config = json.loads(text)
    assert config["eagle_train"]["target"] == "stories260k" and config["eagle_train"]["max_len"] == 384
    assert config["eagle_train"]["format"] == fmt and config["eagle_train"]["target_config_hash"] == "x"
    # a published config.json carries no local path (the target's directory, the checkpoint's)
    assert str(STORIES260K) not in text and str(tmp_path) not in text and "source_checkpoint" not in text


def test_a_hub_target_id_is_kept(tmp_path, target):
    head = DraftHead.from_target(target.config)
    meta = {"target": {"name": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct"}, "max_len": 9}
    out = run(
        export_cfg(
            f"ckpt={save_head(head, tmp_path / 'c', meta)}", "format=sglang", f"out_dir={tmp_path / 'o'}"
        )
    )
    assert (
        json.loads((out / "config.json").read_text())["eagle_train"]["target_source"]
        == meta["target"]["source"]
    )


def test_a_directory_export_did_not_write_is_refused_with_nothing_deleted(ckpt, tmp_path, monkeypatch):
    """out_dir=DIR holding other files, or out=. in such a directory, is refused and left as it was;
    overwrite=true writes this layout's files there and deletes nothing else."""
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    (mine / "sub" / "data.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(OutputError, match=r"not an earlier format=vllm export \(it holds notes.txt, sub\)"):
        run(export_cfg(f"ckpt={ckpt}", f"out_dir={mine}"))
    monkeypatch.chdir(mine)
    with pytest.raises(OutputError, match="overwrite=true, which writes config.json and model.safetensors"):
        run(export_cfg(f"ckpt={ckpt}", "out_dir=."))
    assert (mine / "notes.txt").read_text() == "keep me" and (mine / "sub" / "data.bin").stat().st_size == 10
    run(export_cfg(f"ckpt={ckpt}", "out_dir=.", "overwrite=true"))
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "model.safetensors", "notes.txt", "sub"]
    assert (mine / "notes.txt").read_text() == "keep me" and (mine / "sub" / "data.bin").exists()
    with pytest.raises(OutputError, match="exists and is not a directory"):
        run(export_cfg(f"ckpt={ckpt}", f"out_dir={mine / 'notes.txt'}"))


def test_an_earlier_export_is_replaced_and_another_layout_needs_overwrite(ckpt, tmp_path):
    out = tmp_path / "export"
    run(export_cfg(f"ckpt={ckpt}", "format=sglang", f"out_dir={out}"))
    # the same layout is replaced
    run(export_cfg(f"ckpt={ckpt}", "format=sglang", f"out_dir={out}", "dtype=bfloat16"))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(OutputError, match="not an earlier format=eagle export"):
        run(export_cfg(f"ckpt={ckpt}", "format=eagle", f"out_dir={out}"))
    run(export_cfg(f"ckpt={ckpt}", "format=eagle", f"out_dir={out}", "overwrite=true"))
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "pytorch_model.bin",
    ]  # its own weights went
    (tmp_path / "empty").mkdir()
    run(export_cfg(f"ckpt={ckpt}", f"out_dir={tmp_path / 'empty'}"))  # an empty directory is written into
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["config.json", "model.safetensors"]


def test_a_head_with_non_finite_weights_is_never_exported(target, tmp_path):
    head = DraftHead.from_target(target.config)
    head.fc.weight.data[0, 0] = float("nan")
    with pytest.raises(ValueError, match="fc.weight holds 1 non-finite values"):
        export_head(head, "vllm", tmp_path / "nan")
    assert not (tmp_path / "nan").exists()


def test_exports_are_readable_by_another_user(ckpt, tmp_path):
    """0755 directories and 0644 files under umask 022 (mkdtemp's 0700 must not survive the rename)."""
    old = os.umask(0o022)
    try:
        for fmt in ("vllm", "sglang", "eagle"):
            out = run(export_cfg(f"ckpt={ckpt}", f"format={fmt}", f"out_dir={tmp_path / 'x' / fmt}"))
            assert oct(out.stat().st_mode & 0o777) == oct(0o755), fmt
            assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o644)}, fmt
        again = save_head(DraftHead.from_target(load_head(ckpt)[0].config), tmp_path / "ckpt2")
        assert oct(again.stat().st_mode & 0o777) == oct(0o755)
    finally:
        os.umask(old)


def test_config_carries_the_targets_limits_and_architectures(ckpt, tmp_path):
    out = run(export_cfg(f"ckpt={ckpt}", f"out_dir={tmp_path / 'o'}"))
    config = json.loads((out / "config.json").read_text())
    target_config = json.loads((STORIES260K / "config.json").read_text())
    assert config["max_position_embeddings"] == target_config["max_position_embeddings"] == 512
    assert config["eagle_train"]["target_architectures"] == ["LlamaForCausalLM"]
    assert config["eagle_train"]["max_len"] == 384


def test_head_dim_re_expression(ckpt, tmp_path):
    out = run(export_cfg(f"ckpt={ckpt}", f"out_dir={tmp_path / 'o'}", "head_dim=32"))
    config = json.loads((out / "config.json").read_text())
    assert config["head_dim"] == 32 and config["eagle_train"]["reexpressed"] == {
        "head_dim": 8,
        "new_head_dim": 32,
    }
    assert load_file(str(out / "model.safetensors"))["layers.0.self_attn.q_proj.weight"].shape == (256, 64)


def test_the_reference_layout_cannot_hold_a_re_expressed_head(ckpt, tmp_path):
    """format=eagle is the reference's own loader (head_dim = hidden / heads): not a layout for vLLM's
    head_dim-32 stories260K; vLLM gets format=vllm (tests/engines)."""
    with pytest.raises(ValueError, match="head_dim \\* num_attention_heads == hidden_size"):
        run(export_cfg(f"ckpt={ckpt}", "format=eagle", f"out_dir={tmp_path / 'o'}", "head_dim=32"))


def test_overrides_and_dtype(ckpt, tmp_path):
    out = run(
        export_cfg(
            f"ckpt={ckpt}",
            "format=sglang",
            f"out_dir={tmp_path / 'o'}",
            "dtype=bfloat16",
            "target_id=my-llama",
            "max_len=2048",
        )
    )
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_train"]["target"] == "my-llama" and config["eagle_train"]["max_len"] == 2048
    assert all(v.dtype == torch.bfloat16 for v in load_file(str(out / "model.safetensors")).values())


def test_bad_input(ckpt, tmp_path):
    with pytest.raises(ValueError, match="format must be one of"):
        export_cfg(f"ckpt={ckpt}", "format=onnx", f"out_dir={tmp_path / 'o'}")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run(export_cfg(f"ckpt={tmp_path / 'missing'}", f"out_dir={tmp_path / 'o'}"))
    with pytest.raises(ValueError, match="set ckpt"):
        run(export_cfg(f"out_dir={tmp_path / 'o'}"))
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        run(export_cfg(f"ckpt={ckpt}", f"out_dir={tmp_path / 'o'}"))
    assert not (tmp_path / "o").exists()


def flip_weight_byte(file) -> None:
    """One bit of a weight flipped, the safetensors header intact (the file still loads)."""
    data = bytearray(file.read_bytes())
    data[-40] ^= 0x01
    file.write_bytes(bytes(data))


def test_a_head_changed_since_it_was_saved_is_refused_naming_the_file(ckpt, target, tmp_path):
    """A head whose weights do not match the sha256 recorded when it was saved (a bit flipped since) is
    refused by export and by evaluate's loader, naming the file; export writes nothing."""
    assert json.loads((ckpt / "config.json").read_text())["eagle_train"]["weights_sha256"]
    flip_weight_byte(ckpt / "model.safetensors")
    message = r"ckpt/model.safetensors: its sha256 differs from the one config.json recorded"
    with pytest.raises(ValueError, match=message):
        run(export_cfg(f"ckpt={ckpt}", f"out_dir={tmp_path / 'o'}"))
    with pytest.raises(ValueError, match=message):
        load_draft(ckpt, target)  # evaluate's loader
    assert not (tmp_path / "o").exists()
    # a training checkpoint's head without that record (an older one): its trainer.json's checksums
    config = json.loads((ckpt / "config.json").read_text())
    del config["eagle_train"]["weights_sha256"]
    (ckpt / "config.json").write_text(json.dumps(config))
    state = ckpt / "training_state"
    state.mkdir()
    (state / "trainer.json").write_text(json.dumps({"files": {"model.safetensors": "0" * 64}}))
    with pytest.raises(ValueError, match=r"model.safetensors: its sha256 differs from the one trainer.json"):
        run(export_cfg(f"ckpt={ckpt}", f"out_dir={tmp_path / 'o'}"))


def test_a_head_whose_recorded_weights_file_is_gone_is_said_to_miss_it(ckpt, target, tmp_path):
    """A head whose model.safetensors was deleted: evaluate's loader (and export's) names the file as
    missing, not as a file whose sha256 differs."""
    head = shutil.copytree(ckpt, tmp_path / "head")
    (head / "model.safetensors").unlink()
    with pytest.raises(InputError, match=r"head/model.safetensors: missing, although config.json records"):
        load_draft(head, target)
    with pytest.raises(FileNotFoundError, match=r"has no model.safetensors"):
        run(export_cfg(f"ckpt={head}", f"out_dir={tmp_path / 'o'}"))


@pytest.mark.parametrize("cut", [100, -100], ids=["header", "data"])
def test_a_truncated_head_file_is_one_line_naming_it(ckpt, target, tmp_path, cut):
    """A truncated model.safetensors (header or data cut) is refused in one line naming the file, not with
    safetensors' raw error, in export (load_head) and evaluate (load_draft); a head with no checksum
    recorded (an export) gets there."""
    exported = export_head(load_head(ckpt)[0], "sglang", tmp_path / "exported")
    weights = exported / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:cut])
    with pytest.raises(ValueError, match=r"exported/model.safetensors: not a readable safetensors file"):
        load_draft(exported, target)
    for f in ("config.json", "model.safetensors"):
        (tmp_path / "plain" / f).parent.mkdir(exist_ok=True)
        (tmp_path / "plain" / f).write_bytes((ckpt / f).read_bytes())
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    del config["eagle_train"]["weights_sha256"]  # a head saved before the record existed
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    weights = tmp_path / "plain" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:cut])
    with pytest.raises(ValueError, match=r"plain/model.safetensors: not a readable safetensors file"):
        run(export_cfg(f"ckpt={tmp_path / 'plain'}", f"out_dir={tmp_path / 'o'}"))


def test_refuse_policy_leaves_nothing(ckpt, tmp_path):
    with pytest.raises(ValueError, match="vLLM's EAGLE fc has no bias"):
        run(export_cfg(f"ckpt={ckpt}", "fc_bias=refuse", f"out_dir={tmp_path / 'o'}"))
    assert not (tmp_path / "o").exists() and list(tmp_path.iterdir()) == [ckpt]


@pytest.mark.slow
def test_cli(ckpt, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "eagle_train.export",
        f"ckpt={ckpt}",
        "format=sglang",
        f"out_dir={tmp_path / 'cli'}",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "cli"]  # Hydra wrote no run directory


def random_head(target, fc_bias: bool) -> DraftHead:
    """Every trainable weight random (norms and fc bias included), the target's embedding / LM head shared."""
    torch.manual_seed(3)
    head = DraftHead.from_target(target.config, fc_bias=fc_bias)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("fc.", "layers.")):
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    head.share_target_weights(target)
    return head.eval()


# sglang and vllm without a bias copy the weights exactly (head outputs compared in tests/interop/test_layouts.py)
@pytest.mark.quick
@pytest.mark.parametrize("fmt,fc_bias", [("vllm", True), ("eagle", True)])
def test_export_import_gives_identical_decoder_output(target, tmp_path, fmt, fc_bias):
    """export -> load_draft -> the speculative decoder drafts, accepts and emits exactly what it did with
    the original head (tokens and per-round acceptance), for every layout."""
    from eagle_train.interop.layouts import export_head

    head = random_head(target, fc_bias)
    embed = load_input_embedding(STORIES260K) if fmt == "eagle" else None
    imported = load_draft(export_head(head, fmt, tmp_path / fmt, embed_tokens=embed), target)
    assert_same_decoding(target, head, imported, abs_confidence=1e-5)  # the vllm fold rounds differently


def assert_same_decoding(target, head, imported, abs_confidence: float, cfg=None) -> None:
    """The EAGLE-2 decoder (or `cfg`'s) emits, drafts and accepts the same with both heads (tokens, rounds,
    accepted lengths, acceptance by position); draft confidences within rounding."""
    from eagle_train.config.decode import DecodeConfig
    from eagle_train.decoding.decoder import SpeculativeDecoder

    cfg = cfg or DecodeConfig(method="dynamic_tree", depth=3, top_k=4, total_tokens=12, max_new_tokens=16)
    prompt = [1, 403, 407, 261, 378, 432, 383, 286, 261, 280, 294, 426]
    runs = [SpeculativeDecoder(target, h, cfg).generate(prompt) for h in (head, imported)]
    assert runs[0].tokens == runs[1].tokens
    stats = [
        {k: v for k, v in r.stats.to_dict().items() if "time" not in k and "second" not in k} for r in runs
    ]
    confidence = [s.pop("node_confidence", None) for s in stats]
    assert stats[0] == stats[1]
    assert confidence[1] == pytest.approx(confidence[0], rel=1e-2, abs=abs_confidence)


@pytest.fixture
def ckpt_eagle3(target, tmp_path):
    """An EAGLE-3 checkpoint as training writes it: random weights, a 256-token draft vocabulary."""
    from eagle_train.modeling.eagle3 import Eagle3Head

    torch.manual_seed(4)
    head = Eagle3Head.from_target(target.config, target.aux_layers, 256)
    head.set_vocabulary(torch.arange(512) % 2 == 1, target.lm_head.weight)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad and "lm_head" not in name:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    head.share_target_weights(target)
    meta = {"target": {"name": "stories260k", "source": str(STORIES260K), "config_hash": "x"}, "max_len": 384}
    return save_head(head, tmp_path / "ckpt3", meta), head.eval()


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "eagle", "speculators"])
def test_eagle3_export_import_gives_identical_decoder_output(target, tmp_path, ckpt_eagle3, fmt):
    """The export stage on an EAGLE-3 checkpoint, then load_draft: the decoder drafts, accepts and emits
    what it did with the trained head, in every layout (speculators: target and K in its config)."""

    ckpt, head = ckpt_eagle3
    out = run(
        export_cfg(f"ckpt={ckpt}", f"format={fmt}", f"out_dir={tmp_path / fmt}", "speculative_tokens=4")
    )
    config = json.loads((out / "config.json").read_text())
    if fmt == "speculators":
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
        # the target's id: a local path is never published (export target_id=HUB_ID names the hub's)
        assert config["speculators_config"]["verifier"]["name_or_path"] == "stories260k"
        assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    else:
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert_same_decoding(target, head, load_draft(out, target), abs_confidence=1e-3)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_peagle_export_ships_the_targets_embedding_and_decodes_as_trained(target, tmp_path, fmt):
    """The export stage on a P-EAGLE checkpoint (which holds one learned row, not the embedding): the file
    carries the TARGET's embedding with that row in place (read from the recorded target source, at the
    re-expressed head_dim too), and load_draft decodes exactly as the trained head does."""
    from eagle_train.modeling.peagle import PEagleHead

    torch.manual_seed(5)
    head = PEagleHead.from_target(target.config, target.aux_layers, 256, 0, target=target, num_layers=2)
    head.set_vocabulary(torch.arange(512) % 2 == 1, target.lm_head.weight)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad and "lm_head" not in name:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    meta = {"target": {"name": "stories260k", "source": str(STORIES260K), "config_hash": "x"}, "max_len": 384}
    ckpt = save_head(head, tmp_path / "ckpt", meta)
    for head_dim, out in ((None, tmp_path / fmt), (32, tmp_path / f"{fmt}32")):
        extra = [f"head_dim={head_dim}"] if head_dim else []
        run(export_cfg(f"ckpt={ckpt}", f"format={fmt}", f"out_dir={out}", *extra))
        embed = load_file(str(out / "model.safetensors"))["embed_tokens.weight"]
        assert torch.equal(embed[1:], target.embed_tokens.weight[1:])  # the target's, not a random one
        assert torch.equal(embed[0], head.mask_embedding.detach())
    assert_same_decoding(target, head.eval(), load_draft(tmp_path / fmt, target), abs_confidence=1e-3)


@pytest.fixture
def ckpt_dflash(target, tmp_path):
    """A DFlash checkpoint as training writes it: two layers reading target layers 1 and 2, blocks of 4."""
    from eagle_train.modeling.dflash import DFlashHead

    torch.manual_seed(6)
    head = DFlashHead.from_target(target.config, [1, 2], 4, 0, target=target, num_layers=2)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    meta = {"target": {"name": "stories260k", "source": str(STORIES260K), "config_hash": "x"}, "max_len": 384}
    return save_head(head, tmp_path / "ckpt_dflash", meta), head.eval()


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_dflash_export_import_gives_identical_decoder_output(target, tmp_path, ckpt_dflash, fmt):
    """The export stage on a DFlash checkpoint: vLLM's layout (`DFlashDraftModel`, `dflash_config` with the
    layers' own ids) or the speculators format (`aux_hidden_state_layer_ids` = those ids + 1, K cut to the
    block's B - 1), tensors without a `model.` prefix; load_draft decodes exactly as the trained head does,
    at the re-expressed head_dim too (exactness of that: tests/interop/test_reexpress.py)."""
    from eagle_train.config.decode import DecodeConfig

    ckpt, head = ckpt_dflash
    out = run(
        export_cfg(f"ckpt={ckpt}", f"format={fmt}", f"out_dir={tmp_path / fmt}", "speculative_tokens=7")
    )
    config = json.loads((out / "config.json").read_text())
    if fmt == "vllm":
        assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
        assert config["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [1, 2]}
        assert config["layer_types"] == ["full_attention"] * 2 and config["block_size"] == 4
    else:
        assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [2, 3]
        assert config["transformer_layer_config"]["architectures"] == ["DFlashDraftModel"]
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        assert config["mask_token_id"] == 0 and config["sliding_window_non_causal"] is True
    assert set(load_file(str(out / "model.safetensors"))) == set(head.trainable_state_dict())
    cfg = DecodeConfig(method="chain", chain_length=3, max_new_tokens=16)
    assert_same_decoding(target, head, load_draft(out, target), abs_confidence=1e-5, cfg=cfg)
    del config["eagle_train"]  # as vLLM's or the speculators library's own file: recognised by its fields
    (out / "config.json").write_text(json.dumps(config))
    assert_same_decoding(target, head, load_draft(out, target), abs_confidence=1e-5, cfg=cfg)
    wide = run(export_cfg(f"ckpt={ckpt}", f"format={fmt}", f"out_dir={tmp_path / 'wide'}", "head_dim=32"))
    assert load_draft(wide, target).config.head_dim == 32


@pytest.mark.parametrize("fmt", ["sglang", "eagle"])
def test_a_dflash_head_has_no_sglang_or_reference_layout(ckpt_dflash, tmp_path, fmt):
    with pytest.raises(InputError, match=f"format={fmt}: a DFlash head: .* has no DFlash layout here"):
        run(export_cfg(f"ckpt={ckpt_dflash[0]}", f"format={fmt}", f"out_dir={tmp_path / fmt}"))
    assert not (tmp_path / fmt).exists()
