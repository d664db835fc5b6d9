"""A real vLLM (`parallel_drafting: true`) runs this project's P-EAGLE heads as exported: the head loads,
greedy output is the same with and without speculation, and vLLM's own acceptance counters equal the
built-in P-EAGLE chain decoder's (one draft forward per round, the same placeholders) on the same prompt
token ids for K = 1..8, exactly. The head has 2 layers (vLLM's `layers.1.*` after the fusion layer) and a
256-token draft vocabulary; controls with mask_hidden zeroed, or another mask token named in config.json,
must fail the same check. The head is trained once (reused from runs/engine_tests/ on a rerun) and one
vLLM invocation serves every K. `make test-engines` runs these."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from eagle_train.config.export import ExportConfig
from eagle_train.engines.vllm_engine import agreement_problems, check_agreement, speculative_config
from eagle_train.export import run as export
from eagle_train.report.results import spec_counts
from tests.engines.conftest import HEAD_DIM, fresh_dir, loaded_head, read_json, run_in_vllm, train_once
from tests.engines.test_vllm import builtin_chain, record_figures

pytestmark = pytest.mark.engine

KS = tuple(range(1, 9))
TRAIN_STEPS = 300
HEAD = ["draft.type=peagle", "draft.vocab_size=256", "draft.num_layers=2", "loss.cod.num_depths=8"]
CONTROLS = ("zero_mask_hidden", "other_mask_token")


@pytest.fixture(scope="session")
def peagle_ckpt(engine_python):
    """A small P-EAGLE head trained online on TinyStories conversations (COD over 8 depths); an earlier
    session's finished head is reused."""
    return train_once("head_peagle", TRAIN_STEPS, HEAD)


@pytest.fixture(scope="session")
def peagle_head(peagle_ckpt, target):
    return loaded_head(peagle_ckpt, target)


@pytest.fixture(scope="session")
def peagle_exports(peagle_ckpt) -> dict:
    """format=vllm (route B: an EAGLE-3 directory with pard_token) and format=speculators (route A:
    speculators_model_type peagle) at head_dim 32, and the controls."""
    root = fresh_dir("exports_peagle")
    vllm = export(
        ExportConfig(ckpt=str(peagle_ckpt), format="vllm", out_dir=str(root / "vllm"), head_dim=HEAD_DIM)
    )
    speculators = export(
        ExportConfig(
            ckpt=str(peagle_ckpt), format="speculators", out_dir=str(root / "speculators"), head_dim=HEAD_DIM
        )
    )
    zeroed = shutil.copytree(vllm, root / "zero_mask_hidden")
    state = load_file(str(zeroed / "model.safetensors"))
    state["mask_hidden"].zero_()
    save_file(state, str(zeroed / "model.safetensors"))
    other = shutil.copytree(vllm, root / "other_mask_token")
    config = read_json(other / "config.json")
    config["pard_token"] = config["mask_token_id"] = 5  # a token with its own (unlearned) row
    (other / "config.json").write_text(json.dumps(config))
    return {"vllm": vllm, "speculators": speculators, "zero_mask_hidden": zeroed, "other_mask_token": other}


@pytest.fixture(scope="session")
def peagle_vllm(engine_python, wide_target_dir, wide_target, peagle_exports, prompts):
    runs = {"ar": None, **{f"chain{k}": speculative_config(peagle_exports["vllm"], k) for k in KS}}
    runs["speculators3"] = speculative_config(peagle_exports["speculators"], 3)
    for name in CONTROLS:
        runs[name] = speculative_config(peagle_exports[name], 5)
    return run_in_vllm("vllm_peagle", runs, engine_python, wide_target_dir, wide_target, prompts)


@pytest.fixture(scope="session")
def peagle_builtin(target, peagle_head, prompts) -> dict[int, list[dict]]:
    """The head as training left it (head_dim 8) on the original stories260K: the built-in P-EAGLE chain."""
    return {k: builtin_chain(target, peagle_head, prompts, k) for k in KS}


def test_the_exports_are_given_to_vllm_with_parallel_drafting(peagle_exports, peagle_vllm):
    for name in ("vllm", "speculators"):
        spec = speculative_config(peagle_exports[name], 3)
        assert spec["method"] == "eagle3" and spec["parallel_drafting"] is True
    state = load_file(str(peagle_exports["vllm"] / "model.safetensors"))
    assert {"mask_hidden", "embed_tokens.weight", "layers.1.self_attn.q_proj.weight", "d2t"} <= set(state)
    for k in KS:
        run = peagle_vllm.runs[f"chain{k}"]
        assert run.error is None and run.load_warnings == [], (k, run.error, run.load_warnings)


@pytest.mark.parametrize("k", KS)
def test_vllm_peagle_acceptance_equals_the_builtin_chain(peagle_vllm, peagle_builtin, k):
    check_agreement(peagle_builtin[k], peagle_vllm, f"chain{k}", "ar")  # greedy identity, counts equal
    mine = spec_counts(peagle_builtin[k])
    theirs = spec_counts([{"spec": o["spec"]} for o in peagle_vllm.outputs(f"chain{k}")])
    assert theirs == mine and mine["num_accepted_tokens"] > 0
    if k >= 3:  # a trained head: its placeholders' drafts are accepted too
        assert all(n > 0 for n in mine["accepted_per_pos"][:3]), mine
    record_figures(f"peagle K={k}", mine, theirs)


def test_the_speculators_format_is_the_same_head_to_vllm(peagle_vllm, peagle_builtin):
    check_agreement(peagle_builtin[3], peagle_vllm, "speculators3", "ar")
    record_figures(
        "peagle speculators K=3",
        spec_counts(peagle_builtin[3]),
        spec_counts([{"spec": o["spec"]} for o in peagle_vllm.outputs("speculators3")]),
    )


@pytest.mark.parametrize("control", CONTROLS)
def test_vllm_reads_mask_hidden_and_the_mask_token(peagle_vllm, peagle_builtin, control):
    """mask_hidden zeroed, or config.json naming another mask token, changes vLLM's acceptance: the
    agreement above is evidence that vLLM drafts from the placeholders as exported."""
    problems = agreement_problems(peagle_builtin[5], peagle_vllm, control, "ar")
    assert any("acceptance differs from the built-in chain decoder's" in p for p in problems), problems
    right = spec_counts([{"spec": o["spec"]} for o in peagle_vllm.outputs("chain5")])
    wrong = spec_counts([{"spec": o["spec"]} for o in peagle_vllm.outputs(control)])
    record_figures(f"peagle control {control} K=5", right, wrong, ("as exported", control))
