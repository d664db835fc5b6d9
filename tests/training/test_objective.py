"""The training objectives on collated batches: EAGLE-3's per-step sums equal a plain computation that
indexes the sequences directly (no shift helpers), and its normalisers make split steps equal one."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from eagle_train.config.train import LossConfig
from eagle_train.modeling.eagle3 import Eagle3Head
from eagle_train.modeling.logit_transform import LogitTransform
from eagle_train.training.data import collate
from eagle_train.training.objective import Eagle3Objective
from tests.reference import dense_unroll

CONFIG = LlamaConfig(
    vocab_size=30,
    hidden_size=8,
    intermediate_size=12,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    max_position_embeddings=64,
    num_hidden_layers=1,
)


def setup_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = Eagle3Head(CONFIG, [0, 1, 2], 20)
    head.set_vocabulary(torch.randperm(30, generator=g) < 20)
    lm = torch.randn(30, 8, generator=g)
    samples = []
    for i, n in enumerate((9, 6, 11)):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[3:] = True  # a 3-token prompt, then the reply
        samples.append(
            {
                "id": str(i),
                "input_ids": torch.randint(0, 30, (n,), generator=g),
                "loss_mask": mask,
                "hidden": torch.randn(n, 8, generator=g),
                "aux": torch.randn(n, 24, generator=g),
            }
        )
    return head.eval(), lm, samples


@pytest.mark.parametrize(
    "soft, transform", [(True, LogitTransform()), (True, LogitTransform(0.5, 3.0)), (False, LogitTransform())]
)
@torch.no_grad()
def test_each_step_predicts_the_token_k_further_on(soft, transform):
    head, lm, samples = setup_case()
    steps = 4
    objective = Eagle3Objective(LossConfig(ttt_steps=steps, noise="none", soft=soft), lm, transform, head)
    batch = objective.prepare(collate(samples))
    sums = objective.sums(head, batch, None)
    states = dense_unroll(head, batch["input_ids"], batch["features"], steps)
    kept = head.vocab_map
    for k in range(steps):
        ce, correct, tokens, positions = 0.0, 0, 0, 0
        for row, s in enumerate(samples):
            ids, mask, hidden = s["input_ids"], s["loss_mask"], s["hidden"]
            for j in range(len(ids) - 1):  # head position j, fed t_{j+1+k}
                predicted = j + 2 + k  # sequence index of the token step k at column j predicts
                if predicted >= len(ids) or not mask[predicted]:
                    continue
                assert batch["input_ids"][row, j + k] == ids[j + 1 + k]
                target_logits = transform(lm @ hidden[predicted - 1])  # lm_head(f_{j+1+k}), processed
                greedy = int(target_logits.argmax())
                label = greedy if soft else int(ids[predicted])  # hard: the data token t_{j+2+k}
                draft_logits = head.logits(states[k][row, j])
                positions += 1
                correct += int(kept[draft_logits.argmax()] == greedy)
                if head.t2d[label]:
                    logp = torch.log_softmax(draft_logits, 0)
                    if soft:
                        ce -= float((torch.softmax(target_logits[kept], 0) * logp).sum())
                    else:
                        ce -= float(logp[int((kept == label).nonzero())])
                    tokens += 1
        assert sums[f"positions_{k}"] == positions and sums[f"tokens_{k}"] == tokens
        assert sums[f"correct_{k}"] == correct
        assert sums[f"ce_{k}"].item() == pytest.approx(ce, rel=1e-5)
    assert objective.normalisers(batch).tolist() == [sums[f"tokens_{k}"].item() for k in range(steps)]


def test_split_micro_batches_give_the_whole_batch_loss():
    head, lm, samples = setup_case(1)
    objective = Eagle3Objective(LossConfig(ttt_steps=3, noise="none"), lm, LogitTransform(), head)
    whole = objective.prepare(collate(samples))
    parts = [objective.prepare(collate(samples[:1])), objective.prepare(collate(samples[1:]))]
    total = sum(objective.normalisers(p) for p in parts)
    assert torch.equal(total, objective.normalisers(whole))
    split = sum(objective.loss(objective.sums(head, p, None), total) for p in parts)
    torch.testing.assert_close(split, objective.loss(objective.sums(head, whole, None), total))
