"""The greedy-identity contract below float32: a differing answer is classified by its first differing
token as a near-tie (both candidates within a few ulps of the top logit) or a real divergence; checked
on real bf16 logits of stories260K on the CPU (a tree forward against one-token forwards)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from eagle_train.config.decode import DecodeConfig
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.decoding.identity import classify_divergence, first_divergence, logit_ulp
from eagle_train.modeling.target import load_target
from tests.decoding.test_decoder import prompts


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_ulp_of_the_logits_dtype():
    assert logit_ulp(13.0, torch.bfloat16) == 2.0**-4  # [8, 16): 7 stored mantissa bits
    assert logit_ulp(-16.5, torch.bfloat16) == 2.0**-3
    assert logit_ulp(13.0, torch.float32) == 2.0**-20
    assert logit_ulp(0.0, torch.bfloat16) > 0


def test_near_tie_versus_real_divergence():
    logits = torch.tensor([12.0, 12.0625, 3.0, 11.0])  # 12.0625 = 12 + 1 bf16 ulp
    near = classify_divergence(logits, 1, 0, torch.bfloat16, ulps=4)
    assert near["kind"] == "near_tie" and near["gap"] == pytest.approx(0.0625) and near["ulp"] == 0.0625
    assert classify_divergence(logits, 1, 3, torch.bfloat16, ulps=4)["kind"] == "divergence"  # 17 ulps
    assert classify_divergence(logits, 1, 0, torch.float32, ulps=4)["kind"] == "divergence"  # fp32: 2^15 ulps
    assert classify_divergence(logits, 1, 0, torch.bfloat16, ulps=0)["kind"] == "divergence"


@pytest.fixture(scope="module")
def bf16_target(target_cfg):
    return load_target(replace(target_cfg, dtype="bfloat16"))


@pytest.mark.slow
def test_bf16_tree_and_one_token_forwards_differ_only_at_near_ties(bf16_target):
    """The premise and the classification on real bf16 logits: one forward over 60 draft positions (what a
    chain verification computes) and 60 one-token forwards (plain decoding) over the same tokens give
    different logits; wherever their argmax differs, the two tokens are a near-tie."""
    from eagle_train.diagnostics.gpu_checks import tree_versus_one_token

    target = bf16_target
    ar = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=61))
    found = [tree_versus_one_token(target, p, ar.generate(p).tokens[:60]) for p in prompts(target, 6)]
    assert max(f["max_abs_diff"] for f in found) > 0  # bf16: the two forwards are not bit-identical
    flips = sum(f["flips"] for f in found)
    assert flips > 0  # their argmax does flip at some positions of these prompts
    assert sum(f["flips_near_tie"] for f in found) == flips  # and each flip is a near-tie
