"""Held-out metrics: the unrolled chain equals decode-time drafting; counting with scripted heads."""

from __future__ import annotations

import torch
from torch import nn

from eagle_train.modeling.draft import DraftHead
from eagle_train.training.loss import shift_sequence
from eagle_train.training.metrics import chain_topk, draft_metric_sums, finalize_metrics
from tests.reference import chain_attention_mask


def test_chain_attention_mask_by_hand():
    mask = chain_attention_mask(3, 2)[0, 0].int().tolist()
    # query j sees real keys 0..j and its own step-2 key j
    assert mask == [[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]]


def test_chain_steps_equal_sequential_drafting(target):
    torch.manual_seed(0)
    head = DraftHead.from_target(target.config).eval()
    head.share_target_weights(target)
    ids = torch.tensor([[1, 403, 261, 30, 58, 488, 95, 11, 42, 7]])
    _, hidden = target.features(ids)
    s = shift_sequence(ids[0], torch.ones(10, dtype=torch.bool), hidden[0])
    x, f = s["input_ids"][None], s["features"][None]  # [1, n], [1, n, d]
    tops = chain_topk(head, x, f, depth=3, k=1)
    with torch.no_grad():
        for j in (0, 3, 5):
            # decode time: prefix with real features, then the chain's own predicted features
            feats, tokens = f[:, : j + 1], x[:, : j + 1]
            for step in range(3):
                out = head(tokens, feats)[:, -1]  # f^ of the chain's last position
                assert head.logits(out).argmax(-1).item() == tops[step][0, j, 0].item()
                feats = torch.cat([feats, out[:, None]], dim=1)
                tokens = x[:, : j + step + 2]


class ScriptedHead(nn.Module):
    """Returns the true next feature (target_hidden at its position), except at chain step `wrong_step`."""

    def __init__(self, target_hidden: torch.Tensor, lm_head: torch.Tensor, wrong_step: int | None = None):
        super().__init__()
        self.target_hidden, self.weight, self.wrong_step = target_hidden, lm_head, wrong_step

    def forward(self, input_ids, features, position_ids=None, attention_mask=None, cache=None):
        n = input_ids.shape[1]
        step = int(position_ids[0, 0]) + 1 if position_ids is not None else 1
        index = (torch.arange(n) + step - 1).clamp(max=n - 1)
        out = self.target_hidden[:, index]
        return -out if step == self.wrong_step else out

    def logits(self, hidden):
        return hidden @ self.weight.T


def _scripted_batch(n: int = 12, d: int = 6, vocab: int = 9):
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, vocab, (1, n), generator=g),
        "features": torch.randn(1, n, d, generator=g),
        "target_hidden": torch.randn(1, n, d, generator=g),
        "loss_mask": torch.ones(1, n, dtype=torch.bool),
    }
    batch["loss_mask"][0, -1] = False
    return batch, torch.randn(vocab, d, generator=g)


def test_a_perfect_head_accepts_every_step():
    batch, weight = _scripted_batch()
    sums = draft_metric_sums(ScriptedHead(batch["target_hidden"], weight), batch, depth=4)
    m = finalize_metrics(sums, 4)
    assert m["top1"] == 1.0 and m["top3"] == 1.0
    assert sums["chains"] == 11 - 3  # starts with 4 valid steps ahead among 11 masked positions
    assert m["accept_len"] == 5.0 and m["acc_step4"] == 1.0


def test_acceptance_stops_at_the_first_miss():
    batch, weight = _scripted_batch()
    sums = draft_metric_sums(ScriptedHead(batch["target_hidden"], weight, wrong_step=3), batch, depth=4)
    m = finalize_metrics(sums, 4)
    assert m["acc_step1"] == 1.0 and m["acc_step2"] == 1.0 and m["acc_step4"] == 1.0
    assert m["acc_step3"] < 0.5  # the negated feature's argmax differs (almost surely)
    misses = sums["chains"] - sums["step3"]
    # tau = 1 + 2 accepted before a step-3 miss, else 1 + 4
    assert sums["accept_len"] == misses * 3 + sums["step3"] * 5
