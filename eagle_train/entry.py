"""The Hydra edge of every stage: `@hydra.main` -> the stage's `run(cfg)` with its typed config.

Each stage's dataclass schema (eagle_train.config) is registered in Hydra's ConfigStore as
`<stage>_schema` and named first in `conf/<stage>.yaml`'s defaults list, so the dataclass holds every
default and its one-line docs, the YAML holds real overrides only, and a command-line key is checked
against the schema (`target.revision=main` works without `+`; a misspelt key fails before anything
runs). Hydra never changes the working directory and writes no output directory of its own
(`conf/hydra/eagle.yaml`), so under `accelerate launch` every process agrees on `out_dir`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import hydra
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from eagle_train.config.base import CONF_DIR, to_schema
from eagle_train.config.evaluate import EvaluateConfig
from eagle_train.config.export import ExportConfig
from eagle_train.config.extract import ExtractConfig
from eagle_train.config.pipeline import PipelineConfig
from eagle_train.config.regenerate import RegenerateConfig
from eagle_train.config.train import TrainConfig

SCHEMAS: dict[str, type] = {
    "extract": ExtractConfig,
    "train": TrainConfig,
    "evaluate": EvaluateConfig,
    "regenerate": RegenerateConfig,
    "export": ExportConfig,
    "pipeline": PipelineConfig,
}


def register_schemas() -> None:
    """Put every stage schema in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        store.store(name=f"{name}_schema", node=schema)


register_schemas()


def stage_main(stage: str, run: Callable[[Any], Any]) -> Callable[[], None]:
    """The `main()` of a stage module: parse the command line with Hydra, call `run(typed_config)`."""

    @hydra.main(config_path=str(CONF_DIR), config_name=stage, version_base="1.3")
    def main(cfg: DictConfig) -> None:
        run(to_schema(cfg, SCHEMAS[stage]))

    return main


def compose(stage: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The DictConfig a stage would see for these command-line overrides (tests, scripts)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=stage, overrides=list(overrides))
