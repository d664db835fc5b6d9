"""Drafting a tree with an injected draft step: static trees (chain, EAGLE-1) and the EAGLE-2 dynamic tree.

The draft step is any callable `step(tokens, parents, tree_mask, depth) -> log_probs`:

    tokens     [m]               new draft inputs, all at tree depth `depth` (>= 1)
    parents    [m]               index of each input's parent among the inputs fed so far (-1 = the root,
                                 whose draft state the caller prepared before expansion)
    tree_mask  [m, fed + m] bool which inputs fed so far (these m included, in feed order) each attends to
    returns    [m, vocab]        log-probabilities of each input's children

An EAGLE-3 head's log-probabilities are over its reduced draft vocabulary: `vocab_map` [draft_vocab]
(the target id of each draft id, d2t + arange) turns the chosen draft ids into the target ids the tree,
the draft's next inputs and the verification use; a sampled tree keeps q on the draft vocabulary
(`Tree.draft_vocab` says which target id each column is).

The decoder's step runs the draft head with its KV cache; tests pass scripted stubs. Randomness (for
sampled children) comes from an injected torch.Generator. Pure torch + stdlib.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from eagle_train.decoding.tree import Tree, TreeShape, build_tree

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
    node_depths: torch.Tensor  # [n - 1]: depth - 1 of nodes 1..n-1 (`expand_parallel`'s row per node)
    node_ranks: torch.Tensor  # [n - 1]: child rank of nodes 1..n-1


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
    node_depths = torch.tensor(shape.depths[1:], device=device) - 1
    node_ranks = torch.tensor(shape.ranks[1:], device=device)
    return StaticPlan(
        shape, template, levels, parent_rows, ranks, width, feed_parents, feed_masks, node_depths, node_ranks
    )


def draw_children(
    log_probs: torch.Tensor,  # [p, vocab] (or [p, draft_vocab] with vocab_map)
    width: int,
    sample_probs: Callable[[torch.Tensor], torch.Tensor] | None,
    generator: torch.Generator | None,
    vocab_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Children of p nodes: the top `width` tokens, or `width` i.i.d. draws from q = sample_probs(log_probs).
    Returns (target token ids [p, width], confidence [p, width], q [p, vocab] or None)."""
    if sample_probs is None:
        top_lp, top_tok = torch.topk(log_probs, width, dim=-1)
        return to_target(top_tok, vocab_map), top_lp.exp(), None
    q = sample_probs(log_probs)
    tokens = torch.multinomial(q, width, replacement=True, generator=generator)
    return to_target(tokens, vocab_map), q.gather(-1, tokens), q


def to_target(draft_tokens: torch.Tensor, vocab_map: torch.Tensor | None) -> torch.Tensor:
    """Draft ids -> target ids (the identity without a reduced vocabulary)."""
    return draft_tokens if vocab_map is None else vocab_map[draft_tokens]


def expand_static(
    plan: StaticPlan,
    root_token: int,
    root_log_probs: torch.Tensor,  # [vocab]: the draft's distribution of the root's children
    step: DraftStep,
    sample_probs: Callable[[torch.Tensor], torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    vocab_map: torch.Tensor | None = None,
) -> Tree:
    """Fill a static tree: depth by depth, each node's children are its parent's top-ranked (or sampled)
    tokens; every node above the last depth is fed to the draft once. One step call per depth."""
    template = plan.template
    n = template.size
    tokens = torch.empty(n, dtype=torch.long, device=root_log_probs.device)
    tokens[0] = root_token
    confidence = torch.ones(n, device=root_log_probs.device)
    draft_probs = (
        None
        if sample_probs is None
        else torch.zeros(n, root_log_probs.shape[-1], device=root_log_probs.device)
    )
    level_lp = root_log_probs.unsqueeze(0)  # [nodes of the previous depth, vocab]
    for d, (lo, hi) in enumerate(plan.levels, start=1):
        child_tok, child_conf, q = draw_children(
            level_lp, plan.width[d - 1], sample_probs, generator, vocab_map
        )
        rows, ranks = plan.parent_rows[d - 1], plan.ranks[d - 1]
        tokens[lo:hi] = child_tok[rows, ranks]
        confidence[lo:hi] = child_conf[rows, ranks]
        if q is not None:
            prev_lo = 0 if d == 1 else plan.levels[d - 2][0]
            draft_probs[prev_lo : prev_lo + q.shape[0]] = q
        if d < len(plan.levels):  # feed this depth
            level_lp = step(tokens[lo:hi], plan.feed_parents[d - 1], plan.feed_masks[d - 1], d)
    return replace(
        template,
        tokens=tokens,
        confidence=confidence,
        draft_probs=draft_probs,
        draft_vocab=None if draft_probs is None else vocab_map,
    )


def expand_parallel(
    plan: StaticPlan,
    root_token: int,
    depth_log_probs: torch.Tensor,  # [>= D, vocab]: row d - 1 the distribution of every node's children at depth d
    vocab_map: torch.Tensor | None = None,
) -> Tree:
    """`expand_static` for a P-EAGLE round with top-ranked children: every node's children at depth d come
    from one distribution whatever the parent (the placeholders never see the drafted tokens), all known
    after the round's one draft forward, so one top-k over the D rows fills every depth at once (no step
    calls, no per-depth loop). Sampled children draw depth by depth: `expand_static`."""
    template = plan.template
    depths = len(plan.levels)
    if depths > depth_log_probs.shape[0]:
        raise ValueError(f"a tree {depths} deep from {depth_log_probs.shape[0] - 1} P-EAGLE placeholders")
    top_lp, top_tok = torch.topk(depth_log_probs[:depths], max(plan.width), dim=-1)
    tokens = torch.empty(template.size, dtype=torch.long, device=depth_log_probs.device)
    tokens[0] = root_token
    tokens[1:] = to_target(top_tok[plan.node_depths, plan.node_ranks], vocab_map)
    confidence = torch.cat([top_lp.new_ones(1), top_lp[plan.node_depths, plan.node_ranks].exp()])
    return replace(template, tokens=tokens, confidence=confidence)


@dataclass
class _DynamicPlan:
    """Index tables of one EAGLE-2 shape (depth, k, total_tokens), built once. Candidates are numbered in
    creation order: the root's k children, then k * k per depth; index C is the root itself. Fed inputs
    are numbered in feed order (k per depth, F = depth * k); feed index F stands for the root as a
    parent, F + 1 for "no parent" (the root's own)."""

    level_parent: list[torch.Tensor]  # per depth d: feed index of the parent of each of its k * k children
    parent_feed: (
        torch.Tensor
    )  # [C + 1]: feed index of each candidate's parent (root's children: F; root: F + 1)
    depth: torch.Tensor  # [C + 1]: tree depth of each candidate (root: 0)
    feed_offsets: torch.Tensor  # [F + 2]: added to the picked rows to get candidate ids (see `_rerank`)
    first_rows: torch.Tensor  # [k]: the root's children are fed first: rows 0..k-1
    first_parents: torch.Tensor  # [k]: -1, the draft step's parent index of the root's children
    tail: torch.Tensor  # [2]: zeros, appended to the picked rows (-> candidate ids C, C + 1)
    node_of: torch.Tensor  # [C + 2]: template of candidate -> node id (n = not kept; C: 0, C + 1: -1)
    mask_base: torch.Tensor  # [n, n] bool: diagonal and root column
    arange: torch.Tensor  # [n]: 0..n-1
    root_id: torch.Tensor  # [1]: C, the root's candidate id
    zero: torch.Tensor  # [1]: 0.0, the root's log-confidence


@functools.lru_cache(maxsize=32)
def _dynamic_plan(depth: int, k: int, total_tokens: int, device: torch.device) -> _DynamicPlan:
    """The index tables of one EAGLE-2 shape (cached: one build per shape and device)."""
    kk, num_fed = k * k, depth * k
    num_cands = k + depth * kk
    n = min(total_tokens, num_cands + 1)
    children = torch.arange(k, device=device).repeat_interleave(k)
    level_parent = [children + (d - 1) * k for d in range(1, depth + 1)]
    root = torch.full((k,), num_fed, dtype=torch.long, device=device)
    none = torch.full((1,), num_fed + 1, dtype=torch.long, device=device)
    parent_feed = torch.cat([root, *level_parent, none])
    depth_of = torch.cat(
        [torch.ones(k), torch.arange(2, depth + 2).repeat_interleave(kk), torch.zeros(1)]
    ).long()
    offsets = (
        [0] * k + [k + (d - 1) * kk for d in range(1, depth) for _ in range(k)] + [num_cands, num_cands + 1]
    )
    node_of = torch.full((num_cands + 2,), n, dtype=torch.long, device=device)
    node_of[num_cands], node_of[num_cands + 1] = 0, -1
    mask_base = torch.eye(n, dtype=torch.bool, device=device)
    mask_base[:, 0] = True
    return _DynamicPlan(
        level_parent,
        parent_feed,
        depth_of.to(device),
        torch.tensor(offsets, device=device),
        torch.arange(k, device=device),
        torch.full((k,), -1, dtype=torch.long, device=device),
        torch.zeros(2, dtype=torch.long, device=device),
        node_of,
        mask_base,
        torch.arange(n, device=device),
        torch.full((1,), num_cands, dtype=torch.long, device=device),
        torch.zeros(1, device=device),
    )


def expand_dynamic(
    root_token: int,
    root_log_probs: torch.Tensor,  # [vocab]
    step: DraftStep,
    depth: int,
    top_k: int,
    total_tokens: int,
    vocab_map: torch.Tensor | None = None,
) -> Tree:
    """EAGLE-2's dynamic tree. value(node) = sum of draft log-probs along its path. Expand: the root's
    top_k children form depth 1; at each of `depth` steps the top_k highest-value nodes of the newest
    depth are fed to the draft and each gets its top_k children as candidates. Rerank: keep the
    total_tokens - 1 highest-value candidates (ties to the shallower one), a connected tree because a
    value never grows along a path.

    Fixed-shape tensor ops only (k = top_k inputs fed per depth, k * k candidates per depth, index
    tables built once per shape): no Python loop over nodes and no host sync. `ancestors` holds each
    fed input's fed ancestors and itself (the draft step's mask); its last two rows (the root as a
    parent, no parent) are empty. depth >= 1 (at depth 0 the root's feed index would collide with the
    first fed input's: the decoder finishes plainly instead)."""
    cands = dynamic_candidates(root_log_probs, step, depth, top_k, total_tokens, vocab_map)
    return _rerank(root_token, cands, total_tokens)


@dataclass
class Candidates:
    """What one EAGLE-2 expansion drafted, before the rerank: per level (the root's children, then k * k
    per depth) the candidates' values (summed log-probs), tokens and own log-probs, the rows fed at each
    depth, and the fed inputs' ancestor mask. The first L levels of a deeper expansion are exactly the
    candidates of an expansion of depth L - 1 (a depth's feed never looks ahead): autotune.replay reads
    every shallower shape off one deep expansion."""

    plan: _DynamicPlan
    values: list[torch.Tensor]
    tokens: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    picks: list[torch.Tensor]
    ancestors: torch.Tensor


def dynamic_candidates(
    root_log_probs: torch.Tensor,
    step: DraftStep,
    depth: int,
    top_k: int,
    total_tokens: int,
    vocab_map: torch.Tensor | None = None,
) -> Candidates:
    """The expansion part of `expand_dynamic` (see there)."""
    if depth < 1:
        raise ValueError(f"expand_dynamic needs depth >= 1 (a tree of depth + 1 levels), got {depth}")
    device = root_log_probs.device
    k = min(top_k, root_log_probs.shape[-1])
    plan = _dynamic_plan(depth, k, total_tokens, device)
    values, tokens = torch.topk(root_log_probs, k)  # depth 1: the root's children
    tokens = to_target(tokens, vocab_map)
    cand_values, cand_tokens, cand_lp, picks = [values], [tokens], [values], [plan.first_rows]
    ancestors = torch.eye(depth * k + 2, depth * k, dtype=torch.bool, device=device)
    feed_values, feed_parents = values.unsqueeze(1), plan.first_parents
    for d in range(1, depth + 1):
        lo, hi = (d - 1) * k, d * k
        if d > 1:
            ancestors[lo:hi, :lo] = ancestors[feed_parents, :lo]
        level_lp = step(tokens, feed_parents, ancestors[lo:hi, :hi], d)  # [k, vocab]
        child_lp, child_tok = torch.topk(level_lp, k, dim=-1)  # [k, k]
        child_tok = to_target(child_tok, vocab_map)
        child_lp = child_lp.clamp_(max=0.0).view(-1)  # a rounding excess above 0 must not outrank the parent
        level_values = child_lp.view(k, k).add(feed_values).view(-1)  # [k * k]
        child_tok = child_tok.view(-1)
        cand_values.append(level_values)
        cand_tokens.append(child_tok)
        cand_lp.append(child_lp)
        if d == depth:
            break
        best, picked = torch.sort(level_values, descending=True, stable=True)  # ties -> earlier
        picked = picked[:k]
        picks.append(picked)
        feed_parents = plan.level_parent[d - 1][picked]
        feed_values, tokens = best[:k].unsqueeze(1), child_tok[picked]
    return Candidates(plan, cand_values, cand_tokens, cand_lp, picks, ancestors)


def _rerank(root_token: int, cands: Candidates, total_tokens: int) -> Tree:
    """Keep the best total_tokens - 1 candidates (stable sort: ties to the earlier = shallower one) and
    build the tree, root first, in candidate order (parents before children)."""
    plan, picks, ancestors = cands.plan, cands.picks, cands.ancestors
    cand_tokens, cand_lp = cands.tokens, cands.log_probs
    values = torch.cat(cands.values)  # [C]
    num_fed = ancestors.shape[1]
    keep = torch.sort(values, descending=True, stable=True).indices[: total_tokens - 1].sort().values
    root = plan.root_id
    node_ids = torch.cat([root, keep])  # [n]: candidate id of each node, the root (id C) first
    node_of = plan.node_of.clone()  # candidate id -> node id (n = not in the tree)
    node_of[keep] = plan.arange[1:]
    feed_node = node_of[torch.cat([*picks, plan.tail]) + plan.feed_offsets]  # [F + 2]: node of each fed input
    parent_feed = plan.parent_feed[node_ids]  # [n]
    n = node_ids.shape[0]
    # node a attends to b iff b is a (fed) ancestor of a's parent (a kept node's ancestors are all
    # kept), b is a, or b is the root; column n collects fed inputs that are not in the tree
    scattered = torch.zeros(n, n + 1, dtype=torch.bool, device=values.device)
    scattered.index_copy_(1, feed_node[:num_fed], ancestors[parent_feed])
    return Tree(
        tokens=torch.cat([*cand_tokens, root.new_full((1,), root_token)])[node_ids],
        parents=feed_node[parent_feed],
        depth=plan.depth[node_ids],
        attention_mask=scattered[:, :n] | plan.mask_base,
        confidence=torch.cat([*cand_lp, plan.zero])[node_ids].exp(),
    )
