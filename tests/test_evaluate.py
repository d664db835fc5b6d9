"""`eagle_train.evaluate.run` on the real stories260K with an (untrained) head written to disk:
answers for every question, turn and method, greedy identity, the second turn's context, the report."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from eagle_train.cli import compose
from eagle_train.config.base import to_schema
from eagle_train.config.decode import DecodeConfig
from eagle_train.config.draft import DraftConfig
from eagle_train.config.evaluate import EvaluateConfig
from eagle_train.decoding.decoder import Round, record_rounds
from eagle_train.decoding.stats import GenerationStats
from eagle_train.decoding.tree import build_tree
from eagle_train.evaluate import block_notes, calibration_pairs, fit_prompt, run
from eagle_train.modeling.dflash import DFlashHead
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.head_checkpoint import save_head
from eagle_train.runtime.errors import InputError
from tests.conftest import decoder_fine_tune


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory):
    torch.manual_seed(0)
    head = DraftHead.from_target(target.config, num_layers=1, fc_bias=True)
    return save_head(head, tmp_path_factory.mktemp("head") / "final", {"target": "stories260k"})


def test_run_writes_answers_and_report(target_cfg, head_dir, tmp_path):
    user = tmp_path / "two_turns.jsonl"
    user.write_text(
        json.dumps({"id": "t", "turns": ["Once upon a time, a cat sat.", "Then it rained."]}) + "\n"
    )
    cfg = EvaluateConfig(
        target=target_cfg,
        draft=DraftConfig(path=str(head_dir)),
        bench=["tinystories", str(user)],
        methods=["ar", "chain", "dynamic_tree"],
        num_questions=2,
        out_dir=str(tmp_path / "eval"),
        num_threads=1,
        decode=DecodeConfig(max_new_tokens=24, depth=3, top_k=4, total_tokens=16),
        min_rounds=1000,
        progress=False,
    )
    report = run(cfg)
    out = tmp_path / "eval"
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    # tinystories: 2 questions x 1 turn x 3 methods; the user file: 1 question x 2 turns x 3 methods
    assert len(answers) == 12
    assert {(a["bench"], a["method"]) for a in answers} == {
        (b, m) for b in ("tinystories", "two_turns") for m in ("ar", "chain", "dynamic_tree")
    }
    for a in answers:
        assert a["new_tokens"] == len(a["tokens"]) > 0
        if a["method"] == "ar":
            assert a["accept_lengths"] == [1] * a["new_tokens"]
        else:  # the first token comes from the prefill; a stop may cut the last round short
            assert a["new_tokens"] <= sum(a["accept_lengths"]) + 1 and len(a["accept_lengths"]) == len(
                a["draft_depths"]
            )
        assert a["identical"] is (
            None if a["method"] == "ar" else True
        )  # greedy: equal to ar, token for token
    # the second turn is asked with the first answer in context
    turns = {a["turn"]: a for a in answers if a["bench"] == "two_turns" and a["method"] == "chain"}
    assert turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"] + turns[0]["new_tokens"] // 2
    rows = {(r["bench"], r["method"]): r for r in report["results"]}
    assert rows[("tinystories", "ar")]["speedup"] == pytest.approx(1.0)
    # every greedy answer is the model's own choice by its teacher-forced, cache-free forward
    assert all(a["model_check"] == {"kind": "identical"} for a in answers)
    assert rows[("two_turns", "ar")]["model_identical"] == rows[("two_turns", "ar")]["model_checked"] == 2
    assert (
        rows[("tinystories", "dynamic_tree")]["identical"] == 2
        and rows[("two_turns", "chain")]["answers"] == 2
    )
    assert all(r["tau"] >= 1.0 for r in rows.values())
    assert any("rounds (< 1000)" in n for n in report["sanity"])  # too few rounds is flagged
    for name in ("report.json", "report.md", "acceptance_by_position.png", "calibration.png", "speedup.png"):
        assert (out / name).stat().st_size > 0
    assert "| tinystories | dynamic_tree | 2 |" in (out / "report.md").read_text()


@pytest.mark.slow
def test_auto_shapes_end_to_end(target_cfg, head_dir, tmp_path, monkeypatch):
    """The evaluate default (decode.shape=auto, decode.tree=auto, threads measured): every speculative
    method decodes with the shape chosen for it, greedy identity holds, the report says what was chosen
    and predicted, and a rerun reuses the cost curves from eagle-train's cache."""
    monkeypatch.setenv("EAGLE_TRAIN_CACHE", str(tmp_path / "cache"))  # no curves measured before
    overrides = [
        f"draft.path={head_dir}",
        "bench=[tinystories]",
        "num_questions=1",
        "decode.max_new_tokens=16",
        "tune_prompts=1",
        "tune_tokens=12",
        f"out_dir={tmp_path}",
        "progress=false",
    ]
    # unbounded first (one question of 16 tokens leaves the default 10% budget no room for a race)
    base = to_schema(compose("evaluate", overrides=[*overrides, "tune_share=null"]), EvaluateConfig)
    assert base.decode.auto_methods == ("chain", "dynamic_tree", "static_tree") and base.num_threads is None
    report = run(base)
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert all(a["identical"] for a in answers if a["method"] != "ar")
    tuning = report["shapes"]["tuning"]["tinystories"]
    assert (
        set(tuning["methods"]) == {"chain", "dynamic_tree", "static_tree"}
        and not tuning["info"]["costs_reused"]
    )
    eagle2 = tuning["methods"]["dynamic_tree"]
    rounds = [a for a in answers if a["method"] == "dynamic_tree"]
    assert max(d for a in rounds for d in a["draft_depths"]) <= eagle2["depth"] + 1
    assert report["meta"]["threads"].startswith("1 ")  # the tests' torch runs one thread
    assert (tmp_path / "cost_curves.png").stat().st_size > 0
    race, verdict = tuning["choice"]["race"], tuning["choice"]["verdict"]
    report_md = (tmp_path / "report.md").read_text()
    if (
        verdict is None
    ):  # a shape pays: EAGLE-2's is the race's fastest measured candidate, the report lists it
        assert len(race) >= 2 and {k: race[0][k] for k in eagle2} == eagle2
        assert "timed side by side on the calibration prompts" in report_md
    else:  # this small head's tau is about 1 on a busy machine: no race, the report says so in one line
        assert race == [] and f"**tinystories: {verdict}.**" in report_md
    assert "unbounded (tune_share=null)" in report_md and tuning["info"]["budget"]["eval_s"] > 0
    # a rerun with EAGLE-2's shape fixed and the default budget (10% of the evaluation): the cost curves
    # reused, the chain still chosen, no race, the tuning's cost against the evaluation's in the report
    fixed = to_schema(compose("evaluate", overrides=[*overrides, "decode.depth=2"]), EvaluateConfig)
    assert fixed.tune_share == 0.1
    again = run(fixed)["shapes"]["tuning"]["tinystories"]
    assert again["info"]["costs_reused"] and set(again["methods"]) == {"chain", "static_tree"}
    assert again["info"]["costs_file"].startswith(str(tmp_path / "cache" / "costs"))
    assert again["choice"]["race"] == []
    budget = again["info"]["budget"]
    assert budget["budget_s"] == pytest.approx(0.1 * budget["eval_tokens"] * budget["token_s"])
    spent = again["info"]["calibration_s"] + again["info"]["phases_s"] + again["info"]["race_s"]
    share = f"{spent / budget['eval_s']:.0%} of this benchmark's evaluation"
    assert share in (tmp_path / "report.md").read_text()


def bf16_eval(target_cfg, head_dir, out, methods, num_questions) -> dict:
    from dataclasses import replace

    cfg = EvaluateConfig(
        target=replace(target_cfg, dtype="bfloat16"),
        draft=DraftConfig(path=str(head_dir)),
        bench=["tinystories"],
        methods=methods,
        num_questions=num_questions,
        out_dir=str(out),
        num_threads=1,
        decode=DecodeConfig(max_new_tokens=160, depth=5, top_k=10, total_tokens=60),
        warmup=0,
        plots=False,
        progress=False,
    )
    return run(cfg)


@pytest.mark.slow
def test_bf16_answers_part_from_ar_only_at_near_ties(target_cfg, head_dir, tmp_path):
    """In bf16 (here on the CPU) greedy answers may part from plain decoding at a near-tie (on an AVX-512
    CPU most of these do; on an AVX2 one, whose bf16 products round otherwise, none may); the report counts
    them apart from real divergences and does not call the decoder lossy for them."""
    report = bf16_eval(target_cfg, head_dir, tmp_path, ["ar", "dynamic_tree"], num_questions=3)
    rows = [r for r in report["results"] if r["method"] != "ar"]
    assert all(r["divergences"] == 0 for r in rows)
    assert all(r["near_ties"] + r["identical"] == r["answers"] for r in rows)
    assert not any("not lossless" in n for n in report["sanity"])
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    ar = {a["question_id"]: a["tokens"] for a in answers if a["method"] == "ar"}
    for a in answers:
        if a["identical"] is False:
            d = a["divergence"]
            assert d["kind"] == "near_tie" and d["gap"] <= 4 * d["ulp"]
            assert a["tokens"][: d["index"]] == ar[a["question_id"]][: d["index"]]
            assert d["tokens"] == [ar[a["question_id"]][d["index"]], a["tokens"][d["index"]]]
    md = (tmp_path / "report.md").read_text()
    assert "tinystories/dynamic_tree: greedy identity:" in md and "0 real divergence" in md
    if any(r["near_ties"] for r in rows):
        assert "near-tie: the first differing token" in md


@pytest.mark.slow
def test_a_decoder_that_accepts_wrong_tokens_is_a_real_divergence(
    target_cfg, head_dir, tmp_path, monkeypatch
):
    """Control: a verifier that accepts the first child of every node whatever the target says emits
    tokens the target did not choose: real divergences, flagged as not lossless."""
    import eagle_train.decoding.decoder as decoder

    def accept_first_children(tree, logits):
        path, node = [0], 0
        while tree.children[node]:
            node = tree.children[node][0]
            path.append(node)
        return path, int(logits[node].argmax())

    monkeypatch.setattr(decoder, "accept_greedy", accept_first_children)
    report = bf16_eval(target_cfg, head_dir, tmp_path, ["ar", "chain"], num_questions=2)
    row = next(r for r in report["results"] if r["method"] == "chain")
    assert row["divergences"] == 2 and row["near_ties"] == 0
    assert any(
        "chain: 2 of 2 greedy answers differ from ar other than at a near-tie" in n for n in report["sanity"]
    )


def test_a_flash_attention_target_is_evaluated_with_hf_beside_ar(target_cfg, target, head_dir):
    """With flash_attention_2 the in-harness decoding (ar and the trees) runs sdpa, so HF generate on the
    target's own kernel is added next to ar and the run's attention is stated in the report."""
    from eagle_train.evaluate import attention_meta, evaluated_methods
    from eagle_train.modeling.target import load_target

    cfg = EvaluateConfig(
        target=target_cfg, draft=DraftConfig(path=str(head_dir)), methods=["ar", "dynamic_tree"]
    )
    assert evaluated_methods(cfg, target) == ["ar", "dynamic_tree"] and attention_meta(target) == "sdpa"
    flash = load_target(target_cfg)
    flash.model.config._attn_implementation = "flash_attention_2"  # as loading with it would (no CUDA here)
    assert evaluated_methods(cfg, flash) == ["ar", "dynamic_tree", "hf"]
    assert (
        attention_meta(flash)
        == "sdpa for ar/chain/static_tree/dynamic_tree (the tree mask needs it), flash_attention_2 for hf"
    )


def test_config_from_hydra_and_errors(tmp_path):
    cfg = to_schema(
        compose("evaluate", overrides=["draft.path=/x", "bench=qa", "num_questions=3"]), EvaluateConfig
    )
    assert (
        cfg.bench == ["qa"]
        and cfg.methods == ["ar", "chain", "static_tree", "dynamic_tree"]
        and cfg.decode.temperature == 0
    )
    with pytest.raises(ValueError, match="draft.path"):
        EvaluateConfig(methods=["ar", "dynamic_tree"])
    with pytest.raises(ValueError, match="methods"):
        EvaluateConfig(methods=["ar", "medusa"])
    assert EvaluateConfig(methods=["ar"]).bench == ["mt_bench"]


def test_fit_prompt_keeps_start_and_end():
    assert fit_prompt([1, 2, 3], 5) == ([1, 2, 3], 0)
    assert fit_prompt([1, 2, 3, 4, 5, 6], 4) == ([1, 4, 5, 6], 2)


def scripted_round(parents: list[int], path: list[int], confidence: list[float]) -> Round:
    tree = build_tree(torch.arange(len(parents)), parents)
    tree.confidence = torch.tensor(confidence)
    return Round(tree, path, [0] * len(path), torch.zeros(len(path), 1))


def test_calibration_pairs_use_every_tested_node():
    """A node is tested when its parent was accepted: every depth of a tree, not only depth 1."""
    stats = GenerationStats()
    record_rounds(
        [
            # chain of 3, accepted 1: nodes 1 and 2 tested, node 3 not
            scripted_round([-1, 0, 1, 2], [0, 1], [1.0, 0.9, 0.5, 0.4]),
            # tree: root -> 1, 2; 1 -> 3; 2 -> 4; path 0-1-3: nodes 1, 2, 3 tested (4's parent rejected)
            scripted_round([-1, 0, 0, 1, 2], [0, 1, 3], [1.0, 0.6, 0.3, 0.9, 0.2]),
        ],
        stats,
    )
    assert stats.node_parent_accepted == [True, True, False, True, True, True, False]
    pairs = calibration_pairs(stats)
    assert [ok for _, ok in pairs] == [1, 0, 1, 0, 1]
    assert [c for c, _ in pairs] == pytest.approx([0.9, 0.5, 0.6, 0.3, 0.9])


def test_engine_settings_are_checked(target_cfg):
    cfg = EvaluateConfig(
        target=target_cfg, draft=DraftConfig(path="x"), methods=["dynamic_tree"], engine="vllm"
    )
    assert cfg.methods == [
        "dynamic_tree",
        "ar",
        "chain",
    ]  # the engines are compared on chain against plain decoding
    with pytest.raises(ValueError, match="engine must be one of"):
        EvaluateConfig(target=target_cfg, draft=DraftConfig(path="x"), engine="tgi")
    with pytest.raises(ValueError, match="compares greedy decoding"):
        EvaluateConfig(
            target=target_cfg,
            draft=DraftConfig(path="x"),
            engine="vllm",
            decode=DecodeConfig(temperature=0.7),
        )


def test_records_carry_their_prompt_ids(target_cfg, head_dir, tmp_path):
    """evaluate engine=vllm hands an engine exactly the prompt token ids the built-in decoder answered."""
    cfg = EvaluateConfig(
        target=target_cfg,
        draft=DraftConfig(path=str(head_dir)),
        bench=["tinystories"],
        methods=["ar", "chain"],
        num_questions=1,
        out_dir=str(tmp_path),
        num_threads=1,
        decode=DecodeConfig(max_new_tokens=8),
        progress=False,
        plots=False,
    )
    run(cfg)
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert {len(a["prompt_ids"]) for a in answers} == {answers[0]["prompt_tokens"]}
    assert answers[0]["prompt_ids"] == answers[1]["prompt_ids"] and answers[0]["prompt_ids"][0] == 1


def test_a_head_with_non_finite_weights_is_refused_before_anything_is_written(target, target_cfg, tmp_path):
    """A head with a NaN weight is refused, naming the file and the tensor, before anything is decoded or
    written (no answers.jsonl, no evaluation directory)."""
    head = DraftHead.from_target(target.config)
    state = {k: v.clone() for k, v in head.trainable_state_dict().items()}
    state["fc.weight"][0, 0] = float("nan")
    path = tmp_path / "nan_head"
    path.mkdir()
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**head.config.to_dict(), "eagle_train": {"fc_bias": True}}))
    cfg = EvaluateConfig(
        target=target_cfg, draft=DraftConfig(path=str(path)), bench=["tinystories"], num_questions=1,
        out_dir=str(tmp_path / "eval"), progress=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"model.safetensors: fc.weight holds 1 non-finite values"):
        run(cfg)
    assert not (tmp_path / "eval").exists()


def test_a_head_trained_for_other_weights_is_flagged_in_the_report(target_cfg, target, tmp_path):
    """The head records the fingerprint of its target's embedding and LM head; evaluating it on a
    target with other weights (a fine-tune of the same shape) says so in the report."""
    head = DraftHead.from_target(target.config)
    weights = {"embed_tokens": "0" * 16, "lm_head": "0" * 16}
    path = save_head(head, tmp_path / "head", {"target": {"name": "stories260k", "weights": weights}})
    cfg = EvaluateConfig(
        target=target_cfg, draft=DraftConfig(path=str(path)), bench=["tinystories"], num_questions=1,
        methods=["ar", "chain"], out_dir=str(tmp_path / "eval"), num_threads=1, plots=False, progress=False,
        decode=DecodeConfig(max_new_tokens=8),
    )  # fmt: skip
    report = run(cfg)
    assert any("trained for a target with other weights" in note for note in report["sanity"])
    assert "other weights" in (tmp_path / "eval" / "report.md").read_text()


def test_a_bug_shared_by_ar_and_every_method_is_caught_by_the_model_check(tmp_path, monkeypatch):
    """The failure the ar-vs-speculative comparison cannot see: a decode path that ignores a sliding
    window (as it did before the masks carried it), in ar and chain alike. ar and chain agree with each
    other, and the check against the model's own teacher-forced forward reports real divergences."""
    import dataclasses

    import eagle_train.modeling.target as target_module
    from eagle_train.modeling.attention_layout import AttentionLayout
    from eagle_train.modeling.target import load_target
    from tests.modeling.test_family_decode import save_family

    cfg = save_family("mistral", tmp_path / "mistral")  # 16-token window; prompts run past it
    head_dir = save_head(
        DraftHead.from_target(load_target(cfg).config), tmp_path / "head", {"target": cfg.name}
    )
    monkeypatch.setattr(target_module, "check_decode", lambda target: None)
    monkeypatch.setattr(
        target_module, "attention_layout", lambda config: AttentionLayout({"all": None}, per_layer_type=False)
    )
    report = run(
        EvaluateConfig(
            target=dataclasses.replace(cfg, stop_token_ids=[]),
            draft=DraftConfig(path=str(head_dir)),
            bench=["tinystories"],
            methods=["ar", "chain"],
            num_questions=3,
            out_dir=str(tmp_path / "eval"),
            num_threads=1,
            decode=DecodeConfig(max_new_tokens=24, shape="fixed"),
            plots=False,
            progress=False,
        )
    )
    rows = {r["method"]: r for r in report["results"]}
    assert rows["chain"]["identical"] == 3  # ar and chain share the bug: they agree
    assert rows["ar"]["model_divergences"] == 3 and rows["chain"]["model_divergences"] == 3
    assert any(
        "ar: 3 of 3 greedy answers are not what the model itself chooses" in n for n in report["sanity"]
    )


def test_a_head_trained_for_other_decoder_layers_is_flagged_naming_the_file(target_cfg, target, tmp_path):
    """A head trained for stories260K, evaluated on a fine-tune of its decoder layers alone
    (same embedding and LM head): the report names the weight file that differs."""
    from eagle_train.training.sources import checkpoint_identity

    head = DraftHead.from_target(target.config)
    path = save_head(head, tmp_path / "head", checkpoint_identity(target, target.config))
    model = decoder_fine_tune(tmp_path / "model")
    cfg = EvaluateConfig(
        target=replace(target_cfg, path=str(model)), draft=DraftConfig(path=str(path)), bench=["tinystories"],
        num_questions=1, methods=["ar", "chain"], out_dir=str(tmp_path / "eval"), num_threads=1, plots=False,
        progress=False, decode=DecodeConfig(max_new_tokens=8),
    )  # fmt: skip
    report = run(cfg)
    assert any(
        "weight files that differ: model.safetensors (sha256 recorded" in note for note in report["sanity"]
    ), report["sanity"]


def test_a_dflash_head_is_evaluated_beside_hf_and_ar(target_cfg, target, tmp_path):
    """A DFlash checkpoint through the evaluate stage: every chain answer is ar's and the model's own, tau
    is reported; decode.shape=auto is refused in one line (it does not tune a DFlash chain)."""
    torch.manual_seed(0)
    head = DFlashHead.from_target(target.config, [2], 4, 0, target=target)
    path = save_head(head, tmp_path / "dflash" / "final", {"target": "stories260k"})
    cfg = EvaluateConfig(
        target=target_cfg,
        draft=DraftConfig(path=str(path)),
        bench=["tinystories"],
        methods=["hf", "ar", "chain"],
        num_questions=2,
        out_dir=str(tmp_path / "eval"),
        num_threads=1,
        decode=DecodeConfig(max_new_tokens=24, chain_length=3),
        progress=False,
    )
    rows = {r["method"]: r for r in run(cfg)["results"]}
    assert rows["chain"]["identical"] == rows["hf"]["identical"] == 2 and rows["chain"]["tau"] >= 1.0
    answers = [json.loads(line) for line in (tmp_path / "eval" / "answers.jsonl").read_text().splitlines()]
    assert all(a["model_check"] == {"kind": "identical"} for a in answers)
    auto = replace(cfg, decode=DecodeConfig(max_new_tokens=24, shape="auto"), out_dir=str(tmp_path / "auto"))
    with pytest.raises(InputError, match="decode.shape=auto does not tune a dflash head's chain yet"):
        run(auto)
    # engine=vllm: vLLM drafts from a block of K + 1 slots; below B - 1 the report says why the counters differ
    assert (
        block_notes(head, 3) == []
        and block_notes(head, 9) == []
        and block_notes(DraftHead(target.config), 1) == []
    )
    assert "vLLM drafts from a block of K + 1 = 2 slots" in block_notes(head, 1)[0]
