"""The head_dim re-expression: the real stories260K and a draft head give the same outputs with
head_dim 32 as with 8 (logits within 1e-5), and what cannot be exact is refused."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from eagle_train.config.decode import DecodeConfig
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.interop.reexpress import main, rotary_slots, widen_head, widen_model_dir
from eagle_train.modeling.target import load_target
from tests.conftest import STORIES260K, error_line, untrained_dflash_head
from tests.interop.test_layouts import head_outputs, make_head

PROMPTS = [[1, 403, 407, 261, 378, 432, 383, 286, 261, 280, 294, 426], [1, 365, 300, 280, 423, 268]]


# Padded head dims change the matmuls' reduction lengths, so float32 rounding differs with the CPU's kernels
# (1.2e-5 on logits, 2.7e-5 on head outputs measured on one machine, under 1e-5 on another); a wrong
# re-expression (scale, head order, padding) differs by orders of magnitude more.
ATOL = 1e-4


@pytest.fixture(scope="module")
def wide_target(target_cfg, tmp_path_factory):
    out = widen_model_dir(target_cfg.path, tmp_path_factory.mktemp("hd32") / "stories260K-hd32", 32)
    return load_target(dataclasses.replace(target_cfg, name="stories260k-hd32", path=str(out)))


def test_slots_keep_rotary_pairs_and_frequencies():
    slots = rotary_slots(8, 32)
    assert slots.tolist() == [0, 4, 8, 12, 16, 20, 24, 28]
    base, d, n = 10000.0, 8, 32
    for j in range(d // 2):  # slot r*j turns at the frequency of dimension j; its partner is N/2 away
        assert base ** (-2 * int(slots[j]) / n) == pytest.approx(base ** (-2 * j / d), rel=1e-12)
        assert int(slots[j + d // 2]) - int(slots[j]) == n // 2
    with pytest.raises(ValueError, match="not an even multiple"):
        rotary_slots(8, 36)


def test_target_written_with_head_dim_32(target, wide_target):
    out = wide_target.source
    config = json.loads(open(f"{out}/config.json").read())
    assert config["head_dim"] == 32 and config["hidden_size"] == 64 and config["num_attention_heads"] == 8
    assert config["eagle_train_reexpressed"]["head_dim"] == 8
    state = load_file(f"{out}/model.safetensors")
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (8 * 32, 64)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (4 * 32, 64)
    assert state["model.layers.0.self_attn.o_proj.weight"].shape == (64, 8 * 32)
    tokenizer = AutoTokenizer.from_pretrained(target.source)
    assert wide_target.tokenizer.encode("Once upon a time") == tokenizer.encode("Once upon a time")


def test_target_logits_equal(target, wide_target):
    ids = torch.tensor(PROMPTS[0]).unsqueeze(0)
    logits, hidden = target.features(ids)
    wide_logits, wide_hidden = wide_target.features(ids)
    torch.testing.assert_close(wide_logits, logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(wide_hidden, hidden, rtol=0, atol=ATOL)


def test_the_check_can_fail(target, wide_target):
    """Without the sqrt(r) scale on q the logits move far beyond the tolerance."""
    model = copy.deepcopy(wide_target.model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight /= 2  # r = 4: the scale is exactly 2
    ids = torch.tensor(PROMPTS[0]).unsqueeze(0)
    with torch.no_grad():
        assert (model(ids).logits - target.features(ids)[0]).abs().max() > 1e-2


def test_head_outputs_equal_and_decoding_identical(target, wide_target):
    head = make_head(target, fc_bias=True)
    wide = widen_head(head, 32)
    assert wide.config.head_dim == 32 and wide.layers[0].self_attn.q_proj.weight.shape == (256, 64)
    torch.testing.assert_close(head_outputs(wide), head_outputs(head), rtol=0, atol=ATOL)
    cfg = DecodeConfig(method="chain", chain_length=3, max_new_tokens=24)
    narrow = SpeculativeDecoder(target, head, cfg).generate(PROMPTS[1])
    widened = SpeculativeDecoder(wide_target, wide, cfg).generate(PROMPTS[1])
    assert widened.tokens == narrow.tokens
    assert widened.stats.accepted_per_round == narrow.stats.accepted_per_round


def test_a_dflash_head_with_per_head_norms_decodes_identically(target, wide_target):
    """q_norm / k_norm (Qwen3-style) normalise over head_dim: k_proj is scaled like q_proj and k_norm's
    weight undoes it, so a DFlash head's blocks and chains are the same at head_dim 32."""
    head = untrained_dflash_head(target, 4, seed=3)
    wide = widen_head(head, 32).eval()
    assert wide.layers[0].self_attn.k_norm.weight.shape == (32,)
    features, ids = torch.randn(1, 6, 2 * 64), torch.tensor([[5, 0, 0, 0]])
    context, block = torch.arange(6).unsqueeze(0), torch.arange(6, 10).unsqueeze(0)
    with torch.no_grad():
        outputs = [h(ids, features, block, context) for h in (head, wide)]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=ATOL)
    cfg = DecodeConfig(method="chain", chain_length=3, max_new_tokens=24)
    narrow = SpeculativeDecoder(target, head, cfg).generate(PROMPTS[1])
    widened = SpeculativeDecoder(wide_target, wide, cfg).generate(PROMPTS[1])
    assert widened.tokens == narrow.tokens
    assert widened.stats.accepted_per_round == narrow.stats.accepted_per_round


def test_inexact_rope_is_refused(target):
    head = make_head(target)
    head.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="'dynamic' depends on head_dim"):
        widen_head(head, 32)


def test_cli_never_removes_what_it_did_not_write(tmp_path, capsys):
    """OUT is written when absent or empty and replaced when it is an earlier output of the command; a
    directory of the user's files, a user's file and the source model itself are refused in one line and
    left as they were; --overwrite writes the model's files into the user's directory and deletes nothing
    there."""
    source = STORIES260K
    before = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    empty = tmp_path / "empty"
    empty.mkdir()
    main([str(source), str(empty)])
    main([str(source), str(empty), "--head-dim", "16"])  # an earlier output: replaced whole
    assert json.loads((empty / "config.json").read_text())["head_dim"] == 16
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    (mine / "sub" / "data.bin").write_bytes(b"0123456789")
    user_file = tmp_path / "user.txt"
    user_file.write_text("keep me too")
    refusals = [
        ([str(source), str(mine)], r"mine is not empty and is not an earlier output .* holds notes.txt, sub.*--overwrite"),
        ([str(source), str(user_file)], r"user.txt exists and is not a directory.*--overwrite"),
        ([str(source), str(source)], r"is the source model itself"),
        ([str(source), str(source), "--overwrite"], r"is the source model itself"),
    ]  # fmt: skip
    for argv, message in refusals:
        capsys.readouterr()
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 1
        assert re.fullmatch(rf"error: .*{message}.*", error_line(capsys.readouterr().err))
    assert (mine / "notes.txt").read_text() == "keep me" and (mine / "sub" / "data.bin").stat().st_size == 10
    assert user_file.read_text() == "keep me too"
    assert {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()} == before
    main([str(source), str(mine), "--overwrite"])
    assert sorted(p.name for p in mine.iterdir()) == sorted(
        {"notes.txt", "sub", *before} - {"README.md", "greedy_reference.json"}
    )
    assert (mine / "notes.txt").read_text() == "keep me" and (mine / "sub" / "data.bin").stat().st_size == 10


@pytest.mark.parametrize("head_dim", ["-8", "0", "12"])
def test_cli_refuses_a_head_dim_that_cannot_hold_the_model_s_in_one_line(tmp_path, capsys, head_dim):
    """A negative, zero or non-multiple --head-dim is one line naming it, and nothing is written."""
    with pytest.raises(SystemExit) as stopped:
        main([str(STORIES260K), str(tmp_path / "wide"), "--head-dim", head_dim])
    assert stopped.value.code == 1
    line = error_line(capsys.readouterr().err)
    assert f"{head_dim}" in line and "multiple of" in line and "8" in line
    assert not (tmp_path / "wide").exists()


def test_cli_defaults_to_the_configured_target(tmp_path, capsys):
    main([str(tmp_path / "wide")])
    assert "head_dim 32" in capsys.readouterr().out
    assert json.loads((tmp_path / "wide" / "config.json").read_text())["head_dim"] == 32
    assert (tmp_path / "wide" / "tokenizer.json").is_file()


def test_eagle3_head_outputs_equal_and_decoding_identical(target, wide_target):
    """The EAGLE-3 midlayer's attention (q/k/v over 2d inputs) re-expresses the same way; its own LM
    head, norms, fc and d2t/t2d are kept as they are."""
    from tests.interop.test_eagle3_layouts import make_head as make_eagle3_head
    from tests.interop.test_eagle3_layouts import outputs

    head = make_eagle3_head(target, fc_norm=True, norm_output=True)
    wide = widen_head(head, 32)
    assert wide.kind == "eagle3" and wide.config.head_dim == 32 and wide.aux_layers == head.aux_layers
    assert wide.midlayer.self_attn.q_proj.weight.shape == (256, 128) and torch.equal(wide.d2t, head.d2t)
    logits, tokens = outputs(wide)
    torch.testing.assert_close(logits, outputs(head)[0], rtol=0, atol=ATOL)
    cfg = DecodeConfig(method="chain", chain_length=3, max_new_tokens=24)
    narrow = SpeculativeDecoder(target, head, cfg).generate(PROMPTS[1])
    widened = SpeculativeDecoder(wide_target, wide, cfg).generate(PROMPTS[1])
    assert widened.tokens == narrow.tokens
    assert widened.stats.accepted_per_round == narrow.stats.accepted_per_round
