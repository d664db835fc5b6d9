"""The demo end to end on the real stories260K, with tiny budgets: prepare -> mix -> regenerate -> extract ->
train -> evaluate as subprocesses in a temporary run directory, then a rerun that resumes (skips all)."""

from __future__ import annotations

import json

import pytest

from eagle_train.cli import compose
from eagle_train.config.base import to_schema
from eagle_train.config.pipeline import PipelineConfig
from eagle_train.pipeline import run

REDUCED = {
    "prepare": ["limit=96"],
    "regenerate": ["max_new_tokens=64"],
    "train": ["max_steps=100", "optim.warmup_steps=10", "eval_every=0", "save_every=0", "log_every=50"],
    "evaluate": [
        "bench=[tinystories]",
        "num_questions=2",
        "decode.max_new_tokens=48",
        "min_rounds=10",
        "tune_prompts=2",
        "tune_tokens=16",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "experiment", [pytest.param("tiny_cpu", marks=pytest.mark.quick), "tiny_cpu_eagle3", "tiny_cpu_peagle"]
)
def test_reduced_demo(tmp_path, capsys, experiment):
    """The EAGLE-1 demo, the EAGLE-3 one (aux features in the store, an EAGLE-3 head through evaluation:
    every greedy answer equal to plain decoding's) and the P-EAGLE one (every method drafting a round in
    one forward)."""
    cfg = to_schema(
        compose(
            "pipeline",
            overrides=[f"experiment={experiment}", f"out_dir={tmp_path}", "vars.sharegpt_prompts=24"],
        ),
        PipelineConfig,
    )
    cfg.overrides = (
        {**REDUCED, "train": [*REDUCED["train"], "max_steps=40"]}
        if experiment.endswith("eagle3")
        else REDUCED
    )
    records = run(cfg)
    assert [r["stage"] for r in records] == ["prepare", "mix", "regenerate", "extract", "train", "evaluate"]
    assert not any(r["skipped"] for r in records)
    # the prompts: the 96 stories and 24 real ShareGPT prompts, each source recorded
    mix = json.loads((tmp_path / "data" / "prompts.jsonl.stats.json").read_text())
    assert [s["kept"] for s in mix["sources"]] == [96, 24] and mix["conversations"] == 120

    out = tmp_path / "eval"
    report = json.loads((out / "report.json").read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"ar", "chain", "static_tree", "dynamic_tree"}
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 2 * 4
    assert all(a["identical"] for a in answers if a["method"] != "ar")  # greedy: every answer equals ar's
    assert all(
        rows[m]["identical"] == rows[m]["answers"] == 2 for m in ("chain", "static_tree", "dynamic_tree")
    )
    assert (
        rows["dynamic_tree"]["tau"] > 1.0 and rows["chain"]["tau"] > 1.0
    )  # even a briefly trained head drafts
    head = json.loads((tmp_path / "train" / "final" / "config.json").read_text())
    kinds = {"tiny_cpu": "eagle1", "tiny_cpu_eagle3": "eagle3", "tiny_cpu_peagle": "peagle"}
    assert head["eagle_train"]["type"] == kinds[experiment]
    for name in (
        "report.md",
        "acceptance_by_position.png",
        "tau_histogram.png",
        "calibration.png",
        "speedup.png",
        "cost_curves.png",
    ):
        assert (out / name).stat().st_size > 0
    # decode.shape=auto / decode.tree=auto: every tree chosen from this run's measurements, and stated
    chosen = {r["method"]: r for r in report["shapes"]["chosen"]}
    assert set(chosen) == {"chain", "static_tree", "dynamic_tree"}
    assert all(c["measured_tau"] == rows[m]["tau"] for m, c in chosen.items())
    assert "## Tree shapes (decode.shape=auto)" in (out / "report.md").read_text()
    row = "| tinystories | dynamic_tree | 2 |"
    assert capsys.readouterr().out.count(row) == 1  # the report table is printed, once

    assert all(r["skipped"] for r in run(cfg))  # a rerun resumes: every stage is finished
    assert capsys.readouterr().out.count(row) == 1  # ... and prints the finished report
