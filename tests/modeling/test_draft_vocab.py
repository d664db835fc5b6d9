"""EAGLE-3's draft vocabulary: counting assistant tokens, the top tokens, d2t / t2d."""

from __future__ import annotations

import pytest
import torch

from eagle_train.modeling.draft_vocab import (
    count_assistant_tokens,
    d2t_from_t2d,
    default_draft_vocab_size,
    draft_ids,
    t2d_from_d2t,
    top_tokens,
)


def test_only_loss_masked_tokens_are_counted():
    seqs = [
        (torch.tensor([5, 5, 1, 2, 2]), torch.tensor([0, 1, 0, 1, 1], dtype=torch.bool)),
        (torch.tensor([3, 2, 7]), torch.tensor([1, 1, 0], dtype=torch.bool)),
    ]
    assert count_assistant_tokens(seqs, 8).tolist() == [0, 0, 3, 1, 0, 1, 0, 0]


def test_top_tokens_breaks_ties_and_fills_unseen_by_the_lower_id():
    counts = torch.tensor([0, 4, 2, 4, 0, 1, 0])
    assert torch.nonzero(top_tokens(counts, 3)).flatten().tolist() == [1, 2, 3]
    assert torch.nonzero(top_tokens(counts, 5)).flatten().tolist() == [0, 1, 2, 3, 5]
    with pytest.raises(ValueError, match="must be 1..7"):
        top_tokens(counts, 8)


def test_d2t_and_t2d_are_the_engines_layout():
    t2d = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1], dtype=torch.bool)
    d2t = d2t_from_t2d(t2d)
    assert d2t.tolist() == [1, 1, 3, 4] and d2t.dtype == torch.int64  # target id = i + d2t[i]
    assert draft_ids(d2t).tolist() == [1, 2, 5, 7]  # SGLang's hot_token_id = d2t + arange
    assert torch.equal(t2d_from_d2t(d2t, 8), t2d)
    assert default_draft_vocab_size(512) == 512 and default_draft_vocab_size(128256) == 32000
