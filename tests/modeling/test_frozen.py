"""The target's frozen parts read from its checkpoint alone (eagle_train.modeling.frozen): the same tensors
as a full load, only the shards that hold them read, no decoder layer built."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open

import eagle_train.modeling.frozen as frozen
from eagle_train.config.target import TargetConfig
from eagle_train.modeling.frozen import CheckpointError, load_frozen_target
from eagle_train.modeling.random_target import llama_config, save_random_llama
from eagle_train.modeling.target import load_target


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A random untied Llama saved as 4 safetensors shards (embedding and LM head in different ones)."""
    return save_random_llama(tmp_path_factory.mktemp("sharded"), llama_config("tiny"), max_shard_size="60KB")


def as_pytorch_shards(safetensors_dir, out):
    """The same checkpoint as pytorch_model-*.bin shards with a pytorch_model.bin.index.json."""
    index = json.loads((safetensors_dir / "model.safetensors.index.json").read_text())
    out.mkdir()
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(safetensors_dir / file), "pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
        name = file.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
        torch.save(state, out / name)
        weight_map.update(dict.fromkeys(state, name))
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in safetensors_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def no_decoder_builds(monkeypatch):
    """from_pretrained fails: only the meta-device class may be built."""

    def refuse(*args, **kwargs):
        raise AssertionError("the whole target was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def tensor_reads(monkeypatch) -> list:
    """The files the checkpoint readers open from now on (safe_open, torch.load); the whole model may
    not be built."""
    opened = []
    real_safe_open, real_load = frozen.safe_open, torch.load
    monkeypatch.setattr(frozen, "safe_open", lambda f, **kw: opened.append(f) or real_safe_open(f, **kw))
    monkeypatch.setattr(torch, "load", lambda f, **kw: opened.append(str(f)) or real_load(f, **kw))
    no_decoder_builds(monkeypatch)
    return opened


@pytest.mark.parametrize("layout", ["safetensors", "pytorch"])
def test_frozen_parts_equal_the_full_models_and_only_their_shards_are_read(
    sharded, tmp_path, layout, monkeypatch
):
    path = sharded if layout == "safetensors" else as_pytorch_shards(sharded, tmp_path / "bin")
    cfg = TargetConfig(name="tiny", path=str(path), dtype="float32")
    full = load_target(cfg)
    opened = tensor_reads(monkeypatch)
    parts = load_frozen_target(cfg, norm=True)
    assert torch.equal(parts.embed_tokens.weight, full.embed_tokens.weight)
    assert torch.equal(parts.lm_head.weight, full.lm_head.weight)
    assert torch.equal(parts.norm.weight, full.model.model.norm.weight)
    assert parts.weight_fingerprint == full.weight_fingerprint and parts.vocab_size == full.vocab_size
    x = torch.randn(3, full.hidden_size)
    assert torch.equal(parts.norm(x), full.model.model.norm(x))  # the model's own norm module
    index = json.loads(next(path.glob("*.index.json")).read_text())["weight_map"]
    needed = {index[k] for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")}
    assert {str(f).rsplit("/", 1)[-1] for f in opened} == needed < set(index.values())


def test_the_weight_files_identity_reads_no_tensor(sharded, monkeypatch):
    """The identity covers every weight file (decoder layers included) and offline training's
    frozen parts compute it from the files' bytes alone: no tensor read, no decoder built."""
    from eagle_train.runtime.atomic_files import file_sha256

    cfg = TargetConfig(name="tiny", path=str(sharded), dtype="float32")
    parts = load_frozen_target(cfg)
    opened = tensor_reads(monkeypatch)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert len(files) > 2 and parts.weight_files == {f: file_sha256(sharded / f) for f in files}
    assert opened == []


def test_a_tied_lm_head_is_the_embedding_one_copy(target_cfg, target):
    parts = load_frozen_target(target_cfg)
    assert parts.lm_head.weight.data_ptr() == parts.embed_tokens.weight.data_ptr()
    assert torch.equal(parts.lm_head.weight, target.lm_head.weight)
    half = load_frozen_target(target_cfg, dtype=torch.bfloat16)  # converted once, still one copy
    assert (
        half.dtype == torch.bfloat16 and half.lm_head.weight.data_ptr() == half.embed_tokens.weight.data_ptr()
    )
    assert half.weight_fingerprint == target.weight_fingerprint  # bf16-rounded either way


def test_a_checkpoint_without_the_lm_head_is_named(sharded, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in sharded.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"]["lm_head.weight"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' is not in its checkpoint"):
        load_frozen_target(TargetConfig(path=str(broken)))


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_damaged_or_forged_weight_file_is_one_line_naming_it(tmp_path):
    """A target checkpoint cut short or holding a forged pickle is refused in one line naming the file
    (not safetensors' or torch's raw error); the pickle's code never runs."""
    import pickle
    import shutil

    from tests.conftest import STORIES260K

    model = shutil.copytree(STORIES260K, tmp_path / "model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    cfg = TargetConfig(name="cut", path=str(model), dtype="float32")
    with pytest.raises(CheckpointError, match=r"model/model.safetensors: cannot be read as a weight file"):
        load_frozen_target(cfg)
    with pytest.raises(ValueError, match=r"target .*/model: a weight file cannot be read \(SafetensorError"):
        load_target(cfg)
    weights.unlink()
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"model/pytorch_model.bin: cannot be read as a weight file"):
        load_frozen_target(cfg)
    with pytest.raises(
        ValueError, match=r"a weight file cannot be read \(UnpicklingError: Weights only load"
    ):
        load_target(cfg)
    assert not (tmp_path / "PWNED").exists() and not os.path.exists("PWNED")
