"""A real vLLM (`method: dflash`) runs this project's DFlash heads as exported: the head loads, greedy
output is the same with and without speculation, and vLLM's acceptance counters equal the built-in DFlash
chain decoder's on the same prompt token ids, exactly, given the same block.

The block is where the two differ by design: vLLM 0.32 drafts from a block of K + 1 slots, the verified token
and K mask tokens (`v1/spec_decode/dflash.py`: `num_query_per_req = 1 + num_speculative_tokens`, the
queries of one bidirectional forward), while the built-in decoder always feeds the B slots the head was
trained on and reads its first K mask slots (docs/dflash.md). Attention inside a block is bidirectional, so
the K drafted slots see the other slots and the drafts depend on the block's length: at K = B - 1 the blocks
are the same and the counters must be equal; at K < B - 1 they must equal the built-in decoder's given a
block of K + 1 (the same head, `block_size` K + 1), and the full block's figure is recorded beside it.

The head has ONE layer: vLLM 0.32's CPU path normalises the context keys of all layers with layer 0's
k_norm (`_normalize_context_k`, /work/shared/EAGLE.md "DFlash"), which a one-layer head does not meet. It
is trained once (reused from runs/engine_tests/ on a rerun), exported at head_dim 32 in both layouts, and
one vLLM invocation serves every run; a control whose config.json names another target layer must fail the
same check. `make test-engines` runs these."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from eagle_train.config.export import ExportConfig
from eagle_train.engines.vllm_engine import agreement_problems, check_agreement, speculative_config
from eagle_train.export import run as export
from eagle_train.modeling.dflash import DFlashHead
from eagle_train.report.results import spec_counts
from tests.engines.conftest import (
    HEAD_DIM,
    TRAIN_STEPS,
    fresh_dir,
    loaded_head,
    read_json,
    run_in_vllm,
    train_once,
)
from tests.engines.test_vllm import builtin_chain, record_figures

pytestmark = pytest.mark.engine

BLOCK = 8
KS = (3, BLOCK - 1)  # a shorter chain than the block, and the whole block
HEAD = ["draft.type=dflash", f"draft.block_size={BLOCK}", "draft.target_layer_ids=[2]"]


@pytest.fixture(scope="session")
def dflash_ckpt(engine_python):
    """A one-layer DFlash head (blocks of 8, reading the output of target layer 2) trained online on
    TinyStories conversations; an earlier session's finished head is reused."""
    return train_once("head_dflash", TRAIN_STEPS, HEAD)


@pytest.fixture(scope="session")
def dflash_head(dflash_ckpt, target):
    return loaded_head(dflash_ckpt, target)


@pytest.fixture(scope="session")
def dflash_exports(dflash_ckpt) -> dict:
    """format=vllm (`DFlashDraftModel`) and format=speculators (`speculators_model_type: dflash`) at
    head_dim 32, and the control."""
    root = fresh_dir("exports_dflash")
    exports = {
        fmt: export(
            ExportConfig(ckpt=str(dflash_ckpt), format=fmt, out_dir=str(root / fmt), head_dim=HEAD_DIM)
        )
        for fmt in ("vllm", "speculators")
    }
    other = shutil.copytree(exports["vllm"], root / "other_layer")  # the control: reads layer 1's output
    config = read_json(other / "config.json")
    config["dflash_config"]["target_layer_ids"] = [1]
    (other / "config.json").write_text(json.dumps(config))
    return {**exports, "other_layer": other}


@pytest.fixture(scope="session")
def dflash_vllm(engine_python, wide_target_dir, wide_target, dflash_exports, prompts):
    runs = {"ar": None, **{f"chain{k}": speculative_config(dflash_exports["vllm"], k) for k in KS}}
    runs[f"speculators{BLOCK - 1}"] = speculative_config(dflash_exports["speculators"], BLOCK - 1)
    runs["other_layer"] = speculative_config(dflash_exports["other_layer"], BLOCK - 1)
    return run_in_vllm("vllm_dflash", runs, engine_python, wide_target_dir, wide_target, prompts)


def with_block(head: DFlashHead, block_size: int, target) -> DFlashHead:
    """The same head drafting from blocks of `block_size` slots (the anchor and block_size - 1 masks)."""
    short = DFlashHead(
        head.config, head.target_layer_ids, block_size, head.mask_token_id, head.target_hidden_size, target
    )
    short.load_state_dict(head.trainable_state_dict(), strict=False)
    return short.eval()


@pytest.fixture(scope="session")
def dflash_builtin(target, dflash_head, prompts) -> dict[str, list[dict]]:
    """The head as training left it (head_dim 8) on the original stories260K: the built-in DFlash chain with
    the trained block (`block{B}`) and with vLLM's block of K + 1 (`block{K + 1}`)."""
    runs = {f"k{k}_block{BLOCK}": builtin_chain(target, dflash_head, prompts, k) for k in KS}
    for k in KS:
        runs[f"k{k}_block{k + 1}"] = builtin_chain(target, with_block(dflash_head, k + 1, target), prompts, k)
    return runs


def vllm_counts(engine, run: str) -> dict:
    return spec_counts([{"spec": o["spec"]} for o in engine.outputs(run)])


def test_the_exports_are_given_to_vllm_as_dflash(dflash_exports, dflash_vllm):
    for fmt in ("vllm", "speculators"):
        spec = speculative_config(
            dflash_exports[fmt], 12
        )  # more than the block holds: cut to its B - 1 mask slots
        assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == BLOCK - 1, fmt
    config = read_json(dflash_exports["vllm"] / "config.json")
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"][
        "target_layer_ids"
    ] == [2]
    assert read_json(dflash_exports["speculators"] / "config.json")["aux_hidden_state_layer_ids"] == [3]
    state = load_file(str(dflash_exports["vllm"] / "model.safetensors"))
    assert "fc.weight" in state and "layers.0.self_attn.k_norm.weight" in state
    assert not any(k.startswith(("model.", "embed_tokens", "lm_head", "mask_hidden")) for k in state)
    for name, run in dflash_vllm.runs.items():
        assert run.error is None and run.load_warnings == [], (name, run.error, run.load_warnings)


@pytest.mark.parametrize("k", KS)
def test_vllm_dflash_acceptance_equals_the_builtin_chain_on_the_same_block(dflash_vllm, dflash_builtin, k):
    """Greedy identity with and without speculation, and the counters equal the built-in decoder's given
    vLLM's block of K + 1 slots (at K = B - 1: the trained block itself)."""
    same_block = dflash_builtin[f"k{k}_block{k + 1}"]
    check_agreement(same_block, dflash_vllm, f"chain{k}", "ar")
    mine, theirs = spec_counts(same_block), vllm_counts(dflash_vllm, f"chain{k}")
    assert theirs == mine and mine["accepted_per_pos"][0] > 0, mine
    record_figures(f"dflash K={k} block {k + 1}", mine, theirs)
    if k < BLOCK - 1:  # the built-in decoder's own figure (the trained block of B): recorded, not equal
        record_figures(
            f"dflash K={k} built-in block {BLOCK} vs vLLM block {k + 1}",
            spec_counts(dflash_builtin[f"k{k}_block{BLOCK}"]),
            theirs,
        )


def test_the_speculators_format_is_the_same_head_to_vllm(dflash_vllm, dflash_builtin):
    k = BLOCK - 1
    check_agreement(dflash_builtin[f"k{k}_block{BLOCK}"], dflash_vllm, f"speculators{k}", "ar")
    record_figures(
        f"dflash speculators K={k}",
        spec_counts(dflash_builtin[f"k{k}_block{BLOCK}"]),
        vllm_counts(dflash_vllm, f"speculators{k}"),
    )


def test_vllm_reads_the_layer_ids_as_exported(dflash_vllm, dflash_builtin):
    """config.json naming another target layer changes vLLM's acceptance: the agreement above is evidence
    that vLLM reads `dflash_config.target_layer_ids` in the convention the export writes."""
    k = BLOCK - 1
    problems = agreement_problems(dflash_builtin[f"k{k}_block{BLOCK}"], dflash_vllm, "other_layer", "ar")
    assert any("acceptance differs from the built-in chain decoder's" in p for p in problems), problems
    record_figures(
        f"dflash control other_layer K={k}",
        vllm_counts(dflash_vllm, f"chain{k}"),
        vllm_counts(dflash_vllm, "other_layer"),
        ("as exported", "other_layer"),
    )
