"""DFlash training (arXiv 2602.06036) as pure tensor functions: which blocks a sequence trains, the one
attention mask that runs all of them in one draft forward, and the slots' loss weights.

In the shifted batch (training.loss.shift_batch) head position j holds input_ids[j] = t_{j+1}, the
features a_j (the chosen target layers' outputs at token j) and loss_mask[j] = mask[j+2]. A block
anchored at token a = j + 1 is [t_a, MASK x (B-1)] at absolute positions a..a+B-1; its slot k predicts
t_{a+k} = input_ids[j+k] (supervised iff mask[a+k] = loss_mask[j+k-1]); its context is the features
a_0..a_j (every token strictly before the anchor). An anchor is a head position j whose slot-1 label is
supervised (loss_mask[j]: a block always trains something) and whose block fits inside the sequence
(j + B <= the row's head positions).

The draft forward's keys are [context (the row's n head positions) ; blocks (A x B slots)] and its queries
the blocks' slots; a slot sees the context keys 0..j of its own anchor and every slot of its own block
(bidirectionally), never another block, never padding (`block_attention_mask`). Rows are separate
conversations (the batch dimension), so a block never sees another conversation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle_train.training.loss import checkpointed_chunks

PUBLISHED_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's slot-weight decay per block size


def default_gamma(block_size: int) -> float:
    """The published gamma for block sizes 16, 10 and 8; otherwise block_size / 2 (the rule that gives
    8's and 10's values; 16's published 7 is one less)."""
    return PUBLISHED_GAMMA.get(block_size, block_size / 2)


def slot_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[B] the loss weight of each slot: 0 for slot 0 (the anchor, given), exp(-(k - 1) / gamma) for k >= 1."""
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
    k = torch.arange(block_size, dtype=torch.float64)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights.float()


@dataclass(frozen=True)
class Blocks:
    """A micro-batch's blocks: `anchor` [b, A] the head position j of each block (0 where unused) and
    `valid` [b, A] whether it is a real block (rows with fewer anchors are padded)."""

    anchor: torch.Tensor
    valid: torch.Tensor


def anchor_candidates(loss_mask: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, n] bool: head positions that may anchor a block (slot 1 supervised, the block inside the row)."""
    j = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    return loss_mask.bool() & (j[None] + block_size <= positions[:, None])


def sample_anchors(
    loss_mask: torch.Tensor,  # [b, n] bool: mask[j + 2]
    positions: torch.Tensor,  # [b] real head positions per row
    block_size: int,
    num_anchors: int,
    generator: torch.Generator,
) -> Blocks:
    """Up to `num_anchors` anchors per row, uniformly without replacement among `anchor_candidates`
    (all of them when fewer), sorted; drawn from `generator` (one draw per row, in row order)."""
    candidates = anchor_candidates(loss_mask, positions, block_size)
    rows = []
    for row in candidates:
        where = torch.nonzero(row).flatten()
        order = torch.randperm(where.numel(), generator=generator, device=generator.device)
        rows.append(where[order.to(where.device)[:num_anchors]].sort().values)
    width = max([1, *(r.numel() for r in rows)])
    anchor = torch.zeros(len(rows), width, dtype=torch.long, device=loss_mask.device)
    valid = torch.zeros(len(rows), width, dtype=torch.bool, device=loss_mask.device)
    for i, r in enumerate(rows):
        anchor[i, : r.numel()], valid[i, : r.numel()] = r, True
    return Blocks(anchor, valid)


def block_positions(blocks: Blocks, block_size: int) -> torch.Tensor:
    """[b, A * B] the absolute position a + k = j + 1 + k of every slot (block-major)."""
    k = torch.arange(block_size, device=blocks.anchor.device)
    return (blocks.anchor[:, :, None] + 1 + k).flatten(1)


def block_attention_mask(blocks: Blocks, context_len: int, block_size: int) -> torch.Tensor:
    """bool [b, 1, A * B, context_len + A * B], True = attend: slot queries of block i see context keys
    0..anchor_i (tokens strictly before the anchor token) and the B slots of block i. A padding block
    sees only its own slots (finite, never read)."""
    b, a = blocks.anchor.shape
    device = blocks.anchor.device
    p = torch.arange(context_len, device=device)
    sees_context = (p[None, None] <= blocks.anchor[:, :, None]) & blocks.valid[:, :, None]  # [b, A, C]
    own = torch.eye(a, dtype=torch.bool, device=device)[None].expand(b, a, a)  # [b, A, A] block i -> i
    keys = torch.cat(
        [
            sees_context.repeat_interleave(block_size, dim=1),
            own.repeat_interleave(block_size, dim=1).repeat_interleave(block_size, dim=2),
        ],
        dim=2,
    )  # [b, A * B, C + A * B]
    return keys[:, None]


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, blocks: Blocks, block_size: int):
    """(tokens [b, A, B]: t_{a+k}, slot 0 the anchor t_a; supervised [b, A, B]: slot k >= 1 of a real block
    whose label mask[a+k] is set). The anchor's block fits its row, so every index is inside it."""
    n = input_ids.shape[1]
    k = torch.arange(block_size, device=input_ids.device)
    index = (blocks.anchor[:, :, None] + k).clamp(max=n - 1)  # j + k
    tokens = input_ids.gather(1, index.flatten(1)).view(index.shape)
    label_mask = loss_mask.bool().gather(1, (index - 1).clamp(min=0).flatten(1)).view(index.shape)
    supervised = label_mask & (k > 0) & blocks.valid[:, :, None]
    return tokens, supervised


def accepted_prefix(correct: torch.Tensor, supervised: torch.Tensor) -> torch.Tensor:
    """[b, A] 1 + the number of leading slots 1..B-1 drafted correctly (and supervised) per block: the
    tokens one round accepts when the target verifies the block as a chain (the +1: its bonus token)."""
    hits = (correct & supervised)[..., 1:].long()
    return 1 + hits.cumprod(-1).sum(-1)


def slot_ce(
    states: torch.Tensor,  # [M, d] the draft's states at the supervised slots
    draft_logits: Callable[[torch.Tensor], torch.Tensor],  # [c, d] -> [c, vocab]: the head's
    labels: torch.Tensor,  # [M] the data token t_{a+k}
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE [M], draft top-1 == label [M] bool) of every supervised slot; the [c, vocab] logits exist one
    chunk of `chunk` slots at a time (`checkpointed_chunks`), so memory stays bounded at any anchor count."""

    def part(st, lab):
        logits = draft_logits(st).float()  # [c, vocab]
        return F.cross_entropy(logits, lab, reduction="none"), (logits.argmax(-1) == lab).detach()

    outs = checkpointed_chunks(part, (states, labels), chunk)
    rows, hits = [out[0] for out in outs], [out[1] for out in outs]
    if not rows:
        return states.new_zeros(0, dtype=torch.float32), torch.zeros(
            0, dtype=torch.bool, device=states.device
        )
    return torch.cat(rows), torch.cat(hits)
