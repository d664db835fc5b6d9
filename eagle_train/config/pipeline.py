"""`python -m eagle_train.pipeline experiment=NAME`: the stages of one experiment, run as subprocesses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STAGE_ORDER = ("prepare", "mix", "regenerate", "extract", "train", "evaluate")


@dataclass
class StageSpec:
    """One stage: the command that runs it and the files that exist once it has finished."""

    module: str = ""  # python module run as `python -m MODULE` (empty: `launcher` is the whole command)
    launcher: list[str] = field(
        default_factory=list
    )  # command prefix instead, e.g. [accelerate, launch, train.py]
    args: list[str] = field(default_factory=list)  # Hydra overrides / CLI arguments of the stage
    outputs: list[str] = field(default_factory=list)  # files present when the stage is done (resume check)
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables, e.g. OMP_NUM_THREADS
    processes: int = 1  # > 1: the module runs under `accelerate launch --multi_gpu --num_processes N`
    enabled: bool = True  # false: skip the stage

    def __post_init__(self) -> None:
        if not self.module and not self.launcher:
            raise ValueError("a pipeline stage needs a module or a launcher")
        if self.processes < 1 or (self.processes > 1 and not self.module):
            raise ValueError(
                f"stage {self.module or self.launcher}: processes={self.processes} needs a module and a count >= 1 "
                "(a launcher states its own processes)"
            )
        if self.enabled and not self.outputs:
            raise ValueError(f"stage {self.module or self.launcher}: list its outputs so a rerun can skip it")


@dataclass
class PipelineConfig:
    """An experiment: a run directory and its stages, run in STAGE_ORDER, each skipped when finished."""

    name: str = "experiment"  # the preset's name (printed, stored in the run directory)
    out_dir: str = "runs/${name}"  # the run directory: every stage writes under it
    vars: dict[str, Any] = field(
        default_factory=dict
    )  # the preset's own settings, used as ${vars.NAME} in args
    stages: dict[str, StageSpec] = field(default_factory=dict)  # stage name (one of STAGE_ORDER) -> spec
    overrides: dict[str, list[str]] = field(default_factory=dict)  # extra args appended per stage
    force: list[str] = field(default_factory=list)  # stages to rerun even when their outputs exist
    report: str = "${out_dir}/eval/report.md"  # printed at the end (the evaluate stage writes it)
    dry_run: bool = False  # print the commands without running them

    def __post_init__(self) -> None:
        unknown = sorted(set(self.stages) - set(STAGE_ORDER))
        if unknown:
            raise ValueError(f"unknown pipeline stages {unknown}; known: {list(STAGE_ORDER)}")
        for name in (*self.overrides, *self.force):
            if name not in self.stages:
                raise ValueError(
                    f"overrides/force name the stage {name!r}, which this experiment does not have"
                )
