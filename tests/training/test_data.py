"""Batch plans, the held-out split and collation (eagle_train.training.data)."""

from __future__ import annotations

import torch

from eagle_train.store.codec import decode, encode, storage
from eagle_train.training.data import collate, head_batch, pad_samples, plan_epoch, split_by_id, step_schedule
from eagle_train.training.loss import shift_sequence


def test_batch_plans_cover_the_split_once_and_respect_the_budget():
    lengths = [5, 50, 7, 48, 9, 51, 6, 49, 30, 2]
    indices = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    for bucket in (True, False):
        plan = plan_epoch(indices, lengths, max_tokens=100, max_batch_size=3, bucket=bucket, seed=1)
        assert sorted(i for b in plan for i in b) == indices
        assert all(len(b) <= 3 and (len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 100) for b in plan)
    assert plan_epoch(indices, lengths, 100, 3, True, 1) == plan_epoch(indices, lengths, 100, 3, True, 1)
    train, held = split_by_id([f"c{i}" for i in range(10)], lengths, 0.3)
    assert 9 not in train + held and set(train).isdisjoint(held)  # length 2: no trainable position


def test_bucketed_batches_are_new_every_epoch_at_little_padding():
    """With the default bucket_jitter each epoch's bucketed micro-batches hold other sequences (not only
    another order), still a pure function of (seed, epoch) and with little padding; jitter 0 keeps the
    same batches every epoch."""
    import random

    from eagle_train.config.train import TrainConfig
    from eagle_train.data.batching import padding_fraction

    rng = random.Random(0)  # long-tailed lengths like ShareGPT's, capped at 2048
    lengths = [min(2048, max(8, int(rng.lognormvariate(6.0, 0.9)))) for _ in range(4000)]
    indices = list(range(len(lengths)))
    jitter = TrainConfig(features="x").bucket_jitter

    def plan(epoch: int, jitter: float) -> list[list[int]]:
        return plan_epoch(indices, lengths, 8192, 4, True, epoch, jitter)

    epochs = [plan(e, jitter) for e in range(3)]
    for p in epochs:
        assert sorted(i for b in p for i in b) == indices
        assert all(len(b) <= 4 and (len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 8192) for b in p)
        assert padding_fraction(lengths, p) < 0.02
    batch_sets = [{frozenset(b) for b in p} for p in epochs]
    assert len(batch_sets[0] & batch_sets[1]) < 0.05 * len(batch_sets[0])  # new batch mates
    assert plan(1, jitter) == epochs[1]  # deterministic: a resumed run sees the same epoch
    assert {frozenset(b) for b in plan(0, 0.0)} == {frozenset(b) for b in plan(1, 0.0)}


def test_collate_pads_right_and_masks_padding():
    samples = [
        {
            "input_ids": torch.tensor([1, 2, 3, 4]),
            "loss_mask": torch.tensor([0, 1, 1, 1]).bool(),
            "hidden": torch.ones(4, 2),
        },
        {
            "input_ids": torch.tensor([5, 6, 7]),
            "loss_mask": torch.tensor([0, 1, 1]).bool(),
            "hidden": torch.ones(3, 2),
        },
    ]
    batch = collate(samples)
    assert batch["input_ids"].tolist() == [[2, 3, 4], [6, 7, 0]]
    assert batch["loss_mask"].tolist() == [[True, True, False], [True, False, False]]
    assert batch["target_ids"].tolist() == [[3, 4, 0], [7, 0, 0]]
    assert batch["positions"].tolist() == [3, 2] and batch["features"].shape == (2, 3, 2)


def test_head_batch_is_each_sequence_shifted_alone_then_padded():
    """The batched shift (eagle_train.training.loss.shift_batch) equals shift_sequence per row, padded
    after."""
    gen = torch.Generator().manual_seed(0)
    samples = [
        {
            "input_ids": torch.randint(1, 50, (n,), generator=gen),
            "loss_mask": torch.rand(n, generator=gen) > 0.3,
            "hidden": torch.randn(n, 6, generator=gen),
        }
        for n in (7, 3, 5)
    ]
    batch = collate(samples)
    for row, s in enumerate(samples):
        alone = shift_sequence(s["input_ids"], s["loss_mask"], s["hidden"])
        n = s["input_ids"].shape[0] - 1
        for key, value in alone.items():
            assert torch.equal(batch[key][row, :n], value), key
            assert not batch[key][row, n:].any(), key  # padding: zeros, mask False
    assert batch["positions"].tolist() == [6, 2, 4]


def test_stored_fp8_features_stay_fp8_on_the_host_and_decode_on_the_device():
    x = torch.randn(5, 8)
    codes, scale = encode(x, storage("fp8"), group=8)
    sample = {
        "input_ids": torch.arange(5),
        "loss_mask": torch.ones(5, dtype=torch.bool),
        "hidden": codes,
        "hidden_scale": scale,
    }
    padded = pad_samples([sample, {k: v[:3] for k, v in sample.items()}])
    assert padded["hidden"].dtype == torch.float8_e4m3fn and padded["hidden_scale"].shape == (2, 5, 1)
    batch = head_batch(padded, "cpu", torch.float32)
    torch.testing.assert_close(batch["features"][0], decode(codes, scale, torch.float32)[:-1])


def test_the_schedule_gives_each_process_its_share_in_order_across_epochs():
    plans = {e: [[10 * e + i] for i in range(5 + e % 2)] for e in range(4)}  # 5 or 6 micro-batches per epoch
    world, accum = 2, 1
    per_step = world * accum
    got = [list(step_schedule(plans.__getitem__, 0, 0, per_step, rank, world, 5)) for rank in range(world)]
    # epoch 0 (5 micro-batches): steps at cursors 0 and 2, the fifth dropped; epoch 1 (6): 0, 2, 4
    assert [(m.epoch, m.cursor, m.indices) for m in got[0]] == [
        (0, 0, (0,)),
        (0, 2, (2,)),
        (1, 0, (10,)),
        (1, 2, (12,)),
        (1, 4, (14,)),
    ]
    assert [m.indices for m in got[1]] == [(1,), (3,), (11,), (13,), (15,)]
    resumed = list(
        step_schedule(plans.__getitem__, 0, 4, per_step, 0, world, 3)
    )  # from a checkpoint at cursor 4
    assert [(m.epoch, m.cursor) for m in resumed] == [(1, 0), (1, 2), (1, 4)]
