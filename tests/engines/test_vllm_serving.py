"""What a head is worth under load, in a real vLLM: `evaluate engine=vllm engine_concurrency=[1,4]` starts
`vllm serve` for the head_dim-32 stories260K without and with the trained head, runs vLLM's own serving
benchmark at both levels, and every figure of the report must be the one vLLM wrote in its own result files.
`make test-engines` runs these."""

from __future__ import annotations

import json
import re
import time

import pytest

from eagle_train.config.decode import DecodeConfig
from eagle_train.engines.vllm_engine import EngineError
from eagle_train.engines.vllm_server import is_healthy
from eagle_train.evaluate import run as evaluate
from eagle_train.report.serving_section import FIELDS, HEAD, PLAIN, SERVERS, SPEC_FIELDS
from tests.engines.conftest import HEAD_DIM, fresh_dir, read_json
from tests.engines.test_vllm import record_message

pytestmark = pytest.mark.engine

LEVELS = [1, 4]
QUESTIONS = 4
REQUESTS = 8  # the 4 prompts twice: two waves at concurrency 4


@pytest.fixture(scope="module")
def sweep(engine_eval_config):
    """One evaluation with the serving sweep; (report, out_dir, seconds)."""
    out = fresh_dir("serving")
    cfg = engine_eval_config(
        out,
        num_questions=QUESTIONS,
        engine_concurrency=LEVELS,
        engine_num_prompts=REQUESTS,
        engine_serve_args=["--enforce-eager"],  # no inductor compile on this CPU
        engine_baselines=["ngram"],  # vLLM's own prompt lookup beside the head
    )
    start = time.perf_counter()
    report = evaluate(cfg)
    return report, out, time.perf_counter() - start


def test_every_figure_is_vllms_own(sweep):
    """Each level's figures equal those in vLLM's `--save-result` files; speedup = their ratio; the
    acceptance is the head server's counters (absent from the plain server's file)."""
    report, out, seconds = sweep
    levels = report["serving"]["levels"]
    assert [row["concurrency"] for row in levels] == LEVELS
    for row in levels:
        c = row["concurrency"]
        files = {name: read_json(out / "serving" / f"{name}-c{c}.json") for name in SERVERS}
        for name in SERVERS:
            assert files[name]["max_concurrency"] == c and files[name]["label"] == name
            assert files[name]["completed"] == REQUESTS and files[name]["failed"] == 0
            assert row[name] == {field: files[name][field] for field in FIELDS}
        assert row["requests"] == REQUESTS
        assert row["speedup"] == files[HEAD]["output_throughput"] / files[PLAIN]["output_throughput"]
        for field in SPEC_FIELDS:
            assert row[field.removeprefix("spec_decode_")] == files[HEAD][field]
            assert field not in files[PLAIN]
        assert row["acceptance_length"] > 1 and len(row["per_position_acceptance_rates"]) == 3
        ngram = read_json(out / "serving" / f"ngram-c{c}.json")
        assert ngram["completed"] == REQUESTS and ngram["label"] == "ngram"
        baseline = row["baselines"]["ngram"]
        assert {field: baseline[field] for field in FIELDS} == {field: ngram[field] for field in FIELDS}
        assert baseline["speedup"] == ngram["output_throughput"] / files[PLAIN]["output_throughput"]
        assert baseline["num_drafts"] == ngram.get("spec_decode_num_drafts")
        assert baseline["identity"]["divergence"] == baseline["identity"]["unclassified"] == 0
    record_message(
        "serving sweep (engine test)",
        f"{seconds:.0f} s; "
        + "; ".join(
            f"c={r['concurrency']}: {r['speedup']:.2f}x, acceptance length {r['acceptance_length']:.4f}"
            for r in levels
        ),
    )


def test_the_servers_acceptance_is_the_built_in_decoders(sweep):
    """The requests are the evaluation's prompts (each twice): the head server's acceptance length equals
    the built-in chain decoder's tau on them, exactly as in the one-request engine check."""
    report, _, _ = sweep
    builtin = next(r for r in report["engines"] if r["engine"] == "builtin")
    for row in report["serving"]["levels"]:
        assert row["num_drafts"] == 2 * builtin["counts"]["num_drafts"], row["concurrency"]
        assert row["accepted_tokens"] == 2 * builtin["counts"]["num_accepted_tokens"]
        assert row["acceptance_length"] == pytest.approx(builtin["tau"], rel=1e-12)


def test_greedy_answers_agree_and_the_report_shows_the_table(sweep):
    report, out, _ = sweep
    single = read_json(out / "serving" / "plain-c1.json"), read_json(out / "serving" / "head-c1.json")
    assert single[0]["generated_texts"] == single[1]["generated_texts"]
    for row in report["serving"]["levels"]:
        identity = row["identity"]
        assert identity["compared"] == REQUESTS and identity["divergence"] == identity["unclassified"] == 0
        assert identity["identical"] + identity["near_tie"] == REQUESTS
    assert report["serving"]["levels"][0]["identity"]["identical"] == REQUESTS  # concurrency 1: identical
    text = (out / "report.md").read_text()
    assert "## Serving under load" in text and "| concurrency | requests | output tok/s plain |" in text
    assert re.search(r"\| 4 \| 8 \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", text)
    assert "| 1 | ngram |" in text and "vLLM's own speculation beside the head" in text
    assert "![serving_speedup](serving_speedup.png)" in text and (out / "serving_speedup.png").is_file()
    requests = json.loads((out / "serving" / "requests.json").read_text())
    assert len(requests) == REQUESTS and requests[0] == {**requests[QUESTIONS], "id": "0"}


def test_the_servers_were_stopped_and_their_logs_kept(sweep):
    _, out, _ = sweep
    for name in (*SERVERS, "ngram"):
        log = out / f"vllm_serve_{name}.log"
        first = log.read_text().splitlines()[0]
        port = re.search(r"--port (\d+)", first).group(1)
        assert ("--speculative-config" in first) == (name != PLAIN)
        assert ('"method": "ngram"' in first) == (name == "ngram")
        assert not is_healthy(f"http://127.0.0.1:{port}", timeout_s=2), f"{name} server still answers"


def test_a_server_that_cannot_start_stops_the_evaluation_naming_its_log(engine_eval_config):
    """vLLM refuses the plain server's flags: evaluate raises vLLM's own reason, the log's path and its last
    lines, after writing the report of what it finished (its sanity section says the sweep failed)."""
    out = fresh_dir("serving_refused")
    cfg = engine_eval_config(
        out,
        num_questions=2,
        decode=DecodeConfig(chain_length=3, max_new_tokens=16),
        engine_concurrency=[1],
        engine_serve_args=["--enforce-eager", "--max-model-len", "100000"],  # beyond the target's 512
    )
    log = out / "vllm_serve_plain.log"
    with pytest.raises(EngineError) as raised:
        evaluate(cfg)
    message = str(raised.value)
    assert message.startswith("vllm serve exited with code 1 before it was ready: ")
    assert "User-specified max_model_len (100000)" in message.splitlines()[0]
    assert f"log: {log}\n--- the last lines of vllm_serve_plain.log ---\n" in message
    assert "WARNING: the serving sweep failed: vllm serve exited" in (out / "report.md").read_text()
    assert not (out / "vllm_serve_head.log").exists()  # the sweep stopped at the first server
    port = re.search(r"--port (\d+)", log.read_text().splitlines()[0]).group(1)
    assert not is_healthy(f"http://127.0.0.1:{port}", timeout_s=2)
    record_message("a refused vllm serve", message.splitlines()[0])


def test_running_servers_are_used_as_they_are(
    engine_eval_config, engine_python, wide_target_dir, trained_ckpt
):
    """engine_url + engine_plain_url: no server is started, the levels interleave (plain, head, plain, head).
    One vLLM at a time on this machine, so the same server with the head stands for both: its answers
    and its acceptance are then the same in both result files."""
    from eagle_train.config.export import ExportConfig
    from eagle_train.engines.vllm_engine import speculative_config
    from eagle_train.engines.vllm_server import free_port, serve_command, vllm_server
    from eagle_train.export import run as export

    out = fresh_dir("serving_urls")
    head = export(
        ExportConfig(ckpt=str(trained_ckpt), format="vllm", out_dir=str(out / "head"), head_dim=HEAD_DIM)
    )
    port = free_port()
    cmd = serve_command(
        engine_python,
        wide_target_dir,
        port,
        dtype="float32",
        max_model_len=512,
        speculative=speculative_config(head, 3),
        extra_args=["--enforce-eager"],
    )
    with vllm_server(cmd, port, out / "server.log") as url:
        cfg = engine_eval_config(
            out / "eval",
            engine_url=url,
            engine_plain_url=url,
            engine_concurrency=[1, 2],
            engine_num_prompts=QUESTIONS,
        )
        report = evaluate(cfg)
    serving = out / "eval" / "serving"
    order = sorted(serving.glob("*-c*.json"), key=lambda p: p.stat().st_mtime)
    assert [p.name for p in order] == ["plain-c1.json", "head-c1.json", "plain-c2.json", "head-c2.json"]
    assert not list((out / "eval").glob("vllm_serve_*.log"))
    assert report["serving"]["setup"]["servers"] == f"running: plain {url}, head {url} (levels interleaved)"
    for row in report["serving"]["levels"]:
        files = {name: read_json(serving / f"{name}-c{row['concurrency']}.json") for name in SERVERS}
        assert files[PLAIN]["generated_texts"] == files[HEAD]["generated_texts"]
        assert row["identity"]["identical"] == QUESTIONS and row["acceptance_length"] > 1
        assert files[PLAIN]["spec_decode_num_drafts"] == files[HEAD]["spec_decode_num_drafts"]
