"""A real vLLM (`method: eagle3`) runs this project's EAGLE-3 heads as exported: the head loads, greedy
output is the same with and without speculation, and vLLM's own acceptance counters equal the built-in
chain decoder's on the same prompt token ids and K, exactly. The head drafts over a reduced vocabulary
(256 of 512 tokens), so vLLM's draft-to-target map (d2t) is exercised; controls with the aux layer ids
or d2t changed must fail the same check. `make test-engines` runs these."""

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
from tests.engines.test_vllm import KS, builtin_chain, record_figures

pytestmark = pytest.mark.engine

TRAIN_STEPS = 200
HEAD = ["draft.type=eagle3", "draft.vocab_size=256", "loss.ttt_steps=3"]


@pytest.fixture(scope="session")
def eagle3_ckpt(engine_python):
    """A small EAGLE-3 head trained online on TinyStories conversations (training-time test of 3 steps,
    256-token draft vocabulary); an earlier session's finished head is reused."""
    return train_once("head_eagle3", TRAIN_STEPS, HEAD)


@pytest.fixture(scope="session")
def eagle3_head(eagle3_ckpt, target):
    return loaded_head(eagle3_ckpt, target)


@pytest.fixture(scope="session")
def eagle3_exports(eagle3_ckpt) -> dict:
    """format=vllm and format=speculators at head_dim 32, and controls: the aux layer ids changed in
    config.json, d2t replaced by the identity."""
    root = fresh_dir("exports_eagle3")
    vllm = export(
        ExportConfig(ckpt=str(eagle3_ckpt), format="vllm", out_dir=str(root / "vllm"), head_dim=HEAD_DIM)
    )
    speculators = export(
        ExportConfig(
            ckpt=str(eagle3_ckpt), format="speculators", out_dir=str(root / "speculators"), head_dim=HEAD_DIM
        )
    )
    layers = shutil.copytree(vllm, root / "other_layers")
    config = read_json(layers / "config.json")
    # three other distinct layers (vLLM collects the aux states per layer id: a repeated id, such as its
    # own default [2, 2, 2] for 5 layers, gives fewer than three and fails its reshape)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 3]
    (layers / "config.json").write_text(json.dumps(config))
    no_map = shutil.copytree(vllm, root / "identity_d2t")
    state = load_file(str(no_map / "model.safetensors"))
    state["d2t"].zero_()  # draft id i -> target id i
    save_file(state, str(no_map / "model.safetensors"))
    return {"vllm": vllm, "speculators": speculators, "other_layers": layers, "identity_d2t": no_map}


@pytest.fixture(scope="session")
def eagle3_vllm(engine_python, wide_target_dir, wide_target, eagle3_exports, prompts):
    runs = {"ar": None, **{f"chain{k}": speculative_config(eagle3_exports["vllm"], k) for k in KS}}
    runs["speculators3"] = speculative_config(eagle3_exports["speculators"], 3)
    for name in ("other_layers", "identity_d2t"):
        runs[name] = speculative_config(eagle3_exports[name], 3)
    return run_in_vllm("vllm_eagle3", runs, engine_python, wide_target_dir, wide_target, prompts)


@pytest.fixture(scope="session")
def eagle3_builtin(target, eagle3_head, prompts) -> dict[int, list[dict]]:
    """The head as training left it (head_dim 8) on the original stories260K."""
    return {k: builtin_chain(target, eagle3_head, prompts, k) for k in KS}


def test_the_exports_are_given_to_vllm_as_eagle3(eagle3_exports, eagle3_vllm):
    for name in ("vllm", "speculators"):
        assert speculative_config(eagle3_exports[name], 3)["method"] == "eagle3"
    assert "d2t" in load_file(str(eagle3_exports["vllm"] / "model.safetensors"))  # a reduced vocabulary
    for k in KS:
        run = eagle3_vllm.runs[f"chain{k}"]
        assert run.error is None and run.load_warnings == [], (k, run.error, run.load_warnings)


@pytest.mark.parametrize("k", KS)
def test_vllm_eagle3_acceptance_equals_the_builtin_chain(eagle3_vllm, eagle3_builtin, k):
    check_agreement(eagle3_builtin[k], eagle3_vllm, f"chain{k}", "ar")  # greedy identity, counts equal
    mine = spec_counts(eagle3_builtin[k])
    theirs = spec_counts([{"spec": o["spec"]} for o in eagle3_vllm.outputs(f"chain{k}")])
    assert theirs == mine and mine["num_accepted_tokens"] > 0
    if k >= 3:  # a trained head: more than the first position is accepted
        assert all(n > 0 for n in mine["accepted_per_pos"][:3]), mine
    record_figures(f"eagle3 K={k}", mine, theirs)


def test_the_speculators_format_is_the_same_head_to_vllm(eagle3_vllm, eagle3_builtin):
    check_agreement(eagle3_builtin[3], eagle3_vllm, "speculators3", "ar")
    record_figures(
        "eagle3 speculators K=3",
        spec_counts(eagle3_builtin[3]),
        spec_counts([{"spec": o["spec"]} for o in eagle3_vllm.outputs("speculators3")]),
    )


@pytest.mark.parametrize("control", ["other_layers", "identity_d2t"])
def test_vllm_reads_the_layer_ids_and_the_vocabulary_map(eagle3_vllm, eagle3_builtin, control):
    """Changing what config.json says about the aux layers, or the d2t map, changes vLLM's acceptance:
    the agreement above is evidence that vLLM reads both as written."""
    problems = agreement_problems(eagle3_builtin[3], eagle3_vllm, control, "ar")
    assert any("acceptance differs from the built-in chain decoder's" in p for p in problems), problems
    right = spec_counts([{"spec": o["spec"]} for o in eagle3_vllm.outputs("chain3")])
    wrong = spec_counts([{"spec": o["spec"]} for o in eagle3_vllm.outputs(control)])
    record_figures(f"eagle3 control {control} K=3", right, wrong, ("as exported", control))
