"""conf/data/*.yaml validate against DataConfig and point at shipped files that exist."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from eagle_train.config.base import CONF_DIR, DATA_DIR, to_schema
from eagle_train.config.data import DataConfig

DATA_CONFIGS = sorted(p.stem for p in (CONF_DIR / "data").glob("*.yaml"))


def test_shipped_data_configs_exist():
    assert {"tinystories", "alpaca", "fastchat_dummy", "sharegpt_prompts"} <= set(DATA_CONFIGS)


@pytest.mark.parametrize("name", DATA_CONFIGS)
def test_data_config_composes(name):
    cfg = to_schema(OmegaConf.load(CONF_DIR / "data" / f"{name}.yaml"), DataConfig)
    assert cfg.name == name and Path(cfg.path).is_absolute() and Path(cfg.path).is_file()
    assert Path(cfg.path).is_relative_to(DATA_DIR)


def test_defaults_and_checks():
    cfg = DataConfig()
    assert cfg.path == str(DATA_DIR / "tinystories" / "tinystories_sharegpt.jsonl")
    for bad in (
        {"eval_fraction": 1.0},
        {"limit": 0},
        {"max_len": 1},
        {"leading_assistant": "keep"},
        {"repeated_roles": "concat"},
    ):
        with pytest.raises(ValueError, match="data\\."):
            DataConfig(**bad)
