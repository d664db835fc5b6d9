"""The unroll of EAGLE-3's training-time test (and the chain metrics): the diagonal attention equals the
dense-mask reference, and step k at column j equals drafting a chain from j at decode time."""

from __future__ import annotations

import pytest
import torch

from eagle_train.decoding.kv_cache import StaticKVCache
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.eagle3 import Eagle3Head
from eagle_train.training import ttt as unroll_module
from eagle_train.training.ttt import unroll
from tests.reference import dense_unroll, tiny_head_config

CONFIG = tiny_head_config(40)


def randomised(head):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    return head.double().eval()  # float64: the comparisons check the algebra, not the rounding


HEADS = {
    "eagle1": lambda: DraftHead(CONFIG),
    "eagle3": lambda: Eagle3Head(CONFIG, [0, 1, 2], 40),
    "eagle3.1": lambda: Eagle3Head(CONFIG, [0, 1, 2], 40, fc_norm=True, norm_output=True),
}


def inputs(kind: str, b: int = 2, n: int = 9):
    g = torch.Generator().manual_seed(1)
    width = 16 if kind == "eagle1" else 48
    return torch.randint(0, 40, (b, n), generator=g), torch.randn(
        b, n, width, generator=g, dtype=torch.float64
    )


@pytest.fixture(params=["fused", "scores"])
def attention(request, monkeypatch):
    """Both ways `DiagonalCache` attends: the CPU's fused causal kernel joined to the diagonal by its
    log-sum-exp, and the [n, n] score block (other devices, or a torch without the kernel)."""
    if request.param == "scores":
        monkeypatch.setattr(unroll_module, "FLASH_CPU", None)
    elif unroll_module.FLASH_CPU is None:
        pytest.skip("this torch has no fused CPU attention kernel")
    return request.param


@pytest.mark.parametrize("kind", sorted(HEADS))
@torch.no_grad()
def test_diagonal_attention_equals_the_dense_mask(kind, attention):
    head = randomised(HEADS[kind]())
    ids, feats = inputs(kind)
    fast, dense = unroll(head, ids, feats, 5), dense_unroll(head, ids, feats, 5)
    for a, b in zip(fast, dense, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["eagle3", "eagle3.1"])
def test_diagonal_attention_gradients_equal_the_dense_masks(kind, attention):
    """The fused path's hand-written backward: every parameter's and input feature's gradient of a loss
    over all the unrolled steps equals autograd's through the dense-mask reference (float64)."""
    head = randomised(HEADS[kind]())
    ids, feats = inputs(kind, b=2, n=11)
    weights = [
        torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
        for k in range(5)
    ]

    def gradients(run):
        head.zero_grad()
        x = feats.clone().requires_grad_()
        sum((out * w).sum() for out, w in zip(run(head, ids, x, 5), weights, strict=True)).backward()
        return [x.grad] + [p.grad for p in head.parameters()]

    for a, b in zip(gradients(unroll), gradients(dense_unroll), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", sorted(HEADS))
@torch.no_grad()
def test_step_k_at_column_j_is_the_chain_drafted_from_j(kind):
    """Decode time: commit the real pairs 0..j in a KV cache, then draft a chain, each step fed the last
    output (at position j + k, attending to the prefix and the chain so far)."""
    head = randomised(HEADS[kind]())
    ids, feats = inputs(kind, b=1, n=10)
    steps = unroll(head, ids, feats, 4)
    for j in (0, 4, 6):
        cache = StaticKVCache(1, 2, 4, 32, dtype=torch.float64)
        out = head(ids[:, : j + 1], feats[:, : j + 1], torch.arange(j + 1)[None], None, cache)[:, -1:]
        cache.advance(j + 1)
        torch.testing.assert_close(out[0, 0], steps[0][0, j], rtol=1e-10, atol=1e-10)
        for k in range(1, 4):
            if j + k >= ids.shape[1]:
                break
            out = head(ids[:, j + k : j + k + 1], out, torch.tensor([[j + k]]), None, cache)
            cache.advance(1)
            torch.testing.assert_close(out[0, 0], steps[k][0, j], rtol=1e-10, atol=1e-10)


def test_gradients_flow_through_every_step():
    head = HEADS["eagle3"]().train()
    ids, feats = inputs("eagle3")
    outs = unroll(head, ids, feats.float(), 3)
    head.logits(outs[-1]).sum().backward()  # the last step depends on fc through the fed-back states
    assert head.fc.weight.grad.abs().sum() > 0 and head.midlayer.hidden_norm.weight.grad.abs().sum() > 0
