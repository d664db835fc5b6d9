"""Typed configuration schemas shared by every stage.

Each stage has its schema in a module of this package (`target`, `data`, ...). YAML under `conf/`
holds values only; `to_schema` turns Hydra's DictConfig into the dataclass once, at the entry point.
Nothing below an entry point sees a DictConfig.
"""

from eagle_train.config.base import REPO_ROOT, resolve_path, to_schema
from eagle_train.config.target import TargetConfig

__all__ = ["REPO_ROOT", "TargetConfig", "resolve_path", "to_schema"]
