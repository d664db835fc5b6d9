"""conf/data/*.yaml validate against DataConfig and point at files that exist (or are built)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from eagle_train.config.base import CONF_DIR, REPO_ROOT, to_schema
from eagle_train.config.data import DataConfig
from eagle_train.data.tinystories import DEFAULT_OUT

DATA_CONFIGS = sorted(p.stem for p in (CONF_DIR / "data").glob("*.yaml"))


def test_shipped_data_configs_exist():
    assert {"tinystories", "alpaca", "fastchat_dummy", "sharegpt_prompts"} <= set(DATA_CONFIGS)


@pytest.mark.parametrize("name", DATA_CONFIGS)
def test_data_config_composes(name):
    cfg = to_schema(OmegaConf.load(CONF_DIR / "data" / f"{name}.yaml"), DataConfig)
    assert cfg.name == name and Path(cfg.path).is_absolute()
    if cfg.build == "tinystories":
        assert Path(cfg.path) == DEFAULT_OUT  # built on first use, only at the builder's own path
    else:
        assert Path(cfg.path).is_file()


def test_defaults_and_checks():
    cfg = DataConfig()
    assert cfg.path == str(REPO_ROOT / "data" / "generated" / "tinystories_sharegpt.jsonl")
    for bad in (
        {"eval_fraction": 1.0},
        {"limit": 0},
        {"max_len": 1},
        {"leading_assistant": "keep"},
        {"repeated_roles": "concat"},
        {"build": "alpaca"},
    ):
        with pytest.raises(ValueError, match="data\\."):
            DataConfig(**bad)
