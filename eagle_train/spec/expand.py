"""Drafting a tree with an injected draft step: static trees (chain, EAGLE-1) and the EAGLE-2 dynamic tree.

The draft step is any callable `step(tokens, parents, tree_mask, depth) -> log_probs`:

    tokens     [m]               new draft inputs, all at tree depth `depth` (>= 1)
    parents    [m]               index of each input's parent among the inputs fed so far (-1 = the root,
                                 whose draft state the caller prepared before expansion)
    tree_mask  [m, fed + m] bool which inputs fed so far (these m included, in feed order) each attends to
    returns    [m, vocab]        log-probabilities of each input's children

The decoder's step runs the draft head with its KV cache; tests pass scripted stubs. Randomness (for
sampled children) comes from an injected torch.Generator. Pure torch + stdlib.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from eagle_train.spec.tree import Tree, TreeShape, build_tree

DraftStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class StaticPlan:
    """A static tree shape with everything per-round drafting needs precomputed once."""

    shape: TreeShape
    template: Tree  # the tree's mask, depths and paths (tokens are filled each round)
    levels: list[tuple[int, int]]  # node range [lo, hi) of each depth 1..D (nodes are ordered by depth)
    parent_rows: list[torch.Tensor]  # per depth: row of each node's parent within the previous depth
    ranks: list[torch.Tensor]  # per depth: each node's child rank
    width: list[int]  # per depth: children to draw per parent (max rank + 1)
    feed_parents: list[torch.Tensor]  # per depth: feed index of each node's parent (-1 = root)
    feed_masks: list[torch.Tensor]  # per depth: [nodes, fed so far] ancestor-or-self mask over fed inputs


def plan_static(shape: TreeShape, device: torch.device | str = "cpu") -> StaticPlan:
    """Precompute the per-depth index tensors of a static tree shape."""
    template = build_tree(torch.zeros(shape.size, dtype=torch.long, device=device), shape.parents)
    levels, parent_rows, ranks, width = [], [], [], []
    lo = 1
    for d in range(1, shape.max_depth + 1):
        hi = lo + sum(1 for x in shape.depths if x == d)
        prev_lo = 0 if d == 1 else levels[-1][0]
        levels.append((lo, hi))
        parent_rows.append(torch.tensor([shape.parents[i] - prev_lo for i in range(lo, hi)], device=device))
        ranks.append(torch.tensor(shape.ranks[lo:hi], device=device))
        width.append(max(shape.ranks[lo:hi]) + 1)
        lo = hi
    # a depth's inputs are nodes lo..hi-1, fed after nodes 1..lo-1: feed index = node id - 1
    feed_parents = [template.parents[lo:hi] - 1 for lo, hi in levels]
    feed_masks = [template.attention_mask[lo:hi, 1:hi].contiguous() for lo, hi in levels]
    return StaticPlan(shape, template, levels, parent_rows, ranks, width, feed_parents, feed_masks)


def draw_children(
    log_probs: torch.Tensor,  # [p, vocab]
    width: int,
    sample_probs: Callable[[torch.Tensor], torch.Tensor] | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Children of p nodes: the top `width` tokens, or `width` i.i.d. draws from q = sample_probs(log_probs).
    Returns (tokens [p, width], confidence [p, width], q [p, vocab] or None)."""
    if sample_probs is None:
        top_lp, top_tok = torch.topk(log_probs, width, dim=-1)
        return top_tok, top_lp.exp(), None
    q = sample_probs(log_probs)
    tokens = torch.multinomial(q, width, replacement=True, generator=generator)
    return tokens, q.gather(-1, tokens), q


def expand_static(
    plan: StaticPlan,
    root_token: int,
    root_log_probs: torch.Tensor,  # [vocab]: the draft's distribution of the root's children
    step: DraftStep,
    sample_probs: Callable[[torch.Tensor], torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
) -> Tree:
    """Fill a static tree: depth by depth, each node's children are its parent's top-ranked (or sampled)
    tokens; every node above the last depth is fed to the draft once. One step call per depth."""
    template = plan.template
    n = template.size
    tokens = torch.empty(n, dtype=torch.long, device=root_log_probs.device)
    tokens[0] = root_token
    confidence = torch.ones(n, device=root_log_probs.device)
    draft_probs = None if sample_probs is None else torch.zeros(n, root_log_probs.shape[-1], device=root_log_probs.device)
    level_lp = root_log_probs.unsqueeze(0)  # [nodes of the previous depth, vocab]
    for d, (lo, hi) in enumerate(plan.levels, start=1):
        child_tok, child_conf, q = draw_children(level_lp, plan.width[d - 1], sample_probs, generator)
        rows, ranks = plan.parent_rows[d - 1], plan.ranks[d - 1]
        tokens[lo:hi] = child_tok[rows, ranks]
        confidence[lo:hi] = child_conf[rows, ranks]
        if q is not None:
            prev_lo = 0 if d == 1 else plan.levels[d - 2][0]
            draft_probs[prev_lo : prev_lo + q.shape[0]] = q
        if d < len(plan.levels):  # feed this depth
            level_lp = step(tokens[lo:hi], plan.feed_parents[d - 1], plan.feed_masks[d - 1], d)
    return replace(template, tokens=tokens, confidence=confidence, draft_probs=draft_probs)


def expand_dynamic(
    root_token: int,
    root_log_probs: torch.Tensor,  # [vocab]
    step: DraftStep,
    depth: int,
    top_k: int,
    total_tokens: int,
) -> Tree:
    """EAGLE-2's dynamic tree. value(node) = sum of draft log-probs along its path. Expand: the root's
    top_k children form depth 1; at each of `depth` steps the top_k highest-value nodes of the newest
    depth are fed to the draft and each gets its top_k children as candidates. Rerank: keep the
    total_tokens - 1 highest-value candidates (ties to the shallower one), a connected tree because a
    value never grows along a path.

    Everything is a fixed-shape tensor op (k = top_k inputs fed per depth, k * k candidates per depth),
    no Python loop over nodes and no host sync: a candidate's parent is a fed input (or the root), and
    `ancestors` holds each fed input's fed ancestors and itself (the draft step's mask)."""
    device = root_log_probs.device
    k = min(top_k, root_log_probs.shape[-1])
    values, tokens = torch.topk(root_log_probs, k)  # depth 1: the root's children
    cand_values, cand_tokens, cand_lp = [values], [tokens], [values]
    cand_parent_feed = [torch.full((k,), -1, dtype=torch.long, device=device)]  # feed index of the parent
    feed_cands = [torch.arange(k, device=device)]  # candidate id of every fed input, in feed order
    # [F + 1, F], F = depth * k: row i = fed input i's fed ancestors and itself; row F (= row -1, the
    # root's) is empty
    ancestors = torch.eye(depth * k + 1, depth * k, dtype=torch.bool, device=device)
    feed_values, feed_parents = values, cand_parent_feed[0]
    children_of = torch.arange(k, device=device).repeat_interleave(k)  # [k * k]: row of each child's parent
    for d in range(1, depth + 1):
        lo, hi = (d - 1) * k, d * k
        if d > 1:
            ancestors[lo:hi, :lo] = ancestors[feed_parents, :lo]
        level_lp = step(tokens, feed_parents, ancestors[lo:hi, :hi], d)  # [k, vocab]
        child_lp, child_tok = torch.topk(level_lp, k, dim=-1)  # [k, k]
        # a rounding excess above 0 must not let a child outrank its parent
        child_lp = child_lp.clamp(max=0.0).flatten()
        level_values = feed_values.repeat_interleave(k) + child_lp
        cand_values.append(level_values)
        cand_tokens.append(child_tok.flatten())
        cand_lp.append(child_lp)
        cand_parent_feed.append(children_of + lo)
        if d == depth:
            break
        picked = torch.sort(level_values, descending=True, stable=True).indices[:k]  # ties -> earlier
        feed_parents = children_of[picked] + lo
        feed_cands.append(picked + (k + (d - 1) * k * k))
        feed_values, tokens = level_values[picked], child_tok.flatten()[picked]
    return _rerank(
        root_token, torch.cat(cand_values), torch.cat(cand_tokens), torch.cat(cand_lp),
        torch.cat(cand_parent_feed), torch.cat(feed_cands)[: depth * k], ancestors, total_tokens,
    )


def _rerank(root_token, values, tokens, log_probs, parent_feed, feed_cands, ancestors, total_tokens) -> Tree:
    """Keep the best total_tokens - 1 candidates (stable sort: ties to the earlier = shallower one) and
    build the tree, root first, in candidate order (parents before children).

    values, tokens, log_probs, parent_feed [C]: per candidate; feed_cands [F]: candidate id of each fed
    input; ancestors [F + 1, F]: each fed input's fed ancestors and itself, an empty last row."""
    device = values.device
    keep = torch.sort(values, descending=True, stable=True).indices[: total_tokens - 1].sort().values  # [n - 1]
    n = keep.numel() + 1
    # node id of each fed input (0 = not in the tree; a kept node's ancestors are all kept), then 0 for
    # the root, so that index -1 maps a root child's parent to node 0
    node_of = torch.zeros(values.numel() + 1, dtype=torch.long, device=device)
    node_of[keep] = torch.arange(1, n, device=device)
    node_of_feed = node_of[torch.cat([feed_cands, feed_cands.new_full((1,), values.numel())])]  # [F + 1]
    kept_parent = parent_feed[keep]  # [n - 1], -1 = the root
    parents = torch.cat([kept_parent.new_full((1,), -1), node_of_feed[kept_parent]])
    # node a attends to kept node b iff b is a (fed) ancestor of a's parent, b is a, or b is the root
    mask = torch.zeros(n, n + 1, dtype=torch.bool, device=device)  # column n: inputs not in the tree
    rows = ancestors[kept_parent]  # [n - 1, F] (the root's children: the empty row -1)
    cols = torch.where(node_of_feed[:-1] > 0, node_of_feed[:-1], n)
    mask[1:].index_copy_(1, cols, rows)  # last writer wins on column n: it is dropped below
    mask = mask[:, :n]
    mask.diagonal().fill_(True)
    mask[:, 0] = True
    depth = mask.sum(1) - 1
    return Tree(
        tokens=torch.cat([tokens.new_full((1,), root_token), tokens[keep]]),
        parents=parents,
        depth=depth,
        attention_mask=mask,
        confidence=torch.cat([log_probs.new_ones(1), log_probs[keep].exp()]),
    )
