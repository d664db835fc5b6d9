"""The learning-rate schedule (eagle_train.training.optim)."""

from __future__ import annotations

import pytest

from eagle_train.config.train import OptimConfig
from eagle_train.training.optim import lr_at


def test_schedule_warms_up_then_decays():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, schedule="linear", min_lr_ratio=0.0)
    assert lr_at(0, 110, cfg) == pytest.approx(0.1) and lr_at(9, 110, cfg) == pytest.approx(1.0)
    assert lr_at(60, 110, cfg) == pytest.approx(0.5) and lr_at(110, 110, cfg) == pytest.approx(0.0)
    cosine = OptimConfig(lr=1.0, warmup_steps=0, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(0, 100, cosine) == pytest.approx(1.0) and lr_at(50, 100, cosine) == pytest.approx(0.55)
    assert lr_at(100, 100, cosine) == pytest.approx(0.1)
