"""Decoding with a DFlash head (decoding.drafter.BlockDrafter) on the real stories260K target: the cached
context equals a recompute over the whole prefix, one draft forward per round, greedy output is the model's
own (Hugging Face `generate` and plain decoding) token for token across EOS and the context limit, a
trained head is accepted, and what is not built (trees, decode.shape=auto) is refused naming why. Lossless
sampling: tests/decoding/test_sampling_generate.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from eagle_train.autotune.shapes import tune_shapes
from eagle_train.config.decode import DecodeConfig
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.decoding.drafter import BlockDrafter
from eagle_train.decoding.stats import GenerationStats
from eagle_train.runtime.errors import InputError
from tests.decoding.test_decoder import generate, prompts

CHAIN = DecodeConfig(method="chain", chain_length=4)


def recomputed(head, tokens: torch.Tensor, features: torch.Tensor, committed: int) -> torch.Tensor:
    """The block's slot log-probs [B - 1, vocab] by the head's cache-free forward over the whole context:
    the root tokens[committed] after the features of positions 0..committed-1."""
    block = torch.full((1, head.block_size), head.mask_token_id)
    block[0, 0] = tokens[committed]
    positions = torch.arange(committed, committed + head.block_size)[None]
    states = head(block, features[None, :committed], positions)[0, 1:]
    return torch.log_softmax(head.logits(states).float(), dim=-1)


def test_the_cached_context_equals_a_recompute_over_the_whole_prefix(target, random_dflash_head):
    """Catch-ups of the prompt, then of 3, 1 and 2 positions, append the context's keys and values; each
    round's block equals the cache-free forward over everything committed so far, and so does a rewind to
    an earlier position followed by another catch-up (two layers, norms away from 1)."""
    head = random_dflash_head
    prompt = prompts(target, 1)[0]
    seq = torch.tensor(prompt + [411, 29, 260, 101, 92, 7, 350])  # [T]
    _, features = target.aux_hidden_states(seq[None], None, head.aux_layers)  # [1, T, 2 d]
    features = features[0]
    drafter = BlockDrafter(head, seq.numel(), GenerationStats())
    committed = 0
    with torch.inference_mode():
        for m in (len(prompt) - 1, 3, 1, 2):
            drafter.catch_up(seq[committed + 1 : committed + m + 1], features[committed : committed + m])
            committed += m
            assert drafter.committed == drafter.cache.seq_len == committed
            expected = recomputed(head, seq, features, committed)
            assert torch.allclose(drafter.round_logp, expected, atol=1e-5), committed
        drafter.rewind(committed - 4)
        drafter.catch_up(seq[committed - 3 : committed - 1], features[committed - 4 : committed - 2])
        assert torch.allclose(drafter.round_logp, recomputed(head, seq, features, committed - 2), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "head_kind", ["random_dflash_head", pytest.param("trained_dflash_head", marks=pytest.mark.quick)]
)
def test_greedy_dflash_is_the_models_own_output_from_one_draft_forward_per_round(
    request, target, head_kind, monkeypatch
):
    """Chains of min(4, B - 1) drafts (the random head's blocks of 6: 4; the trained head's of 4: 3), each
    round's from ONE draft forward: Hugging Face `generate`'s tokens and plain decoding's, and a trained
    head is accepted (tau > 1)."""
    head = request.getfixturevalue(head_kind)
    blocks = []
    original = BlockDrafter.catch_up

    def counting(self, *args):
        blocks.append(1)
        return original(self, *args)

    monkeypatch.setattr(BlockDrafter, "catch_up", counting)
    for prompt in prompts(target):
        hf = generate(target, None, DecodeConfig(method="hf"), prompt, max_new_tokens=100)
        ar = generate(target, None, DecodeConfig(method="ar"), prompt, max_new_tokens=100)
        blocks.clear()
        result = generate(target, head, CHAIN, prompt, max_new_tokens=100)
        assert result.tokens == hf.tokens == ar.tokens and result.stop_reason == ar.stop_reason
        assert len(blocks) <= result.stats.rounds + 1  # the prefill's block, then one per round
        assert max(result.stats.tree_depth_per_round) == min(4, head.block_size - 1)
        if head_kind.startswith("trained"):
            assert result.stats.tau > 1.2, result.stats.tau


@pytest.mark.slow
def test_greedy_dflash_stops_like_plain_decoding(target, target_cfg, random_dflash_head, trained_dflash_head):
    """At the stop token, and at the context limit (every room left: the chain is cut to fit)."""
    eos = target.tokenizer("Once upon a time, there was a cat. The cat was happy. The end.")["input_ids"]
    ar = generate(target, None, DecodeConfig(method="ar"), eos, max_new_tokens=400)
    assert ar.stop_reason == "stop_token"
    assert generate(target, trained_dflash_head, CHAIN, eos, max_new_tokens=400).tokens == ar.tokens
    prompt = prompts(target, 1)[0]
    for limit in range(len(prompt) + 2, len(prompt) + 8):
        short = replace(target, cfg=replace(target_cfg, max_len=limit))
        ar = generate(short, None, DecodeConfig(method="ar"), prompt, max_new_tokens=500)
        for head in (random_dflash_head, trained_dflash_head):
            result = generate(short, head, CHAIN, prompt, max_new_tokens=500)
            assert result.tokens == ar.tokens and result.stop_reason == "context"


def test_trees_and_autotuning_are_refused_naming_why(target, random_dflash_head, tmp_path):
    for method in ("static_tree", "dynamic_tree"):
        with pytest.raises(ValueError, match=f"decode.method={method}: a dflash head drafts a chain"):
            SpeculativeDecoder(target, random_dflash_head, DecodeConfig(method=method))
    with pytest.raises(
        InputError, match=r"decode.shape=auto does not tune a dflash head's chain yet: .*K <= 5"
    ):
        tune_shapes(target, random_dflash_head, [[1, 2, 3]], 8, tmp_path)
