"""P-EAGLE's COD sequence (eagle_train.training.cod) against brute force: which elements a sample keeps, the
attention of the flattened forward (== the dense unroll of every chain == vLLM's causal draft over
[context | placeholders]), and the loss sums (chunked == one-shot, KL == CE - entropy)."""

from __future__ import annotations

import pytest
import torch

from eagle_train.modeling.peagle import PEagleHead
from eagle_train.training.cod import (
    CodBatch,
    by_depth,
    cod_attention_mask,
    cod_forward,
    cod_sample,
    expected_elements,
    flatten_cod,
)
from eagle_train.training.loss import chain_accepted, chain_parents, parallel_loss_sums
from eagle_train.training.ttt import parallel_unroll
from tests.decoding.test_lean_draft import config


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_depth_d_keeps_a_subset_of_the_chains_one_position_on_all_on_the_loss_mask():
    valid = torch.rand(200, generator=generator(1)) < 0.7
    valid[150:] = False  # a reply ends
    anchor, depth = cod_sample(valid, 190, 6, 0.8, 0.2, generator())
    assert torch.equal(anchor[:190], torch.arange(190)) and not depth[:190].any()  # every real position
    kept = {(int(a), int(d)) for a, d in zip(anchor, depth, strict=True)}
    seeds = int(valid[:190].sum())
    for d in range(1, 6):
        at_d = [a for a, dd in kept if dd == d]
        assert len(at_d) <= int((seeds - d) * max(0.8**d, 0.2))
        for a in at_d:
            assert (a, d - 1) in kept and all(valid[a + k] for k in range(1, d + 1))  # its chain, masked
    assert len([1 for _, d in kept if d == 1]) == int((seeds - 1) * 0.8)  # enough candidates: exactly
    assert len(kept) == anchor.numel()  # no element twice


def test_the_sample_is_a_function_of_the_generator_and_max_anchors_bounds_it():
    valid = torch.ones(64, dtype=torch.bool)
    a1, d1 = cod_sample(valid, 64, 4, 0.7, 0.2, generator(3))
    a2, d2 = cod_sample(valid, 64, 4, 0.7, 0.2, generator(3))
    a3, _ = cod_sample(valid, 64, 4, 0.7, 0.2, generator(4))
    assert torch.equal(a1, a2) and torch.equal(d1, d2) and not torch.equal(a1, a3)
    assert a1.numel() <= expected_elements(64, 4, 0.7, 0.2)
    anchor, depth = cod_sample(valid, 64, 4, 1.0, 1.0, generator(), max_anchors=5)
    assert int((depth == 1).sum()) <= 5 and int((depth == 0).sum()) == 64


def brute_mask(cod: CodBatch, row: int) -> torch.Tensor:
    """The attention rule written out element by element."""
    a, d, real = cod.anchor[row].tolist(), cod.depth[row].tolist(), cod.real[row].tolist()
    size = len(a)
    out = torch.zeros(size, size, dtype=torch.bool)
    for q in range(size):
        for k in range(size):
            if not real[q]:
                out[q, k] = q == k
            elif real[k]:
                out[q, k] = (d[k] == 0 and a[k] <= a[q]) or (a[k] == a[q] and d[k] <= d[q])
    return out


def test_the_attention_mask_is_the_rule_element_by_element():
    mask = torch.rand(2, 30, generator=generator(5)) < 0.8
    cod = flatten_cod(mask, torch.tensor([30, 17]), 4, 0.8, 0.2, generator())
    assert cod.real[1].sum() < cod.real[0].sum()  # rows of their own lengths, padded
    full = cod_attention_mask(cod)
    for row in range(2):
        assert torch.equal(full[row, 0], brute_mask(cod, row))


def peagle_head(layers: int = 2) -> PEagleHead:
    torch.manual_seed(0)
    shape = config(2)
    shape.num_hidden_layers = layers
    head = PEagleHead(shape, [0, 1, 2], 20, mask_token_id=3)
    with torch.no_grad():
        head.mask_embedding.normal_()
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return head.eval()


@torch.no_grad()
def test_one_flattened_forward_gives_every_chains_drafts_as_vllm_makes_them():
    """COD's flattened forward == the dense unroll of every chain (prefix + diagonal attention) == one
    causal forward over [pairs 0..a | d placeholders] (vLLM's parallel draft), element by element; the
    elements of another row (another conversation) change nothing."""
    head = peagle_head()
    b, n, steps = 2, 14, 4
    ids, feats = (
        torch.randint(4, 50, (b, n), generator=generator(1)),
        torch.randn(b, n, 96, generator=generator(2)),
    )
    cod = flatten_cod(torch.ones(b, n, dtype=torch.bool), torch.tensor([n, 11]), steps, 0.9, 0.5, generator())
    fed_ids, fed = head.placeholders(cod.gather(ids), cod.gather(feats), cod.depth > 0)
    flat = head(fed_ids, fed, cod.positions, cod_attention_mask(cod))  # [b, T, d]
    dense = torch.stack(parallel_unroll(head, ids, feats, steps))  # [steps, b, n, d]
    for row in range(b):
        for t in torch.nonzero(cod.real[row]).flatten().tolist():
            a, d = int(cod.anchor[row, t]), int(cod.depth[row, t])
            torch.testing.assert_close(flat[row, t], dense[d, row, a], rtol=1e-4, atol=1e-5)
            if d and row == 0 and a % 3 == 0:  # vLLM: one causal forward, placeholders after the context
                chain_ids = torch.cat([ids[0, : a + 1], torch.full((d,), 3)])
                chain = torch.cat([feats[0, : a + 1], head.mask_hidden.reshape(1, -1).expand(d, -1)])
                causal = head(chain_ids[None], chain[None])[0, -1]
                torch.testing.assert_close(flat[row, t], causal, rtol=1e-4, atol=1e-5)
    other = feats.clone()
    other[1] += 1.0
    _, fed_other = head.placeholders(cod.gather(ids), cod.gather(other), cod.depth > 0)
    again = head(fed_ids, fed_other, cod.positions, cod_attention_mask(cod))
    assert torch.equal(again[0], flat[0]) and not torch.allclose(again[1], flat[1])


@pytest.mark.parametrize("soft", [True, False])
def test_the_chunked_loss_equals_one_chunk_and_kl_is_ce_minus_the_entropy(soft):
    torch.manual_seed(0)
    m, d, vocab, depths = 37, 16, 11, 4
    lm = torch.nn.Linear(d, vocab, bias=False)
    states = torch.randn(m, d, requires_grad=True)
    target, kept = torch.randn(m, d), torch.randn(vocab, d)
    labels, greedy = torch.randint(0, vocab, (m,)), torch.randint(0, 40, (m,))
    trainable, depth = torch.rand(m) < 0.8, torch.randint(0, depths, (m,))
    draft_ids = torch.arange(0, 2 * vocab, 2)
    args = (lm, target, kept, labels, greedy, trainable, depth, draft_ids, depths, soft)
    whole = parallel_loss_sums(states, *args, chunk=1000)
    grad_whole = torch.autograd.grad(whole["ce"].sum(), [states, lm.weight])
    parts = parallel_loss_sums(states, *args, chunk=5)  # 8 chunks, each recomputed in the backward
    grad_parts = torch.autograd.grad(parts["ce"].sum(), [states, lm.weight])
    for key in whole:
        torch.testing.assert_close(parts[key], whole[key])
    for a, b in zip(grad_whole, grad_parts, strict=True):
        torch.testing.assert_close(a, b)
    assert torch.equal(whole["tokens"], torch.zeros(depths).index_add(0, depth, trainable.float()))
    if soft:
        kl = parallel_loss_sums(states, *args, kl=True)
        p = torch.softmax(target @ kept.T, -1)
        entropy = -(p * p.log()).sum(-1)
        expected = whole["ce"] - torch.zeros(depths).index_add(0, depth[trainable], entropy[trainable])
        torch.testing.assert_close(kl["ce"], expected)
        grad_kl = torch.autograd.grad(kl["ce"].sum(), states)[0]
        torch.testing.assert_close(grad_kl, grad_whole[0])


def test_accepted_weighting_counts_an_element_only_behind_its_chains_greedy_hits():
    """loss.cod.weighting=accepted: each element's parent is (same row, same anchor, depth - 1), found in any
    order of the elements; an element's CE counts only when every earlier element of its chain hit."""
    # (row, head position, depth), shuffled; row 0: anchor 1 reaches depth 3, anchor 3 depth 1; row 1: anchor 0
    elements = [(0, 1, 0), (0, 2, 1), (0, 3, 2), (0, 4, 3), (0, 3, 0), (0, 4, 1), (0, 2, 0), (1, 0, 0),
                (1, 1, 1), (1, 2, 2), (1, 1, 0), (0, 5, 1)]  # fmt: skip
    order = torch.randperm(len(elements), generator=generator(5))
    rows, positions, depth = (torch.tensor([elements[i][k] for i in order]) for k in range(3))
    parents = chain_parents(rows, positions, depth, (2, 6), 4)
    where = {elements[int(i)]: j for j, i in enumerate(order)}
    expected = {(0, 2, 1): (0, 1, 0), (0, 3, 2): (0, 2, 1), (0, 4, 3): (0, 3, 2), (0, 4, 1): (0, 3, 0),
                (1, 1, 1): (1, 0, 0), (1, 2, 2): (1, 1, 1)}  # fmt: skip
    for element, j in where.items():  # (0, 5, 1): its anchor 4's depth-0 element is not among them
        assert int(parents[j]) == (where[expected[element]] if element in expected else -1)
    missed = {(0, 2, 1), (1, 0, 0)}  # the drafts that are not the target's greedy token
    hit = torch.tensor([0.0 if elements[int(i)] in missed else 1.0 for i in order])
    reached = chain_accepted(hit, parents, depth, 4)
    behind = {(0, 3, 2), (0, 4, 3), (1, 1, 1), (1, 2, 2)}  # an earlier element of the chain missed
    assert reached.tolist() == [0.0 if elements[int(i)] in behind else 1.0 for i in order]
    # the loss: the same CE rows as uniform weighting, those behind a miss dropped, no gradient through them
    m, d, vocab = len(elements), 8, 5
    lm, states = torch.nn.Linear(d, vocab, bias=False), torch.randn(m, d, requires_grad=True)
    target, kept = torch.randn(m, d), torch.randn(vocab, d)
    greedy = torch.where(hit > 0, -1, 99)  # -1 never matches: recomputed hits are all misses...
    args = (
        lm,
        target,
        kept,
        torch.zeros(m, dtype=torch.long),
        greedy,
        torch.ones(m, dtype=torch.bool),
        depth,
    )
    uniform = parallel_loss_sums(states, *args, torch.arange(vocab), 4)
    accepted = parallel_loss_sums(states, *args, torch.arange(vocab), 4, parents=parents)
    assert torch.equal(accepted["ce"][0], uniform["ce"][0])  # ...so only elements without a parent count
    assert accepted["ce"][1:].sum() < uniform["ce"][1:].sum()
    gold = torch.where(hit > 0, torch.arange(vocab)[(states @ lm.weight.T).argmax(-1)], 99)  # real hits
    accepted = parallel_loss_sums(states, *args[:4], gold, *args[5:], torch.arange(vocab), 4, parents=parents)
    grad = torch.autograd.grad(accepted["ce"].sum(), states)[0]
    keep = torch.tensor([elements[int(i)] not in behind for i in order])
    assert grad[~keep].abs().sum() == 0 and (grad[keep].abs().sum(-1) > 0).all()


@torch.no_grad()
def test_the_depth_by_depth_forward_is_the_flattened_one():
    """`cod_forward` (the real prefix through the causal kernel, one [m_d, n] block per depth) gives every
    element the state the flattened sequence with its [T, T] mask gives it."""
    head = peagle_head(layers=3)
    b, n, steps = 3, 20, 5
    ids, feats = (
        torch.randint(4, 50, (b, n), generator=generator(3)),
        torch.randn(b, n, 96, generator=generator(4)),
    )
    valid = torch.rand(b, n, generator=generator(6)) < 0.8
    cod = flatten_cod(valid, torch.tensor([n, 13, 17]), steps, 0.8, 0.3, generator(7))
    fed_ids, fed = head.placeholders(cod.gather(ids), cod.gather(feats), cod.depth > 0)
    flat = head(fed_ids, fed, cod.positions, cod_attention_mask(cod))
    depths = by_depth(cod, steps)
    states = cod_forward(head, ids, feats, depths)
    assert len(states) == steps and depths.valid[0].sum() > depths.valid[-1].sum() > 0
    for row in range(b):
        for t in torch.nonzero(cod.real[row]).flatten().tolist():
            a, d = int(cod.anchor[row, t]), int(cod.depth[row, t])
            here = d and (depths.anchors[d - 1][row] == a) & depths.valid[d - 1][row]
            slot = a if d == 0 else int(here.nonzero())  # exactly one element of that depth and anchor
            torch.testing.assert_close(states[d][row, slot], flat[row, t], rtol=1e-4, atol=1e-5)


def test_the_depth_by_depth_gradients_are_the_flattened_ones():
    """The CPU's fused kernel with the anchors' mask (PrefixDiagonalAttention) backpropagates exactly what
    the flattened forward does, into every weight (mask_hidden and the mask row included)."""
    head = peagle_head(layers=2)
    b, n, steps = 2, 16, 4
    ids, feats = (
        torch.randint(4, 50, (b, n), generator=generator(8)),
        torch.randn(b, n, 96, generator=generator(9)),
    )
    cod = flatten_cod(
        torch.ones(b, n, dtype=torch.bool), torch.tensor([n, 12]), steps, 0.8, 0.4, generator(10)
    )
    weight = torch.randn(b, cod.anchor.shape[1], 32, generator=generator(11))
    fed_ids, fed = head.placeholders(cod.gather(ids), cod.gather(feats), cod.depth > 0)
    flat = head(fed_ids, fed, cod.positions, cod_attention_mask(cod))
    params = [p for name, p in head.named_parameters() if not name.startswith(("norm.", "lm_head."))]
    expected = torch.autograd.grad((flat * weight * cod.real[..., None]).sum(), params)
    depths = by_depth(cod, steps)
    states = cod_forward(head, ids, feats, depths)
    real = (torch.arange(n) < torch.tensor([n, 12])[:, None])[..., None]  # [b, n, 1]: depth 0's elements
    total = (states[0] * weight[:, :n] * real).sum()  # depth 0 sits first in each row, at its position
    for d, valid in enumerate(depths.valid, start=1):
        for row in range(b):
            slots = torch.nonzero(cod.real[row] & (cod.depth[row] == d)).flatten()
            total = total + (states[d][row, valid[row]] * weight[row, slots]).sum()
    got = torch.autograd.grad(total, params)
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
