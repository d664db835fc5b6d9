"""Typed configuration schemas shared by every stage.

Each stage has its schema in a module of this package (`target`, `data`, ...). The dataclasses hold
every default; YAML under `conf/` holds real overrides only; `to_schema` turns Hydra's DictConfig into
the dataclass once, at the entry point. Nothing below an entry point sees a DictConfig.
"""

from eagle_train.config.base import CONF_DIR, DATA_DIR, data_path, resolve_path, to_schema
from eagle_train.config.target import TargetConfig

__all__ = ["CONF_DIR", "DATA_DIR", "TargetConfig", "data_path", "resolve_path", "to_schema"]
