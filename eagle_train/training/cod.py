"""P-EAGLE's training sequence: COD sampling and its flattening into one sequence per conversation.

A P-EAGLE head drafts a chain of K at head position a (the anchor: the last real pair (a_a, t_{a+1}))
in one forward over [pairs 0..a | K-1 placeholders]: the draft at depth d (0-based) sits at position
a + d and predicts t_{a+d+2}, exactly the token head position a + d predicts (eagle_train.training.loss). Training
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

from eagle_train.training.ttt import FLASH_CPU, DiagonalCache, PrefixDiagonalAttention, dense_prefix_diagonal


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


@dataclass
class CodDepths:
    """A batch's COD elements grouped by depth, for the depth-by-depth forward (`cod_forward`): depth 0 is
    every position; per depth d >= 1, [b, m_d] (m_d the most any row keeps):"""

    anchors: list[torch.Tensor]  # [b, m_d] long, sorted per row (padding: 0)
    valid: list[torch.Tensor]  # [b, m_d] bool
    # chain[d - 1][j - 1] [b, m_d]: where each depth-d element's own chain element of depth j (1 <= j < d)
    # sits in depth j's layout (its anchor's index there)
    chain: list[list[torch.Tensor]]


def by_depth(cod: CodBatch, num_depths: int) -> CodDepths:
    """`cod`'s elements of depth 1..num_depths-1 per depth (depth-d anchors are among depth j's, j < d)."""
    anchors, valid, chain = [], [], []
    big = int(cod.anchor.max()) + 1 if cod.anchor.numel() else 1
    for d in range(1, num_depths):
        picked = cod.real & (cod.depth == d)  # [b, T]
        width = int(picked.sum(1).max()) if picked.numel() else 0
        if width == 0:
            break
        rank = picked.cumsum(1) - 1  # [b, T]: each picked element's slot in its row
        slot = torch.where(picked, rank, width)  # unpicked ones to a spare column, cut below
        anchor = cod.anchor.new_full((cod.anchor.shape[0], width + 1), big).scatter_(1, slot, cod.anchor)
        is_valid = torch.zeros_like(anchor, dtype=torch.bool).scatter_(1, slot, picked)
        anchor, is_valid = anchor[:, :width].contiguous(), is_valid[:, :width]
        # padding sorts last (big) for the lookups below, then reads as anchor 0
        chain.append(
            [torch.searchsorted(earlier, anchor).clamp(max=earlier.shape[1] - 1) for earlier in anchors]
        )
        anchors.append(anchor)
        valid.append(is_valid)
    return CodDepths([torch.where(v, a, 0) for a, v in zip(anchors, valid, strict=True)], valid, chain)


class CodCache(DiagonalCache):
    """The attention of `cod_forward`: depth 0 is the real sequence (causal, the fused kernel); a depth-d
    element attends to the depth-0 keys up to its anchor and to its own chain's keys of depths 1..d (gathered
    from the earlier depths' keys), one [m_d, n] score block per depth: the flattened sequence's mask
    (`cod_attention_mask`) without its [T, T] block."""

    def __init__(self, depths: CodDepths, length: int):
        super().__init__()
        self.depths, self.length = depths, length

    def attend(self, layer_idx, q, k, v):
        keys = self.keys.get(layer_idx, [])
        if not keys:
            return super().attend(layer_idx, q, k, v)  # depth 0: the real prefix, causal
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        keys.append(k)
        self.values[layer_idx].append(v)
        d = len(keys) - 1
        chain = [*self.depths.chain[d - 1], None]  # the earlier depths' slots, then this depth's own

        def own(stack):  # [b, h, m_d, d, e]: the element's chain at depths 1..d
            picked = [stack[j] if at is None else _take(stack[j], at) for j, at in enumerate(chain, start=1)]
            return torch.stack(picked, dim=-2)

        anchor = self.depths.anchors[d - 1]  # [b, m_d]
        future = torch.arange(self.length, device=q.device) > anchor[:, None, :, None]  # [b, 1, m_d, n]
        prefix = (q, keys[0], self.values[layer_idx][0], own(keys), own(self.values[layer_idx]))
        if q.device.type == "cpu" and FLASH_CPU is not None:  # the fused kernel: no [m_d, n] scores kept
            additive = torch.zeros(future.shape, dtype=q.dtype, device=q.device).masked_fill(
                future, float("-inf")
            )
            return PrefixDiagonalAttention.apply(*prefix, additive)
        return dense_prefix_diagonal(*prefix, future)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [b, h, m, e] at index [b, m'] along m: [b, h, m', e]."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))


def cod_forward(
    head, input_ids: torch.Tensor, features: torch.Tensor, depths: CodDepths, forward=None
) -> list[torch.Tensor]:
    """The head's states of every COD element, depth by depth: [b, n, d] at depth 0 (the real pairs), then
    [b, m_d, d] per depth (the placeholders at position anchor + d). The same function as one forward over
    the flattened sequence with its mask (tests/training/test_cod.py); on a CPU far faster (the real prefix through
    the fused causal kernel, [m_d, n] score blocks instead of [T, T]). `forward`: what runs the head (a
    DDP-wrapped one; default the head itself)."""
    forward = forward or head
    n = input_ids.shape[1]
    cache = CodCache(depths, n)
    states = [forward(input_ids, features, torch.arange(n, device=input_ids.device)[None], None, cache)]
    for d, anchor in enumerate(depths.anchors, start=1):
        shape = (*anchor.shape, features.shape[-1])
        ids, fed = head.placeholders(
            anchor, features.new_zeros(shape), torch.ones_like(anchor, dtype=torch.bool)
        )
        states.append(forward(ids, fed, anchor + d, None, cache))
    return states
