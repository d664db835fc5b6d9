"""The Hydra edge of every stage: `@hydra.main` -> the stage's `run(cfg)` with its typed config.

Each stage's dataclass schema (eagle_train.config) is registered in Hydra's ConfigStore as
`<stage>_schema` and named first in `conf/<stage>.yaml`'s defaults list, so the dataclass holds every
default and its one-line docs, the YAML holds real overrides only, and a command-line key is checked
against the schema (`target.revision=main` works without `+`; a misspelt key fails before anything
runs). Hydra never changes the working directory and writes no output directory of its own
(`conf/base/hydra.yaml`), so under `accelerate launch` every process agrees on `out_dir`.

`stage_lock` is every writing stage's exclusive lock on its output (eagle_train.runtime.output_lock), made
to work under `accelerate launch`: the main process takes it and every process learns the outcome.

A user error (a bad setting, input or output; eagle_train.runtime.errors) ends a stage in one line on stderr
and exit code 1, whether Hydra refuses the command line (`check_command_line`), the schema refuses a value
(`to_schema`) or the stage refuses its inputs; a bug keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hydra
from accelerate.utils import broadcast_object_list
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from eagle_train.config.base import CONF_DIR, config_message, to_schema
from eagle_train.config.evaluate import EvaluateConfig
from eagle_train.config.export import ExportConfig
from eagle_train.config.extract import ExtractConfig
from eagle_train.config.fetch import FetchConfig
from eagle_train.config.pipeline import PipelineConfig
from eagle_train.config.regenerate import RegenerateConfig
from eagle_train.config.train import TrainConfig
from eagle_train.runtime.errors import ConfigError, user_errors
from eagle_train.runtime.output_lock import OutputLock

SCHEMAS: dict[str, type] = {
    "extract": ExtractConfig,
    "train": TrainConfig,
    "evaluate": EvaluateConfig,
    "regenerate": RegenerateConfig,
    "export": ExportConfig,
    "pipeline": PipelineConfig,
    "fetch": FetchConfig,
}


def register_schemas() -> None:
    """Put every stage schema in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        store.store(name=f"{name}_schema", node=schema)


register_schemas()


def stage_main(stage: str, run: Callable[[Any], Any]) -> Callable[[], None]:
    """The `main()` of a stage module: parse the command line with Hydra, call `run(typed_config)`; a user
    error ends it in one line (eagle_train.runtime.errors.user_errors)."""

    @hydra.main(config_path=str(CONF_DIR), config_name=stage, version_base="1.3")
    def hydra_main(cfg: DictConfig) -> None:
        with user_errors():
            run(to_schema(cfg, SCHEMAS[stage]))

    def main() -> None:
        with user_errors():
            check_command_line(stage, sys.argv[1:])
        hydra_main()

    return main


def check_command_line(stage: str, overrides: Sequence[str]) -> None:
    """Compose the stage's config as Hydra will, so that a misspelt key, an unknown preset or a value of
    the wrong type is a ConfigError in one line (Hydra prints these over several). Hydra's own flags
    (`--help`, `--cfg`, `-m`, ...) are left to Hydra."""
    if any(arg.startswith("-") for arg in overrides):
        return
    try:
        compose(stage, overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(f"{stage}: {composition_message(err)}") from None


def composition_message(err: BaseException) -> str:
    """Hydra's and OmegaConf's message and its cause's, on one line (`config_message`)."""
    parts = []
    while err is not None and len(parts) < 3:
        parts.append(config_message(err))
        err = err.__cause__
    return ": ".join(dict.fromkeys(p for p in parts if p))


def compose(stage: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The DictConfig a stage would see for these command-line overrides (tests, scripts)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=stage, overrides=list(overrides))


def on_main(accelerator, fn: Callable[[], Any]) -> Any:
    """Run `fn()` on the main process only (all of them without an accelerator); an exception raised
    there is raised on every process, so none is left waiting in a collective call. Returns fn's result
    on the main process, None elsewhere."""
    result, error = None, None
    if accelerator is None or accelerator.is_main_process:
        try:
            result = fn()
        except Exception as err:  # re-raised below, on every process
            error = err
    if accelerator is not None and accelerator.num_processes > 1:
        error = broadcast_object_list([error])[0]
        if error is not None:
            error.on_every_rank = True  # every process raises it: one of them reports it (runtime.errors)
    if error is not None:
        raise error
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return result


@contextmanager
def stage_lock(output: str | Path, stage: str, accelerator=None) -> Iterator[None]:
    """Hold the exclusive lock on `output` for the body (LockedError naming the holder if another run
    has it). With an `accelerate.Accelerator` of several processes the main process takes it (`on_main`),
    so every process of a refused launch stops with the same message."""
    lock = on_main(accelerator, lambda: OutputLock(output, stage).acquire())
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
