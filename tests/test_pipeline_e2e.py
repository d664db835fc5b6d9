"""The demo end to end on the real stories260K, with tiny budgets: prepare -> regenerate -> extract ->
train -> evaluate as subprocesses in a temporary run directory, then a rerun that resumes (skips all)."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from eagle_train.config.base import CONF_DIR, to_schema
from eagle_train.config.pipeline import PipelineConfig
from eagle_train.pipeline import run

REDUCED = {
    "prepare": ["limit=96"],
    "regenerate": ["max_new_tokens=64"],
    "train": ["max_steps=100", "optim.warmup_steps=10", "eval_every=0", "save_every=0", "log_every=50"],
    "evaluate": ["bench=[tinystories]", "num_questions=2", "decode.max_new_tokens=48", "min_rounds=10"],
}


@pytest.mark.slow
def test_reduced_demo(tmp_path, capsys):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = to_schema(
            compose("pipeline", overrides=["experiment=tiny_cpu", f"run_dir={tmp_path}"]), PipelineConfig
        )
    cfg.overrides = REDUCED
    records = run(cfg)
    assert [r["stage"] for r in records] == ["prepare", "regenerate", "extract", "train", "evaluate"]
    assert not any(r["skipped"] for r in records)

    out = tmp_path / "eval"
    report = json.loads((out / "report.json").read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"ar", "chain", "eagle1", "eagle2"}
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 2 * 4
    assert all(a["identical"] for a in answers if a["method"] != "ar")  # greedy: every answer equals ar's
    assert all(rows[m]["identical"] == rows[m]["answers"] == 2 for m in ("chain", "eagle1", "eagle2"))
    assert rows["eagle2"]["tau"] > 1.0 and rows["chain"]["tau"] > 1.0  # even a briefly trained head drafts
    for name in (
        "report.md",
        "acceptance_by_position.png",
        "tau_histogram.png",
        "calibration.png",
        "speedup.png",
    ):
        assert (out / name).stat().st_size > 0
    row = "| tinystories | eagle2 | 2 |"
    assert capsys.readouterr().out.count(row) == 1  # the report table is printed, once

    assert all(r["skipped"] for r in run(cfg))  # a rerun resumes: every stage is finished
    assert capsys.readouterr().out.count(row) == 1  # ... and prints the finished report
