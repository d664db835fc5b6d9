"""DFlash's training pieces (eagle_train.training.dflash): the block attention mask checked exactly on a
small case, the slot weights, the anchors (deterministic under a seed, supervised, with room), the labels
and the simulated acceptance."""

from __future__ import annotations

import math

import pytest
import torch

from eagle_train.config.draft import DraftConfig
from eagle_train.config.train import TrainConfig
from eagle_train.training.dflash import (
    Blocks,
    accepted_prefix,
    anchor_candidates,
    block_attention_mask,
    block_labels,
    block_positions,
    default_gamma,
    sample_anchors,
    slot_weights,
)
from eagle_train.training.resume import KIND_SETTINGS, run_identity


def test_the_block_mask_sees_the_context_before_its_anchor_and_its_own_block_only():
    # one row, context of 6 head positions, blocks of 3 anchored at head positions 1 and 3, a padding block
    blocks = Blocks(torch.tensor([[1, 3, 0]]), torch.tensor([[True, True, False]]))
    mask = block_attention_mask(blocks, 6, 3)[0, 0].int()
    c, b = 6, 3
    expected = torch.zeros(9, c + 9, dtype=torch.int)
    expected[0:3, 0:2] = 1  # anchor j=1: context 0..1 (tokens 0 and 1, strictly before anchor token 2)
    expected[3:6, 0:4] = 1  # anchor j=3: context 0..3
    for i in range(3):  # every block (the padding one too) sees its own slots, both ways
        expected[i * b : (i + 1) * b, c + i * b : c + (i + 1) * b] = 1
    assert torch.equal(mask, expected)


def test_a_block_never_sees_another_block_or_a_later_context_position():
    g = torch.Generator().manual_seed(3)
    loss_mask = torch.rand(2, 40, generator=g) < 0.7
    blocks = sample_anchors(loss_mask, torch.tensor([40, 25]), 5, 6, g)
    mask = block_attention_mask(blocks, 40, 5)[:, 0]  # [b, A*B, C + A*B]
    block_of = torch.arange(blocks.anchor.shape[1]).repeat_interleave(5)
    for r in range(2):
        for q in range(mask.shape[1]):
            seen = torch.nonzero(mask[r, q]).flatten()
            context, slots = seen[seen < 40], seen[seen >= 40] - 40
            assert (block_of[slots] == block_of[q]).all() and len(slots) == 5
            if blocks.valid[r, block_of[q]]:
                assert context.tolist() == list(range(int(blocks.anchor[r, block_of[q]]) + 1))


def test_slot_weights_decay_from_slot_one_with_the_published_gammas():
    assert [default_gamma(b) for b in (16, 10, 8, 12)] == [7.0, 5.0, 4.0, 6.0]
    w = slot_weights(16)
    assert w[0] == 0 and w[1] == 1
    assert torch.allclose(w[1:], torch.tensor([math.exp(-k / 7) for k in range(15)]))
    assert torch.allclose(
        slot_weights(4, gamma=2.0), torch.tensor([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)])
    )


def test_anchors_are_deterministic_under_a_seed_and_supervised_with_room():
    loss_mask = torch.zeros(3, 30, dtype=torch.bool)
    loss_mask[0, 5:28] = True
    loss_mask[1, 2:10] = True
    loss_mask[2, 20:25] = True  # a row too short for any block after its supervised positions
    positions = torch.tensor([30, 30, 22])

    def draw(seed):
        return sample_anchors(loss_mask, positions, 4, 5, torch.Generator().manual_seed(seed))

    a, b, c = draw(0), draw(0), draw(1)
    assert torch.equal(a.anchor, b.anchor) and torch.equal(a.valid, b.valid)
    assert not torch.equal(a.anchor, c.anchor)  # another seed, another draw
    allowed = anchor_candidates(loss_mask, positions, 4)
    assert a.valid.sum(1).tolist() == [5, 5, 0]  # at most num_anchors; none without room
    for r in range(3):
        picked = a.anchor[r][a.valid[r]]
        assert allowed[r, picked].all() and (picked + 4 <= positions[r]).all()
        assert torch.equal(picked, picked.sort().values) and picked.unique().numel() == picked.numel()
    few = sample_anchors(loss_mask, positions, 4, 100, torch.Generator().manual_seed(0))
    assert torch.equal(few.valid.sum(1), allowed.sum(1))  # fewer candidates than asked: all of them


def test_labels_and_positions_of_a_block():
    # tokens t_0..t_9 = 10..19; head position j holds t_{j+1}; loss_mask[j] = mask[j+2]
    input_ids = torch.arange(11, 20)[None]  # [1, 9]
    mask = torch.tensor([0, 0, 0, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)  # token-level
    loss_mask = torch.nn.functional.pad(mask[2:], (0, 1))[None]
    blocks = Blocks(torch.tensor([[2]]), torch.tensor([[True]]))  # anchor token a = 3
    tokens, supervised = block_labels(input_ids, loss_mask, blocks, 4)
    assert tokens.tolist() == [[[13, 14, 15, 16]]]  # t_3 (anchor), t_4, t_5, t_6
    assert supervised.tolist() == [[[False, True, False, True]]]  # mask[4], mask[5], mask[6]
    assert block_positions(blocks, 4).tolist() == [[3, 4, 5, 6]]


def test_the_accepted_prefix_stops_at_the_first_miss():
    correct = torch.tensor([[[True, True, True, False, True], [False, False, True, True, True]]])
    supervised = torch.tensor([[[False, True, True, True, True], [False, True, True, True, True]]])
    assert accepted_prefix(correct, supervised).tolist() == [[3, 1]]
    supervised[0, 0, 2] = False  # the reply ends: the prefix ends there too
    assert accepted_prefix(correct, supervised)[0, 0] == 2


@pytest.mark.parametrize("size", [2, 16])
def test_every_anchor_candidate_leaves_a_whole_block_inside_its_row(size):
    loss_mask = torch.ones(2, 20, dtype=torch.bool)
    allowed = anchor_candidates(loss_mask, torch.tensor([20, 17]), size)
    assert allowed.sum(1).tolist() == [max(0, 20 - size + 1), max(0, 17 - size + 1)]


def test_dflash_settings_enter_only_a_dflash_runs_identity():
    """A run of another kind from before these settings existed still resumes (its identity lacks them)."""
    eagle = run_identity(TrainConfig(features="x"), {}, 1, "no")["settings"]
    dflash = run_identity(TrainConfig(features="x", draft=DraftConfig(type="dflash")), {}, 1, "no")[
        "settings"
    ]
    assert not set(KIND_SETTINGS) & set(eagle) and set(KIND_SETTINGS) <= set(dflash)
