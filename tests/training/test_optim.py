"""The learning-rate schedule (eagle_train.training.optim)."""

from __future__ import annotations

import pytest
import torch

from eagle_train.config.train import OptimConfig
from eagle_train.training.optim import lr_at


def test_schedule_warms_up_then_decays():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, schedule="linear", min_lr_ratio=0.0)
    assert lr_at(0, 110, cfg) == pytest.approx(0.1) and lr_at(9, 110, cfg) == pytest.approx(1.0)
    assert lr_at(60, 110, cfg) == pytest.approx(0.5) and lr_at(110, 110, cfg) == pytest.approx(0.0)
    cosine = OptimConfig(lr=1.0, warmup_steps=0, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(0, 100, cosine) == pytest.approx(1.0) and lr_at(50, 100, cosine) == pytest.approx(0.55)
    assert lr_at(100, 100, cosine) == pytest.approx(0.1)


@pytest.mark.parametrize("processes", [1, 4, 8])
def test_the_reference_recipe_reproduces_its_accelerate_prepared_scheduler(processes):
    """+recipe=eagle_reference against the reference's own scheduler: transformers'
    get_linear_schedule_with_warmup(2000, 800000), which accelerate steps once per process per optimizer
    step (AcceleratedScheduler), so optimizer step s runs at its value for s * processes. The decay is
    the same step for step; the warmup leads by one optimizer step (no step at lr 0)."""
    from transformers import get_linear_schedule_with_warmup

    from eagle_train.cli import compose
    from eagle_train.config.base import to_schema
    from eagle_train.config.train import TrainConfig

    cfg = to_schema(compose("train", ["features=x", "+recipe=eagle_reference"]), TrainConfig)
    assert cfg.optim.weight_decay == 0.01 and cfg.loss.noise == "length_scaled"
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    factor = get_linear_schedule_with_warmup(optimizer, 2000, 800000).lr_lambdas[0]
    # the reference's 20 epochs (21 passes) over 64.6k training conversations at 4 per GPU and step
    total = 339_150 // processes
    warm = 2000 // processes
    for step in [*range(0, warm + 3), *range(warm + 3, total + 1, 997), total - 1]:
        ours = lr_at(step, total, cfg.optim, processes)
        if step + 1 < warm:
            assert ours == pytest.approx(cfg.optim.lr * factor((step + 1) * processes))
        elif step >= warm:
            assert ours == pytest.approx(cfg.optim.lr * factor(step * processes), rel=1e-9)
    end = lr_at(total - 1, total, cfg.optim, processes) / cfg.optim.lr
    assert end == pytest.approx(0.5775, abs=2e-3)  # "decays only to about 0.58x the peak"


def test_the_default_schedule_does_not_depend_on_the_process_count():
    """The default warms up over 2000 optimizer steps and ends at 0 on the run's last step, on any number
    of processes (the reference's would warm up 8x faster on 8 GPUs)."""
    cfg = OptimConfig()
    for processes in (1, 8):
        assert lr_at(1999, 10_000, cfg, processes) == pytest.approx(cfg.lr)
        assert lr_at(999, 10_000, cfg, processes) == pytest.approx(cfg.lr / 2)
        assert lr_at(10_000, 10_000, cfg, processes) == 0.0
