"""Draft trees: one builder for static (EAGLE-1), chain and dynamic (EAGLE-2) trees.

A tree is given by its parent array in topological order (`parents[i] < i`, node 0 is the root with
parent -1). The root is the last token the target chose (it is always accepted); every other node is
a draft token. `build_tree` derives what verification needs (the EAGLE-2 expansion in `decoding.expand`
builds the same fields with tensor ops):

    tokens            [n]          node tokens (root first)
    parents           [n]          parent node, -1 for the root
    depth             [n]          0 for the root; a node's position is prefix length + depth
    attention_mask    [n, n] bool  node i attends to node j iff j is i or one of its ancestors
    retrieve_indices  [leaves, max_depth + 1]  root-to-leaf node paths, padded with -1

A static tree is a list of paths of child ranks (`[[0], [1], [0, 0], ...]`: path [0, 1] is the
second-best child of the best child of the root); `shape_from_paths` turns it into parents and ranks.
Pure torch + stdlib.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Tree:
    """A draft tree ready for one verification forward (see the module docstring for the fields).
    `children`, `retrieve_indices`, `max_depth` and `token_list` are derived from `parents` / `depth` on first use
    (the greedy decoding loop never needs the first two)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    attention_mask: torch.Tensor
    draft_probs: torch.Tensor | None = None  # [n, vocab] q at each node if its children were SAMPLED from q
    confidence: torch.Tensor | None = None  # [n] draft probability of each node given its parent (root: 1)
    # [draft_vocab] the target id of each column of draft_probs when q lives on a reduced draft vocabulary
    # (EAGLE-3); None: draft_probs columns are target ids
    draft_vocab: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @functools.cached_property
    def token_list(self) -> list[int]:
        """`tokens` as a Python list (read once per round by verification and the decoder)."""
        return self.tokens.tolist()

    @functools.cached_property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @functools.cached_property
    def children(self) -> list[list[int]]:
        """Children of each node in try order (node id order), plain Python for sampling verification."""
        children: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            children[p].append(i)
        return children

    @functools.cached_property
    def retrieve_indices(self) -> torch.Tensor:
        """[leaves, max_depth + 1] root-to-leaf node paths, padded with -1."""
        paths = _ancestor_paths(self.parents.tolist())
        leaf_paths = [paths[i] for i, c in enumerate(self.children) if not c]
        width = max(len(p) for p in leaf_paths)
        return torch.tensor(
            [p + [-1] * (width - len(p)) for p in leaf_paths], dtype=torch.long, device=self.tokens.device
        )


@dataclass
class TreeShape:
    """A static tree's structure: parent and child rank of each node, root first, by depth."""

    parents: list[int]
    ranks: list[int]  # child rank under the parent (top-k index, or draw index when sampling); root: -1
    depths: list[int]
    paths: list[tuple[int, ...]]

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def truncated(self, max_depth: int) -> TreeShape:
        """The same tree without the nodes deeper than `max_depth` (nodes are ordered by depth)."""
        keep = sum(d <= max_depth for d in self.depths)
        return TreeShape(self.parents[:keep], self.ranks[:keep], self.depths[:keep], self.paths[:keep])


def shape_from_paths(paths: Sequence[Sequence[int]]) -> TreeShape:
    """Parents and ranks of a static tree given as rank paths (the root is implicit).

    Raises ValueError on an empty path, a negative rank, a duplicate, or a path whose parent path
    is missing (the tree must be connected)."""
    norm = [tuple(int(r) for r in p) for p in paths]
    seen = set(norm)
    if len(seen) != len(norm):
        raise ValueError("tree paths contain duplicates")
    for p in norm:
        if not p or min(p) < 0:
            raise ValueError(f"tree path {list(p)}: paths must be non-empty lists of ranks >= 0")
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"tree path {list(p)}: its parent path {list(p[:-1])} is missing")
    ordered = sorted(norm, key=lambda p: (len(p), p))
    index = {(): 0}
    parents, ranks, depths = [-1], [-1], [0]
    for i, p in enumerate(ordered, start=1):
        index[p] = i
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
        depths.append(len(p))
    return TreeShape(parents, ranks, depths, [(), *ordered])


def chain_paths(length: int) -> list[list[int]]:
    """A chain of `length` draft tokens as a static tree: [[0], [0, 0], ...]."""
    return [[0] * k for k in range(1, length + 1)]


def _ancestor_paths(parents: Sequence[int]) -> list[list[int]]:
    """Root-to-node path of every node (node ids), from a topologically ordered parent array."""
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        if i == 0:
            if p != -1:
                raise ValueError("node 0 must be the root (parent -1)")
            paths.append([0])
        elif not 0 <= p < i:
            raise ValueError(f"node {i}: parent {p} must be an earlier node")
        else:
            paths.append([*paths[p], i])
    return paths


def build_tree(
    tokens: torch.Tensor,  # [n]
    parents: Sequence[int] | torch.Tensor,  # [n], topological, parents[0] = -1
    draft_probs: torch.Tensor | None = None,
    confidence: torch.Tensor | None = None,
) -> Tree:
    """Build the verification view of a tree (mask, depths, leaf paths) from its parent array."""
    parent_list = parents.tolist() if isinstance(parents, torch.Tensor) else [int(p) for p in parents]
    n = len(parent_list)
    if tokens.numel() != n:
        raise ValueError(f"{tokens.numel()} tokens for {n} nodes")
    paths = _ancestor_paths(parent_list)
    rows = [i for i, path in enumerate(paths) for _ in path]
    cols = [j for path in paths for j in path]
    device = tokens.device
    mask = torch.zeros(n, n, dtype=torch.bool, device=device)
    mask[rows, cols] = True
    return Tree(
        tokens=tokens,
        parents=torch.tensor(parent_list, dtype=torch.long, device=device),
        depth=torch.tensor([len(p) - 1 for p in paths], dtype=torch.long, device=device),
        attention_mask=mask,
        draft_probs=draft_probs,
        confidence=confidence,
    )
