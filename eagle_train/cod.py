"""P-EAGLE's training sequence: COD sampling and its flattening into one sequence per conversation.

A P-EAGLE head drafts a chain of K at head position a (the anchor: the last real pair (a_a, t_{a+1}))
in one forward over [pairs 0..a | K-1 placeholders]: the draft at depth d (0-based) sits at position
a + d and predicts t_{a+d+2}, exactly the token head position a + d predicts (eagle_train.loss). Training
every anchor at every depth costs K x n elements; COD (conditional-on-distribution) sampling keeps:

    depth 0   every head position (the real sequence: the context of every chain; its loss at the
              loss-masked positions is EAGLE-3's first step)
    depth d   a random subset of the depth d-1 chains that reach one position further, of
              size int((N - d) * max(r^d, r_min)) (N: the loss-masked positions), so a depth-d element
              exists only where its chain's depths 1..d-1 do, and every position a+1..a+d it sits on is
              loss-masked (speculators' rule; the subset of the candidates when they are more)

Element (a, d) is fed the real pair at d = 0 and the placeholders (mask token, mask_hidden) at d >= 1,
at position id a + d. It attends to the depth-0 elements with anchor <= a (the real causal prefix) and
to its own chain's elements of depth <= d, nothing else: one row of the batch is one conversation, so
attention never crosses conversations. `flatten_cod` lays the elements of each row out as one sequence
(rows padded to the longest) with that mask; `cod_attention_mask` is the one home of the rule.
Randomness comes from an injected torch.Generator only: a micro-batch's sample is a function of its seed.
Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cod_sample(
    valid: torch.Tensor,  # [n] bool: head positions whose predicted token is trained (the loss mask)
    length: int,  # real head positions of the row (the rest is padding)
    num_depths: int,
    r: float,
    r_min: float,
    generator: torch.Generator,
    max_anchors: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor [T], depth [T]) of one row's elements, depth 0 first (positions 0..length-1), then each
    depth's elements in position order (see the module docstring)."""
    device = valid.device
    valid = valid[:length]
    seeds = torch.nonzero(valid).flatten()  # the loss-masked positions
    if max_anchors is not None and seeds.numel() > max_anchors:
        pick = torch.randperm(seeds.numel(), generator=generator, device=device)[:max_anchors]
        seeds = seeds[pick].sort().values
    anchors, depths = (
        [torch.arange(length, device=device)],
        [torch.zeros(length, dtype=torch.long, device=device)],
    )
    candidates = seeds[seeds >= 1]  # depth-1 elements sit on masked positions with an anchor before them
    for d in range(1, num_depths):
        size = int(max(0, seeds.numel() - d) * max(r**d, r_min))
        if size <= 0 or candidates.numel() == 0:
            break
        if candidates.numel() > size:
            pick = torch.randperm(candidates.numel(), generator=generator, device=device)[:size]
            candidates = candidates[pick].sort().values
        anchors.append(candidates - d)
        depths.append(torch.full_like(candidates, d))
        following = candidates + 1  # the chain's next position, if it is masked too
        following = following[following < length]
        candidates = following[valid[following]]
    return torch.cat(anchors), torch.cat(depths)


@dataclass
class CodBatch:
    """A batch's COD elements laid out per row: [b, T] (T the longest row's element count)."""

    anchor: torch.Tensor  # [b, T] long (0 on padding)
    depth: torch.Tensor  # [b, T] long (0 on padding)
    real: torch.Tensor  # [b, T] bool: an element (False: padding)

    @property
    def positions(self) -> torch.Tensor:
        """[b, T] each element's head position (and RoPE position id): anchor + depth."""
        return self.anchor + self.depth

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, n, ...] at each element's position: [b, T, ...]."""
        index = self.positions.view(*self.positions.shape, *([1] * (x.ndim - 2))).expand(-1, -1, *x.shape[2:])
        return x.gather(1, index)


def flatten_cod(
    loss_mask: torch.Tensor,  # [b, n] bool
    lengths: torch.Tensor,  # [b] real head positions per row
    num_depths: int,
    r: float,
    r_min: float,
    generator: torch.Generator,
    max_anchors: int | None = None,
) -> CodBatch:
    """Every row's `cod_sample`, right-padded to one [b, T] layout (rows drawn in order from `generator`)."""
    rows = [
        cod_sample(mask, int(n), num_depths, r, r_min, generator, max_anchors)
        for mask, n in zip(loss_mask.bool(), lengths.tolist(), strict=True)
    ]
    longest = max(a.numel() for a, _ in rows)
    anchor = loss_mask.new_zeros(len(rows), longest, dtype=torch.long)
    depth, real = torch.zeros_like(anchor), torch.zeros_like(anchor, dtype=torch.bool)
    for i, (a, d) in enumerate(rows):
        anchor[i, : a.numel()], depth[i, : d.numel()], real[i, : a.numel()] = a, d, True
    return CodBatch(anchor, depth, real)


def cod_attention_mask(cod: CodBatch) -> torch.Tensor:
    """bool [b, 1, T, T], True = query attends key: the depth-0 keys with anchor <= the query's anchor
    (the real causal prefix) and the query's own chain up to its depth, real keys only; a padding query
    attends to itself alone (no row of the softmax is empty)."""
    a_q, a_k = cod.anchor[:, :, None], cod.anchor[:, None, :]
    d_q, d_k = cod.depth[:, :, None], cod.depth[:, None, :]
    prefix = (d_k == 0) & (a_k <= a_q)
    chain = (a_k == a_q) & (d_k <= d_q)
    allowed = (prefix | chain) & cod.real[:, None, :] & cod.real[:, :, None]
    allowed |= torch.eye(allowed.shape[-1], dtype=torch.bool, device=allowed.device)
    return allowed[:, None]


def expected_elements(n: int, num_depths: int, r: float, r_min: float) -> int:
    """Elements of a row of n head positions, all of them loss-masked (the most COD keeps): n at depth 0
    plus int((n - d) * max(r^d, r_min)) per depth d (bounded by the chains that reach depth d)."""
    total, chains = n, n - 1
    for d in range(1, num_depths):
        size = min(int(max(0, n - d) * max(r**d, r_min)), chains)
        if size <= 0:
            break
        total, chains = total + size, size
    return total
