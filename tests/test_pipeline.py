"""The experiment runner: presets compose, every stage's overrides are valid for that stage, and a run
resumes (a finished stage is skipped, a changed one reruns, a failing one stops the run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from eagle_train.cli import SCHEMAS, compose
from eagle_train.config.base import to_schema
from eagle_train.config.pipeline import PipelineConfig, StageSpec
from eagle_train.data.mix import parse_args as mix_args
from eagle_train.data.mix import parse_source
from eagle_train.data.tinystories import parse_args as tinystories_args
from eagle_train.pipeline import command_hash, run
from eagle_train.runtime.errors import UserError

# (experiment, extra overrides, expected name): the GPU preset with every target preset
PRESETS = [(p, [], p) for p in ("tiny_cpu", "tiny_cpu_eagle3", "tiny_cpu_peagle")] + [
    ("gpu_reference", [f"vars.target={t}"], t)
    for t in ("llama3_1_8b_instruct", "vicuna_7b_v1_3", "qwen2_5_7b_instruct", "mistral_7b_instruct")
]
# stage module -> its Hydra primary config (conf/<name>.yaml)
HYDRA_STAGES = {
    "eagle_train.regenerate": "regenerate",
    "eagle_train.extract": "extract",
    "eagle_train.train": "train",
    "eagle_train.evaluate": "evaluate",
}


def compose_pipeline(overrides: list[str]) -> PipelineConfig:
    return to_schema(compose("pipeline", overrides=overrides), PipelineConfig)


def stage_config_name(spec: StageSpec) -> str | None:
    if spec.module:
        return HYDRA_STAGES.get(spec.module)
    return "train" if "train.py" in spec.launcher else HYDRA_STAGES.get(spec.launcher[-1])


@pytest.mark.parametrize("preset, extra, name", PRESETS, ids=lambda v: str(v))
def test_preset_stages_accept_their_overrides(preset, extra, name, tmp_path):
    cfg = compose_pipeline([f"experiment={preset}", f"out_dir={tmp_path}", *extra])
    assert cfg.name == name and {"extract", "train", "evaluate"} <= set(cfg.stages)
    assert cfg.report.startswith(str(tmp_path))
    for name, spec in cfg.stages.items():
        assert all(o.startswith(str(tmp_path)) or "${" not in o for o in spec.outputs)
        config_name = stage_config_name(spec)
        if spec.module == "eagle_train.data.tinystories":
            tinystories_args(spec.args)  # argparse exits on an unknown argument
        elif spec.module == "eagle_train.data.mix":
            for source in mix_args(spec.args).source:
                path, _ = parse_source(source)
                assert path.startswith(str(tmp_path)) or Path(path).is_file(), source
        elif config_name is not None:  # the stage's own config and schema accept these overrides
            to_schema(compose(config_name, overrides=spec.args), SCHEMAS[config_name])
        else:
            raise AssertionError(f"{preset}/{name}: unknown stage command {spec}")
        if spec.module:
            assert importlib.util.find_spec(spec.module) is not None, spec.module


@pytest.mark.parametrize("preset", ["tiny_cpu", "tiny_cpu_eagle3", "tiny_cpu_peagle"])
@pytest.mark.parametrize("processes, tokens", [(1, 4096), (2, 2048), (4, 1024)])
def test_demo_training_step_holds_4096_tokens_on_any_process_count(preset, processes, tokens):
    """vars.processes shares the demo's training step out: the same optimizer step on any count."""
    spec = compose_pipeline([f"experiment={preset}", f"vars.processes={processes}"]).stages["train"]
    assert spec.processes == processes and f"max_tokens={tokens}" in spec.args


def test_per_process_refuses_an_uneven_split():
    with pytest.raises(ValueError, match="4096 does not split evenly over 3 processes"):
        compose_pipeline(["experiment=tiny_cpu", "vars.processes=3"])  # resolved as the preset composes


def prepare_only(tmp_path, limit: int, **kw) -> PipelineConfig:
    out = tmp_path / "convs.jsonl"
    spec = StageSpec(
        module="eagle_train.data.tinystories", args=[f"out={out}", f"limit={limit}"], outputs=[str(out)]
    )
    return PipelineConfig(
        name="t", out_dir=str(tmp_path), stages={"prepare": spec}, report=str(tmp_path / "none.md"), **kw
    )


def test_run_resume_rerun_and_failure(tmp_path, capsys):
    records = run(prepare_only(tmp_path, 5))
    lines = (tmp_path / "convs.jsonl").read_text().splitlines()
    assert len(lines) == 5 and not records[0]["skipped"]
    assert "wrote 5 conversations" in (tmp_path / "logs" / "prepare.log").read_text()
    assert json.loads((tmp_path / "pipeline.json").read_text())["stages"][0]["stage"] == "prepare"

    assert run(prepare_only(tmp_path, 5))[0]["skipped"]  # finished, same command: skipped
    assert not run(prepare_only(tmp_path, 5, force=["prepare"]))[0]["skipped"]
    assert not run(prepare_only(tmp_path, 7))[0]["skipped"]  # command changed: rerun
    assert len((tmp_path / "convs.jsonl").read_text().splitlines()) == 7

    bad = prepare_only(tmp_path, 3)
    bad.stages["prepare"].args.append("--no-such-flag")
    with pytest.raises(
        UserError, match=r"stage 'prepare' failed \(exit code 2\): .*no-such-flag.*prepare.log"
    ):
        run(bad)
    assert not (tmp_path / ".stages" / "prepare.json").exists()  # a failed stage is never marked done


def two_stages(tmp_path, **kw) -> PipelineConfig:
    """prepare writes a.jsonl; regenerate (the same cheap builder) writes b.jsonl after it."""
    specs = {
        name: StageSpec(
            module="eagle_train.data.tinystories",
            args=[f"out={tmp_path / file}", f"limit={limit}"],
            outputs=[str(tmp_path / file)],
        )
        for name, file, limit in (("prepare", "a.jsonl", 4), ("regenerate", "b.jsonl", 3))
    }
    return PipelineConfig(
        name="t", out_dir=str(tmp_path), stages=specs, report=str(tmp_path / "none.md"), **kw
    )


def test_only_stages_finished_with_these_inputs_are_skipped(tmp_path):
    """Outputs left by a killed or earlier run are not "finished"; a forced or rerun stage reruns
    every stage after it; a stage whose output or input changed since it finished reruns."""
    (tmp_path / "a.jsonl").write_text("old\n")  # an output from before, no record that it finished
    (tmp_path / "b.jsonl").write_text("old\n")
    assert [r["skipped"] for r in run(two_stages(tmp_path))] == [False, False]
    assert [r["skipped"] for r in run(two_stages(tmp_path))] == [True, True]
    assert [r["skipped"] for r in run(two_stages(tmp_path, force=["prepare"]))] == [False, False]
    (tmp_path / "b.jsonl").write_text("edited\n")  # an output changed since its stage finished
    assert [r["skipped"] for r in run(two_stages(tmp_path))] == [True, False]
    marker = tmp_path / ".stages" / "regenerate.json"
    record = json.loads(marker.read_text())
    record["inputs"]["prepare"][str(tmp_path / "a.jsonl")] = "0" * 64  # finished on other inputs
    marker.write_text(json.dumps(record))
    assert [r["skipped"] for r in run(two_stages(tmp_path))] == [True, False]
    marker.write_text("{")  # a broken record: the stage runs again
    assert [r["skipped"] for r in run(two_stages(tmp_path))] == [True, False]


def test_config_errors():
    with pytest.raises(ValueError, match="unknown pipeline stages"):
        PipelineConfig(stages={"finetune": StageSpec(module="x", outputs=["y"])})
    with pytest.raises(ValueError, match="list its outputs"):
        StageSpec(module="eagle_train.extract")
    with pytest.raises(ValueError, match="does not have"):
        PipelineConfig(stages={"train": StageSpec(module="x", outputs=["y"])}, force=["evaluate"])


def test_stage_command_uses_this_interpreter(tmp_path):
    cfg = compose_pipeline([f"out_dir={tmp_path}", '+overrides.evaluate=["num_questions=1"]', "dry_run=true"])
    records = run(cfg)
    evaluate = next(r for r in records if r["stage"] == "evaluate")
    assert evaluate["argv"][:3] == [sys.executable, "-m", "eagle_train.evaluate"]
    assert evaluate["argv"][-1] == "num_questions=1"
    assert not (tmp_path / "pipeline.json").exists()  # a dry run writes nothing


def test_a_stage_with_several_processes_runs_under_accelerate_launch(tmp_path):
    cfg = compose_pipeline([f"out_dir={tmp_path}", "vars.processes=2", "dry_run=true"])
    argv = {r["stage"]: r["argv"] for r in run(cfg)}
    accelerate = str(Path(sys.executable).parent / "accelerate")
    launched = [
        accelerate,
        "launch",
        "-q",
        "--multi_gpu",
        "--num_processes",
        "2",
        "-m",
        "eagle_train.regenerate",
    ]
    assert argv["regenerate"][:8] == launched
    # -q changes what the launcher prints, not what the stage computes: a finished stage stays finished
    assert command_hash(launched) == command_hash([a for a in launched if a != "-q"])
    assert argv["extract"][:3] == [sys.executable, "-m", "eagle_train.extract"]
    cfg = compose_pipeline([f"out_dir={tmp_path}", "vars.processes=1", "dry_run=true"])
    assert next(r["argv"] for r in run(cfg) if r["stage"] == "regenerate")[:3] == [
        sys.executable,
        "-m",
        "eagle_train.regenerate",
    ]
    with pytest.raises(ValueError, match="processes=2 needs a module"):
        StageSpec(launcher=["accelerate", "launch", "train.py"], outputs=["y"], processes=2)
