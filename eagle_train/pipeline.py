"""`python -m eagle_train.pipeline experiment=tiny_cpu` (`make demo`): one experiment, end to end.

Runs the experiment preset's stages (prepare, mix, regenerate, extract, train, evaluate) in order, each as
a subprocess (`python -m eagle_train.<stage> OVERRIDES...`: stage modules are never imported here), all
writing under one run directory (`out_dir=`, default runs/<experiment>; locked:
eagle_train.runtime.output_lock). When a stage finishes, its record
`<out_dir>/.stages/<stage>.json` keeps the hash of its command, the sha256 of its outputs and of its
inputs (the outputs of the stages before it). A rerun skips a stage only when that record says it
finished with the same command and the same inputs and its outputs are unchanged; a stage killed
mid-run has no record and runs again, and once a stage runs, every stage after it runs too (so a
`force=[train]` re-evaluates the new head). Each stage's output is shown live and kept in
`<out_dir>/logs/<stage>.log`; `<out_dir>/pipeline.json` records the commands and their times. The
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

from eagle_train.cli import stage_lock, stage_main
from eagle_train.config.pipeline import STAGE_ORDER, PipelineConfig, StageSpec
from eagle_train.runtime.atomic_files import (
    FileFormatError,
    atomic_write_json,
    file_sha256,
    read_json,
    remove_partial_files,
)
from eagle_train.runtime.errors import UserError


def stage_command(spec: StageSpec, extra: list[str]) -> list[str]:
    """The argv of a stage: `python -m MODULE ARGS`, with `processes` > 1 `accelerate launch --multi_gpu
    --num_processes N -m MODULE ARGS`, or `LAUNCHER ARGS`; plus the extra overrides."""
    if spec.module and spec.processes == 1:
        return [sys.executable, "-m", spec.module, *spec.args, *extra]
    if spec.module:
        head = [
            "accelerate",
            "launch",
            "-q",  # a failed stage ends with its own message, not the launcher's traceback over it
            "--multi_gpu",
            "--num_processes",
            str(spec.processes),
            "-m",
            spec.module,
        ]
    else:
        head = list(spec.launcher)
    # A launcher installed beside this interpreter (the venv's `accelerate`) is used even when the venv's
    # bin/ is not on PATH, as under `make demo`.
    beside = Path(sys.executable).parent / head[0]
    if beside.is_file():
        head[0] = str(beside)
    return [*head, *spec.args, *extra]


def command_hash(argv: list[str]) -> str:
    """A short hash of a command (the interpreter path left out, so a moved venv still resumes; so is a
    launcher's -q, which changes what is printed, not what is computed)."""
    stable = argv[1:] if argv and argv[0] == sys.executable else argv
    stable = [a for a in stable if a not in ("-q", "--quiet")]
    return hashlib.sha256(json.dumps(stable).encode()).hexdigest()[:16]


def fingerprint(paths: list[str]) -> dict[str, str | None]:
    """sha256 of each output file (None: missing; a directory: the sorted names, sizes and mtimes inside)."""
    out: dict[str, str | None] = {}
    for name in paths:
        path = Path(name)
        if path.is_file():
            out[name] = file_sha256(path)
        elif path.is_dir():
            listing = sorted(
                (str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")
            )
            out[name] = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
        else:
            out[name] = None
    return out


def is_finished(spec: StageSpec, marker: Path, argv: list[str], inputs: dict) -> tuple[bool, str]:
    """Whether a stage can be skipped: its record says it finished with this command and these inputs,
    and its outputs are the ones it wrote."""
    missing = [o for o in spec.outputs if not Path(o).exists()]
    if missing:
        return False, f"missing {missing[0]}"
    if not marker.is_file():
        return False, "no record that it finished (a first run, or one that was stopped)"
    try:
        record = read_json(marker, "pipeline stage record")
    except FileFormatError as err:
        return False, f"{err}"
    if not isinstance(record, dict) or record.get("hash") != command_hash(argv):
        return False, "its command changed since it finished"
    if record.get("inputs") != inputs:
        return False, "its inputs changed since it finished"
    if record.get("outputs") != fingerprint(spec.outputs):
        return False, "its outputs changed since it finished"
    return True, "finished with this command and these inputs"


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


def last_error(log_file: Path) -> str:
    """What a failed stage said last: its `error: ...` line (runtime.errors), else its last line (a bug's
    exception line)."""
    lines = [line.strip() for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    return errors[-1] if errors else (lines[-1] if lines else "")


def run_stage(
    name: str, spec: StageSpec, cfg: PipelineConfig, run_dir: Path, inputs: dict, rerun: str
) -> dict:
    """Run one stage unless finished (`rerun`: why it must run anyway, "" if it need not); return its
    record for pipeline.json, with the fingerprint of its outputs."""
    argv = stage_command(spec, cfg.overrides.get(name, []))
    marker = run_dir / ".stages" / f"{name}.json"
    done, why = is_finished(spec, marker, argv, inputs)
    if name in cfg.force:
        done, why = False, "forced"
    elif rerun:
        done, why = False, rerun
    if done:
        print(f"[pipeline] {name}: skipped ({why})", flush=True)
        return {
            "stage": name,
            "argv": argv,
            "skipped": True,
            "seconds": 0.0,
            "outputs": fingerprint(spec.outputs),
        }
    print(f"[pipeline] {name} ({why}): {' '.join(argv)}", flush=True)
    if cfg.dry_run:
        return {"stage": name, "argv": argv, "skipped": False, "seconds": 0.0, "dry_run": True, "outputs": {}}
    marker.unlink(missing_ok=True)
    start = time.perf_counter()
    code = run_logged(argv, run_dir / "logs" / f"{name}.log", spec.env)
    seconds = time.perf_counter() - start
    if code != 0:
        log_file = run_dir / "logs" / f"{name}.log"
        said = last_error(log_file)
        raise UserError(
            f"pipeline stage {name!r} failed (exit code {code}){': ' + said if said else ''}; its log: {log_file}"
        )
    missing = [o for o in spec.outputs if not Path(o).exists()]
    if missing:
        raise SystemExit(f"[pipeline] stage {name!r} finished but did not write {missing}")
    outputs = fingerprint(spec.outputs)
    marker.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "hash": command_hash(argv),
        "argv": argv,
        "seconds": seconds,
        "inputs": inputs,
        "outputs": outputs,
    }
    atomic_write_json(marker, record)
    print(f"[pipeline] {name}: done in {seconds:.1f} s", flush=True)
    return {"stage": name, "argv": argv, "skipped": False, "seconds": seconds, "outputs": outputs}


def run(cfg: PipelineConfig) -> list[dict]:
    """Run the experiment's enabled stages in order; print the stage times and the report table."""
    run_dir = Path(cfg.out_dir)
    with stage_lock(run_dir, "pipeline"):
        run_dir.mkdir(parents=True, exist_ok=True)
        for directory in (run_dir, run_dir / ".stages"):  # what killed writes of pipeline.json / records left
            if directory.is_dir():
                remove_partial_files(directory, "*.json")
        return run_stages(cfg, run_dir)


def run_stages(cfg: PipelineConfig, run_dir: Path) -> list[dict]:
    """The stages in order: each one's inputs are the outputs of those before it; after one runs, all
    later ones run."""
    start = time.perf_counter()
    records: list[dict] = []
    inputs: dict[str, dict] = {}
    for name in (n for n in STAGE_ORDER if n in cfg.stages and cfg.stages[n].enabled):
        ran = next((r["stage"] for r in records if not r["skipped"]), None)
        rerun = f"{ran} ran before it" if ran else ""
        record = run_stage(name, cfg.stages[name], cfg, run_dir, dict(inputs), rerun)
        inputs[name] = record.pop("outputs")
        records.append(record)
    total = time.perf_counter() - start
    summary = {"experiment": cfg.name, "run_dir": str(run_dir), "total_seconds": total, "stages": records}
    if not cfg.dry_run:
        atomic_write_json(run_dir / "pipeline.json", summary, sort_keys=False)
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


main = stage_main("pipeline", run)


if __name__ == "__main__":
    main()
