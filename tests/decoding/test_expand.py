"""Draft expansion against slow plain-Python references on a scripted draft."""

from __future__ import annotations

import pytest
import torch

from eagle_train.config.decode import load_tree_paths
from eagle_train.decoding.expand import expand_dynamic, expand_parallel, expand_static, plan_static
from eagle_train.decoding.tree import chain_paths, shape_from_paths

VOCAB = 23
ROOT = 7


def token_paths(tree) -> list[tuple[int, ...]]:
    """Token path (root first) of every node, by walking its parents."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(len(tokens)):
        path, j = [], i
        while j != -1:
            path.append(tokens[j])
            j = parents[j]
        out.append(tuple(path[::-1]))
    return out


def ranked(lp: torch.Tensor) -> list[tuple[float, int]]:
    """(log-prob, token) by decreasing log-prob (the scripted draft has no ties)."""
    return sorted(((float(v), t) for t, v in enumerate(lp.tolist())), key=lambda x: -x[0])


def reference_static(paths, lp_of) -> set[tuple[int, ...]]:
    out = {(ROOT,)}
    for ranks in paths:
        seq = (ROOT,)
        for r in ranks:
            seq = (*seq, ranked(lp_of(seq))[r][1])
        out.add(seq)
    return out


def reference_dynamic(depth, top_k, total_tokens, lp_of) -> set[tuple[int, ...]]:
    """EAGLE-2 in plain Python: candidates (value, depth, order, path); feed the top_k of each depth."""
    cands, order = [], 0
    level = []
    for lp, tok in ranked(lp_of((ROOT,)))[:top_k]:
        level.append((lp, (ROOT, tok)))
    for d in range(1, depth + 2):
        for value, path in level:
            cands.append((value, d, order, path))
            order += 1
        if d == depth + 1:
            break
        fed = level if d == 1 else sorted(level, key=lambda c: -c[0])[:top_k]
        level = [(v + lp, (*p, tok)) for v, p in fed for lp, tok in ranked(lp_of(p))[:top_k]]
    best = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[: total_tokens - 1]
    return {(ROOT,)} | {c[3] for c in best}


@pytest.mark.parametrize(
    "paths", [chain_paths(5), load_tree_paths("mc_sim_7b_63"), [[0], [2], [2, 1], [2, 1, 3]]]
)
def test_static_expansion_matches_reference(scripted_draft, paths):
    from tests.decoding.conftest import path_log_probs

    draft = scripted_draft(ROOT, VOCAB)
    shape = shape_from_paths(paths)
    tree = expand_static(plan_static(shape), ROOT, draft.root_log_probs(), draft)
    assert set(token_paths(tree)) == reference_static(paths, lambda p: path_log_probs(p, VOCAB))
    assert draft.calls == shape.max_depth - 1  # one draft call per depth above the last
    # confidence = the draft's probability of each node given its parent
    for i, path in enumerate(token_paths(tree)[1:], start=1):
        assert tree.confidence[i] == pytest.approx(
            path_log_probs(path[:-1], VOCAB)[path[-1]].exp().item(), rel=1e-5
        )


@pytest.mark.parametrize(
    "paths", [chain_paths(5), load_tree_paths("mc_sim_7b_63"), [[0], [2], [2, 1], [2, 1, 3]]]
)
@pytest.mark.parametrize("reduced", [False, True])
def test_parallel_expansion_is_the_static_one_from_per_depth_rows(paths, reduced):
    """A P-EAGLE round: each depth's children come from one row whatever the parent. One top-k over the rows
    (expand_parallel) gives the tree, tokens and confidences of expand_static's depth-by-depth draft, with
    and without a reduced draft vocabulary; fewer rows than depths is an error, not a shorter tree."""
    shape = shape_from_paths(paths)
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(shape.max_depth + 2, VOCAB, generator=g).log_softmax(-1)  # more rows than needed
    vocab_map = torch.randperm(VOCAB * 3, generator=g)[:VOCAB] if reduced else None
    calls = []

    def step(tokens, parents, tree_mask, depth):
        calls.append(depth)
        return rows[depth].expand(tokens.shape[0], -1)

    plan = plan_static(shape)
    slow = expand_static(plan, ROOT, rows[0], step, vocab_map=vocab_map)
    fast = expand_parallel(plan, ROOT, rows, vocab_map)
    assert calls == list(range(1, shape.max_depth))
    assert torch.equal(fast.tokens, slow.tokens) and torch.equal(fast.parents, slow.parents)
    assert torch.equal(fast.confidence, slow.confidence)
    assert torch.equal(fast.attention_mask, slow.attention_mask) and fast.draft_probs is None
    top = rows.topk(VOCAB, dim=-1).indices  # a node of rank r at depth d: row d - 1's r-th token
    top = top if vocab_map is None else vocab_map[top]
    for i in range(1, shape.size):
        assert fast.tokens[i] == top[shape.depths[i] - 1, shape.ranks[i]]
    with pytest.raises(ValueError, match="P-EAGLE placeholders"):
        expand_parallel(plan, ROOT, rows[: shape.max_depth - 1], vocab_map)


@pytest.mark.parametrize(
    "depth, top_k, total_tokens", [(1, 3, 4), (3, 4, 12), (5, 3, 26), (4, 5, 60), (2, 2, 200)]
)
def test_dynamic_expansion_matches_reference(scripted_draft, depth, top_k, total_tokens):
    from tests.decoding.conftest import path_log_probs

    draft = scripted_draft(ROOT, VOCAB)
    tree = expand_dynamic(ROOT, draft.root_log_probs(), draft, depth, top_k, total_tokens)
    expected = reference_dynamic(depth, top_k, total_tokens, lambda p: path_log_probs(p, VOCAB))
    got = token_paths(tree)
    assert len(got) == len(set(got)) == len(expected)
    assert set(got) == expected
    assert draft.calls == depth
    assert all(tree.parents[i] < i for i in range(1, tree.size))


def test_dynamic_rerank_ties_go_to_the_shallower_node():
    """A child with draft probability 1 ties its parent's value: the parent must win the last slot."""
    vocab = 6

    def step(tokens, parents, tree_mask, depth):
        out = torch.full((tokens.shape[0], vocab), float("-inf"))
        out[:, 0] = 0.0  # every fed node's best child has probability 1
        out[:, 1:] = torch.log(torch.tensor([1e-9] * (vocab - 1)))
        return out

    root_lp = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02]))
    # values: (3,0) = (3,0,0) = (3,0,0,0) = ln .5 > (3,1) = (3,1,0) = ln .3: ties resolve by depth
    for total, expected in [(3, [(3, 0), (3, 0, 0)]), (4, [(3, 0), (3, 0, 0), (3, 0, 0, 0)])]:
        tree = expand_dynamic(3, root_lp, step, depth=2, top_k=2, total_tokens=total)
        assert token_paths(tree)[1:] == expected
    tree = expand_dynamic(3, root_lp, step, depth=2, top_k=2, total_tokens=6)
    assert token_paths(tree)[1:] == [(3, 0), (3, 1), (3, 0, 0), (3, 1, 0), (3, 0, 0, 0)]


def test_sampled_children_are_drawn_from_q(scripted_draft):
    draft = scripted_draft(ROOT, VOCAB, scale=1.0)
    plan = plan_static(shape_from_paths([[0], [1], [2], [0, 0]]))
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB)
    for _ in range(300):
        draft.reset()
        tree = expand_static(plan, ROOT, draft.root_log_probs(), draft, lambda lp: lp.exp(), g)
        counts.index_add_(0, tree.tokens[1:4], torch.ones(3))
        assert torch.allclose(tree.draft_probs[0], draft.root_log_probs().exp())
    freq = counts / counts.sum()
    assert (freq - draft.root_log_probs().exp()).abs().sum() / 2 < 0.08  # TV; 900 draws
