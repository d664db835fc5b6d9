"""The vLLM client's own logic without vLLM: log reading, counter arithmetic, the agreement check, the
engine section of the report. (The real engine: tests/engines/test_vllm.py, `make test-engines`.)"""

from __future__ import annotations

import pytest

from eagle_train.decoding.stats import counts_acceptance, counts_tau
from eagle_train.engines.vllm_engine import (
    RUN_MARK,
    EngineError,
    EngineMismatch,
    EngineResult,
    EngineRun,
    agreement_problems,
    check_agreement,
    check_engine_python,
    engine_python,
    failure_reason,
    load_warnings,
    per_answer_counts,
    run_vllm,
    speculative_config,
    split_log,
)
from eagle_train.engines.vllm_worker import RUN_MARK as WORKER_RUN_MARK
from eagle_train.report.engine_section import engine_section
from eagle_train.report.results import spec_counts

# two greedy answers of the built-in chain decoder, K = 3: rounds accepted 2, 0, 3 and 1, 1
BUILTIN = [
    {"tokens": [5, 6, 7, 8, 9, 10, 11, 12, 13], "accept_lengths": [3, 1, 4], "draft_depths": [3, 3, 3]},
    {"tokens": [7, 8, 9, 10], "accept_lengths": [2, 2], "draft_depths": [3, 3]},
]
COUNTS = [
    {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 5, "accepted_per_pos": [2, 2, 1]},
    {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 2, "accepted_per_pos": [2, 0, 0]},
]


def engine(spec_counts_per_answer=COUNTS, spec_tokens=None, plain_tokens=None, warnings=()) -> EngineResult:
    tokens = [b["tokens"] for b in BUILTIN]
    spec = [
        {"tokens": t, "wall_s": 0.1, "spec": c}
        for t, c in zip(spec_tokens or tokens, spec_counts_per_answer, strict=True)
    ]
    zero = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    plain = [{"tokens": t, "wall_s": 0.2, "spec": zero} for t in plain_tokens or tokens]
    return EngineResult(
        {
            "chain": EngineRun("chain", 1.0, spec, None, list(warnings)),
            "ar": EngineRun("ar", 1.0, plain),
            "broken": EngineRun("broken", 0.0, [], "ValueError: no"),
        },
        None,
    )


def test_counts_from_rounds_are_vllms_counts():
    assert spec_counts(BUILTIN) == {
        "num_drafts": 5,
        "num_draft_tokens": 15,
        "num_accepted_tokens": 7,
        "accepted_per_pos": [4, 2, 1],
    }
    assert spec_counts([{"spec": c} for c in COUNTS]) == spec_counts(BUILTIN)
    assert counts_tau(spec_counts(BUILTIN)) == pytest.approx((3 + 1 + 4 + 2 + 2) / 5)
    assert counts_acceptance(spec_counts(BUILTIN)) == pytest.approx([4 / 5, 2 / 4, 1 / 2])
    plain = {"accept_lengths": [1, 1], "draft_depths": [0, 0]}  # an ar record: no drafts
    assert spec_counts([plain])["num_drafts"] == 0 and counts_tau(spec_counts([plain])) is None


def test_agreeing_engines_pass():
    assert agreement_problems(BUILTIN, engine()) == []
    check_agreement(BUILTIN, engine())


def test_each_disagreement_is_named():
    fewer = [COUNTS[0], {**COUNTS[1], "num_accepted_tokens": 1, "accepted_per_pos": [1, 0, 0]}]
    with pytest.raises(
        EngineMismatch, match=r"(?s)vLLM tau 2\.2000 .* built-in tau 2\.4000 .* did not load in vLLM"
    ):
        check_agreement(BUILTIN, engine(fewer))
    lossy = engine(spec_tokens=[[5, 6], BUILTIN[1]["tokens"]])
    assert any(
        "1 of 2 greedy answers of vLLM with speculation differ" in p
        for p in agreement_problems(BUILTIN, lossy)
    )
    noisy = engine(warnings=["WARNING weight x missing"])
    assert agreement_problems(BUILTIN, noisy) == ["vLLM log: WARNING weight x missing"]
    with pytest.raises(EngineError, match="vLLM could not run 'broken': ValueError: no"):
        check_agreement(BUILTIN, engine(), "broken")


def test_log_reading():
    text = "\n".join(
        [
            "INFO 12-01 [loader.py] Loading weights took 0.01 seconds",
            "WARNING 12-01 [utils.py] Some weights of the checkpoint were not used: fc.bias",
            "WARNING 12-01 [cpu.py] Triton is not installed.",
            f"{RUN_MARK}chain3",
            "[rank0]: AssertionError: Tried to load weights of size torch.Size([64, 128])",
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    assert load_warnings(text) == [
        "WARNING 12-01 [utils.py] Some weights of the checkpoint were not used: fc.bias"
    ]
    assert failure_reason(text) == "AssertionError: Tried to load weights of size torch.Size([64, 128])"
    served = [  # a `vllm serve` log: the root cause comes from a worker process, the generic error last
        "(Worker pid=23194) ERROR 12-03 06:49:51 [multiproc_executor.py:953]     raise RuntimeError(",
        "(Worker pid=23194) ERROR 12-03 06:49:51 [multiproc_executor.py:953] RuntimeError: Cannot find any "
        "model weights with `/heads/broken`",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ]
    assert (
        failure_reason("\n".join(served))
        == "RuntimeError: Cannot find any model weights with `/heads/broken`"
    )
    pydantic = [  # a config vLLM refuses: the type is dotted, the explanation on the indented line below
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        "  Value error, User-specified max_model_len (100000) is greater than the derived max_model_len",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
    ]
    assert failure_reason("\n".join(pydantic)) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig (Value error, "
        "User-specified max_model_len (100000) is greater than the derived max_model_len)"
    )
    traceback = [
        "Traceback (most recent call last):",
        '  File "x.py", line 1',
        "ValueError: bad",
        '  File "y"',
    ]
    assert failure_reason("\n".join(traceback)) == "ValueError: bad"  # a File line explains nothing
    assert split_log(f"{RUN_MARK}a\nx\n{RUN_MARK}b\ny\nz") == {"a": "x", "b": "y\nz"}
    assert RUN_MARK == WORKER_RUN_MARK


def test_cumulative_counters_become_per_answer_counts():
    start = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 1, "accepted_per_pos": [1]}
    after_one = {
        "num_drafts": 7,
        "num_draft_tokens": 21,
        "num_accepted_tokens": 6,
        "accepted_per_pos": [3, 2, 1],
    }
    after_two = {
        "num_drafts": 9,
        "num_draft_tokens": 27,
        "num_accepted_tokens": 8,
        "accepted_per_pos": [5, 2, 1],
    }
    run = {
        "spec_start": start,
        "outputs": [
            {"tokens": [1], "wall_s": 0.1, "spec_total": after_one},
            {"tokens": [2], "wall_s": 0.1, "spec_total": after_two},
        ],
    }
    assert [o["spec"] for o in per_answer_counts(run)] == COUNTS


def test_engine_python_paths(tmp_path, monkeypatch):
    with pytest.raises(EngineError, match="make vllm-env"):
        engine_python(str(tmp_path / "no-python"))
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert engine_python("bin/python") == python  # absolute: the worker runs in another directory
    assert speculative_config("head", 3) == {
        "method": "eagle",
        "model": str(tmp_path / "head"),
        "num_speculative_tokens": 3,
    }


def test_an_eagle3_head_is_given_to_vllm_as_eagle3(tmp_path):
    """vLLM's method follows the exported head: its architecture, or the speculators type."""
    import json

    for name, config in (
        ("vllm", {"architectures": ["LlamaForCausalLMEagle3"]}),
        ("speculators", {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3"}),
        ("eagle1", {"architectures": ["LlamaForCausalLM"]}),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert speculative_config(tmp_path / "vllm", 2)["method"] == "eagle3"
    assert speculative_config(tmp_path / "speculators", 2)["method"] == "eagle3"
    assert speculative_config(tmp_path / "eagle1", 2)["method"] == "eagle"


def test_a_dflash_head_is_given_to_vllm_as_dflash_with_at_most_its_mask_slots(tmp_path):
    """`dflash_config` (vLLM's layout) or the speculators type dflash: method dflash, K cut to B - 1."""
    import json

    for name, config in (
        ("vllm", {"architectures": ["DFlashDraftModel"], "dflash_config": {}, "block_size": 8}),
        ("speculators", {"speculators_model_type": "dflash", "block_size": 8}),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        for k, drafted in ((3, 3), (7, 7), (12, 7)):
            spec = speculative_config(tmp_path / name, k)
            assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == drafted, (name, k)
            assert "parallel_drafting" not in spec  # vLLM's dflash method drafts in parallel itself


def test_engine_section_side_by_side_and_flags(tmp_path):
    records = []
    for i, b in enumerate(BUILTIN):
        key = {"bench": "tinystories", "question_id": str(i), "turn": 0}
        records.append({**key, "method": "chain", "new_tokens": len(b["tokens"]), "wall_s": 0.1, **b})
        records.append(
            {
                **key,
                "method": "ar",
                "new_tokens": len(b["tokens"]),
                "wall_s": 0.2,
                "tokens": b["tokens"],
                "accept_lengths": [1] * len(b["tokens"]),
                "draft_depths": [0] * len(b["tokens"]),
            }
        )
    engine_records = [
        {
            "bench": r["bench"],
            "question_id": r["question_id"],
            "turn": 0,
            "engine": "vllm",
            "method": r["method"],
            "new_tokens": r["new_tokens"],
            "wall_s": r["wall_s"] / 2,
            "tokens": r["tokens"],
            "spec": COUNTS[int(r["question_id"])]
            if r["method"] == "chain"
            else {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []},
        }
        for r in records
    ]
    section = engine_section(records, engine_records, tmp_path, 3)
    assert section["sanity"] == [] and (tmp_path / "acceptance_by_position_engines.png").is_file()
    rows = {r["engine"]: r for r in section["rows"]}
    assert rows["vllm"]["counts"] == rows["builtin"]["counts"] and rows["vllm"]["same_as_builtin"] == 2
    assert rows["vllm"]["tokens_per_s"] == pytest.approx(2 * rows["builtin"]["tokens_per_s"])
    assert "| bench | figure | builtin | vllm |" in section["markdown"]
    assert "| tinystories | tau | 2.4000 | 2.4000 |" in section["markdown"]
    engine_records[0]["spec"] = COUNTS[1]
    engine_records[0]["tokens"] = [5]
    notes = engine_section(records, engine_records, tmp_path, 3, plots=False)["sanity"]
    assert any("differs from the built-in chain decoder's" in n for n in notes)
    assert any("1 of 2 greedy answers with speculation differ" in n for n in notes)
    assert any("1 of 2 answers differ from the built-in decoder's" in n for n in notes)


def fake_python(path, script: str):
    """An executable standing in for vLLM's python (a shell script)."""
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def test_an_engine_environment_that_cannot_run_vllm_is_refused_naming_its_exit_code(tmp_path):
    python = fake_python(tmp_path / "python", 'echo "fake: no module named vllm" >&2\nexit 3\n')
    with pytest.raises(
        EngineError, match=r"python .* exited with code 3; its last lines: fake: no module named vllm"
    ):
        check_engine_python(str(python))
    assert check_engine_python(str(fake_python(tmp_path / "ok", "exit 0\n"))) == tmp_path / "ok"


@pytest.mark.parametrize(
    "worker, message",
    [
        ('echo "starting the fake engine"\nexit 3\n', r"worker exited with code 3: .*; log: \S*vllm.log; its last lines: starting the fake engine"),
        ("exit 0\n", r"worker exited with code 0 without writing \S*result.json: .*the log is empty"),
        ('echo \'{"vllm_version": "0", "runs": [{"name": "ar", "load_s": 1, "spec_start": {}, "outputs": []}]}\' > "$3"\n',
         r"worker wrote 0 answers for run 'ar' of 2 prompts"),
    ],
)  # fmt: skip
def test_an_engine_worker_that_gives_no_answers_is_reported_with_its_exit_code_and_log(
    tmp_path, worker, message
):
    """A worker that dies, one that exits 0 without a result, and one whose result has fewer answers than
    prompts: an EngineError naming the exit code, the log and its last lines, never a zip() error later."""
    python = fake_python(tmp_path / "python", worker)
    with pytest.raises(EngineError, match=message):
        run_vllm(
            "model", [[1, 2], [1, 3]], {"ar": None}, tmp_path / "work",
            max_tokens=4, stop_token_ids=[2], max_model_len=64, python=str(python),
        )  # fmt: skip


def test_evaluate_checks_the_engine_environment_before_any_work(target, tmp_path):
    """evaluate engine=vllm with an engine python that cannot run vLLM stops in one line before the
    built-in decoder runs: no answers, no report, no output directory."""
    from eagle_train.modeling.draft import DraftHead
    from eagle_train.modeling.head_checkpoint import save_head
    from tests.conftest import error_line, run_module

    head = save_head(DraftHead.from_target(target.config, target=target), tmp_path / "head", {"target": "s"})
    python = fake_python(tmp_path / "python", 'echo "fake: no module named vllm"\nexit 3\n')
    out = tmp_path / "eval"
    done = run_module(
        "eagle_train.evaluate", "engine=vllm", f"engine_python={python}", f"draft.path={head}",
        f"out_dir={out}", "bench=[mt_bench]", "num_questions=1", "progress=false", "plots=false",
    )  # fmt: skip
    assert done.returncode == 1
    line = error_line(done.stderr)
    assert "exited with code 3" in line and str(python) in line and "fake: no module named vllm" in line
    assert not out.exists()
