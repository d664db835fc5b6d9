"""`python -m eagle_train.pipeline experiment=tiny_cpu` (`make demo`): one experiment, end to end.

Runs the experiment preset's stages (prepare, regenerate, extract, train, evaluate) in order, each as
a subprocess (`python -m eagle_train.<stage> OVERRIDES...`: stage modules are never imported here), all
writing under one run directory. A stage whose outputs exist is skipped, so a rerun resumes; a stage
whose command changed since it finished is run again. Each stage's output is shown live and kept in
`<run_dir>/logs/<stage>.log`; `<run_dir>/pipeline.json` records the commands and their times. The
evaluation report table is printed once: live by the evaluate stage, or at the end when it was skipped.

Extra overrides per stage: `'+overrides.train=["max_steps=10"]'`; rerun a finished stage: `force=[train]`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from eagle_train.config.base import CONF_DIR, to_schema
from eagle_train.config.pipeline import STAGE_ORDER, PipelineConfig, StageSpec


def stage_command(spec: StageSpec, extra: list[str]) -> list[str]:
    """The argv of a stage: `python -m MODULE ARGS` or `LAUNCHER ARGS`, plus the extra overrides."""
    head = [sys.executable, "-m", spec.module] if spec.module else list(spec.launcher)
    # A launcher installed beside this interpreter (the venv's `accelerate`) is used even when the venv's
    # bin/ is not on PATH, as under `make demo`.
    beside = Path(sys.executable).parent / head[0]
    if not spec.module and beside.is_file():
        head[0] = str(beside)
    return [*head, *spec.args, *extra]


def command_hash(argv: list[str]) -> str:
    """A short hash of a command (the interpreter path left out, so a moved venv still resumes)."""
    stable = argv[1:] if argv and argv[0] == sys.executable else argv
    return hashlib.sha256(json.dumps(stable).encode()).hexdigest()[:16]


def is_finished(spec: StageSpec, marker: Path, argv: list[str]) -> tuple[bool, str]:
    """Whether a stage can be skipped: its outputs exist and it last ran with this command."""
    missing = [o for o in spec.outputs if not Path(o).exists()]
    if missing:
        return False, f"missing {missing[0]}"
    if marker.is_file() and json.loads(marker.read_text()).get("hash") != command_hash(argv):
        return False, "its command changed since it finished"
    return True, "outputs present"


def run_logged(argv: list[str], log_file: Path, env: dict[str, str]) -> int:
    """Run `argv`, streaming its output to this process's stdout and to `log_file`; return its exit code."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in env.items()}}
    with (
        log_file.open("wb") as log,
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) as proc,
    ):
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(65536):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            log.write(chunk)
        return proc.wait()


def run_stage(name: str, spec: StageSpec, cfg: PipelineConfig, run_dir: Path) -> dict:
    """Run one stage unless finished; return its record for pipeline.json."""
    argv = stage_command(spec, cfg.overrides.get(name, []))
    marker = run_dir / ".stages" / f"{name}.json"
    done, why = is_finished(spec, marker, argv)
    if done and name not in cfg.force:
        print(f"[pipeline] {name}: skipped ({why})", flush=True)
        return {"stage": name, "argv": argv, "skipped": True, "seconds": 0.0}
    print(f"[pipeline] {name}: {' '.join(argv)}", flush=True)
    if cfg.dry_run:
        return {"stage": name, "argv": argv, "skipped": False, "seconds": 0.0, "dry_run": True}
    marker.unlink(missing_ok=True)
    start = time.perf_counter()
    code = run_logged(argv, run_dir / "logs" / f"{name}.log", spec.env)
    seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(
            f"[pipeline] stage {name!r} failed (exit code {code}); see {run_dir / 'logs' / f'{name}.log'}"
        )
    missing = [o for o in spec.outputs if not Path(o).exists()]
    if missing:
        raise SystemExit(f"[pipeline] stage {name!r} finished but did not write {missing}")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"hash": command_hash(argv), "argv": argv, "seconds": seconds}) + "\n")
    print(f"[pipeline] {name}: done in {seconds:.1f} s", flush=True)
    return {"stage": name, "argv": argv, "skipped": False, "seconds": seconds}


def run(cfg: PipelineConfig) -> list[dict]:
    """Run the experiment's enabled stages in order; print the stage times and the report table."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    records = [
        run_stage(name, cfg.stages[name], cfg, run_dir)
        for name in STAGE_ORDER
        if name in cfg.stages and cfg.stages[name].enabled
    ]
    total = time.perf_counter() - start
    summary = {"experiment": cfg.name, "run_dir": str(run_dir), "total_seconds": total, "stages": records}
    if not cfg.dry_run:
        (run_dir / "pipeline.json").write_text(json.dumps(summary, indent=2) + "\n")
    times = ", ".join(
        f"{r['stage']} " + ("skipped" if r["skipped"] else f"{r['seconds']:.0f} s") for r in records
    )
    print(f"\n[pipeline] {cfg.name}: {total:.1f} s in all ({times}); run directory {run_dir}")
    report = Path(cfg.report)
    evaluated_now = any(r["stage"] == "evaluate" and not r["skipped"] for r in records)
    if report.is_file() and not evaluated_now:  # a live evaluate stage has printed its table already
        print(f"\n{report.read_text()}")
    elif report.is_file():
        print(f"[pipeline] report: {report}")
    return records


@hydra.main(config_path=str(CONF_DIR), config_name="pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(to_schema(cfg, PipelineConfig))


if __name__ == "__main__":
    main()
