"""The serving sweep's own logic without vLLM: server processes started and always stopped (real processes
standing in for `vllm serve`), the commands vLLM gets, the request file, the answers' comparison, the
report section, the config keys. (The real engine: tests/engines/test_vllm_serving.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagle_train.config.decode import DecodeConfig
from eagle_train.config.draft import DraftConfig
from eagle_train.config.evaluate import EvaluateConfig
from eagle_train.engines.vllm_engine import EngineError
from eagle_train.engines.vllm_server import (
    CLI,
    bench_command,
    free_port,
    is_healthy,
    serve_command,
    stop_server,
    vllm_server,
)
from eagle_train.engines.vllm_sweep import (
    fits_vllm_loader,
    prompt_text,
    serving_prompts,
    serving_sweep,
    text_classifier,
    write_requests,
)
from eagle_train.report.serving_section import FIELDS, HEAD, PLAIN, compare_answers, serving_section

# a stand-in for `vllm serve`: answers /health on the port it is given, starts a child (as vLLM starts its
# engine core) and writes both pids; `ignore-term` makes it ignore SIGTERM
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, signal, subprocess, sys
    port, pids, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(pids, "w").write(f"{child.pid}")
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not count)."""
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


def fake_server(tmp_path: Path, port: int, mode: str = "plain") -> list[str]:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    return [sys.executable, str(script), str(port), str(tmp_path / "pids"), mode]


def gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


@pytest.mark.parametrize("raised", [RuntimeError("the benchmark failed"), KeyboardInterrupt()])
def test_the_server_is_stopped_whatever_happens_inside(tmp_path, raised):
    """An error or Ctrl-C inside the block: the server and the process it started are stopped, the log kept."""
    port = free_port()
    log = tmp_path / "vllm_serve_head.log"
    with pytest.raises(type(raised)):
        with vllm_server(fake_server(tmp_path, port), port, log, ready_timeout_s=60) as url:
            assert url == f"http://127.0.0.1:{port}" and is_healthy(url)
            child = int((tmp_path / "pids").read_text())
            raise raised
    assert not is_healthy(f"http://127.0.0.1:{port}", timeout_s=2)
    assert gone(child), "the server's child outlived it"
    assert log.read_text().startswith(f"$ {sys.executable}") and "serving" in log.read_text()


def test_a_server_that_ignores_sigterm_is_killed(tmp_path):
    port = free_port()
    process = subprocess.Popen(fake_server(tmp_path, port, "ignore-term"), start_new_session=True)
    deadline = time.monotonic() + 60
    while not is_healthy(f"http://127.0.0.1:{port}") and time.monotonic() < deadline:
        time.sleep(0.2)
    child = int((tmp_path / "pids").read_text())
    start = time.monotonic()
    stop_server(process, grace_s=1)
    assert process.returncode == -signal.SIGKILL and time.monotonic() - start < 10
    assert gone(child)


def test_a_server_that_exits_names_its_log_and_its_last_lines(tmp_path):
    crash = (
        "import sys; print('loading the model', flush=True); print('ValueError: no such model'); sys.exit(3)"
    )
    log = tmp_path / "vllm_serve_plain.log"
    with pytest.raises(EngineError) as raised:
        with vllm_server([sys.executable, "-c", crash], free_port(), log, ready_timeout_s=60):
            pass
    message = str(raised.value)
    assert message.startswith("vllm serve exited with code 3 before it was ready: ValueError: no such model")
    assert f"log: {log}\n--- the last lines of vllm_serve_plain.log ---\n" in message
    assert message.endswith("loading the model\nValueError: no such model")


def test_a_server_that_never_gets_ready_is_stopped(tmp_path):
    pid_file = tmp_path / "pid"
    sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    with pytest.raises(EngineError, match=r"vllm serve was not ready after 3 s: .*log: "):
        with vllm_server([sys.executable, "-c", sleeper], free_port(), tmp_path / "x.log", ready_timeout_s=3):
            pass
    assert not pid_file.is_file() or gone(int(pid_file.read_text()))  # (killed before it wrote its pid)


def bench_flags(dataset: Path, result: Path, tokenizer: str) -> list[str]:
    """The benchmark command of the head server at concurrency 4 (8 requests of at most 64 tokens)."""
    return bench_command(
        "/py",
        "http://127.0.0.1:8123/",
        dataset,
        result,
        tokenizer=tokenizer,
        num_prompts=8,
        concurrency=4,
        max_tokens=64,
        stop_token_ids=[2],
        warmups=4,
        label="head",
    )


def test_the_commands_vllm_gets():
    spec = {"method": "eagle", "model": "/heads/h", "num_speculative_tokens": 3, "parallel_drafting": True}
    serve = serve_command(
        "/py",
        "/models/t",
        8123,
        dtype="float32",
        max_model_len=512,
        speculative=spec,
        extra_args=["--enforce-eager"],
    )
    assert serve[:4] == ["/py", str(CLI), "serve", "/models/t"]
    assert serve[serve.index("--speculative-config") + 1] == json.dumps(spec)  # as given: P-EAGLE slots in
    assert serve[-1] == "--enforce-eager" and "--no-enable-prefix-caching" in serve
    plain = serve_command("/py", "/models/t", 8123, dtype="auto", max_model_len=512)
    assert "--speculative-config" not in plain and plain[plain.index("--port") + 1] == "8123"
    bench = bench_flags(Path("/w/requests.json"), Path("/w/serving/head-c4.json"), "/models/t")
    assert bench[:4] == ["/py", str(CLI), "bench", "serve"]
    flags = dict(zip(bench, bench[1:], strict=False))  # each flag -> the word after it
    assert flags["--base-url"] == "http://127.0.0.1:8123" and flags["--max-concurrency"] == "4"
    assert flags["--dataset-name"] == "sharegpt" and flags["--num-prompts"] == "8"
    assert flags["--temperature"] == "0" and json.loads(flags["--extra-body"]) == {"stop_token_ids": [2]}
    # what vLLM's own sweep passes to every run, and the detailed answers for the identity check
    assert flags["--percentile-metrics"] == "ttft,tpot,itl,e2el" and "99" in flags["--metric-percentiles"]
    assert flags["--result-dir"] == "/w/serving" and flags["--result-filename"] == "head-c4.json"
    assert {"--save-result", "--save-detailed", "--disable-shuffle", "--no-oversample"} <= set(bench)


def test_paths_reach_vllm_absolute(tmp_path, monkeypatch):
    """vLLM runs in the output directory: a relative out_dir, target or dataset still points at the file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    serve = serve_command("/py", "model", 1, dtype="auto", max_model_len=8)
    assert serve[3] == str(tmp_path / "model")
    assert serve_command("/py", "org/hub-id", 1, dtype="auto", max_model_len=8)[3] == "org/hub-id"
    bench = bench_flags(Path("out/serving/requests.json"), Path("out/serving/plain-c1.json"), "model")
    flags = dict(zip(bench, bench[1:], strict=False))
    assert flags["--dataset-path"] == str(tmp_path / "out/serving/requests.json")
    assert flags["--result-dir"] == str(tmp_path / "out/serving") and flags["--tokenizer"] == str(
        tmp_path / "model"
    )


def test_requests_repeat_the_prompts_in_order(tmp_path):
    path = tmp_path / "requests.json"
    assert write_requests(["a", "b", "c"], 7, path) == ["a", "b", "c", "a", "b", "c", "a"]
    records = json.loads(path.read_text())
    assert [r["conversations"][0]["value"] for r in records] == ["a", "b", "c", "a", "b", "c", "a"]
    assert all(len(r["conversations"]) == 2 for r in records)  # vLLM's loader skips single turns
    with pytest.raises(ValueError, match="no prompt"):
        write_requests([], 3, path)
    assert fits_vllm_loader(4, 2044) and not fits_vllm_loader(3, 10)
    assert not fits_vllm_loader(1025, 1) and not fits_vllm_loader(1000, 1049)


def test_prompts_go_as_text_that_tokenizes_back(target):
    """The evaluation's first-turn prompt ids as text a server tokenizes back to the same ids (BOS added by
    the tokenizer, not written)."""
    ids = target.tokenizer("Once upon a time, there was a little dog named Max.").input_ids
    assert ids[0] == target.tokenizer.bos_token_id
    text = prompt_text(target.tokenizer, ids)
    assert not text.startswith("<s>") and target.tokenizer(text).input_ids == ids
    records = [
        {"method": "ar", "turn": 0, "prompt_ids": ids},
        {"method": "chain", "turn": 0, "prompt_ids": ids},
        {"method": "ar", "turn": 1, "prompt_ids": ids + ids},
        {"method": "ar", "turn": 0, "prompt_ids": ids[:3]},  # 3 tokens: vLLM's loader would drop it
    ]
    texts, notes = serving_prompts(records, target.tokenizer, 64)
    assert texts == [text] and len(notes) == 1 and "1 prompts left out" in notes[0]


def greedy(target, ids: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(target.next_logits(ids + out).argmax()))
    return out


def test_a_differing_answer_is_placed_on_the_retokenized_text(target):
    from eagle_train.evaluate import divergence_classifier

    tokenizer = target.tokenizer
    prompt = "Once upon a time, there was a little girl."
    answer = greedy(target, tokenizer(prompt).input_ids, 12)
    # the answer as a server streams it: decoded in the prompt's context
    reference = tokenizer.decode(tokenizer(prompt).input_ids + answer, skip_special_tokens=True)[
        len(prompt) :
    ]
    assert tokenizer(prompt + reference).input_ids == tokenizer(prompt).input_ids + answer
    word = tokenizer.decode(answer[:5])
    changed = reference.replace(word, word + " elephant", 1)  # a token the target did not choose
    classify = text_classifier(tokenizer, divergence_classifier(target, 4))
    found = classify(prompt, reference, changed)
    assert found["kind"] == "divergence" and found["index"] == 5
    assert classify(prompt, reference, reference) is None


def vllm_result(throughput: float, texts: list[str], spec: bool = False, failed: int = 0) -> dict:
    """A result dict with the fields `vllm bench serve --save-result --save-detailed` writes."""
    result = {field: float(i + 1) for i, field in enumerate(FIELDS)}
    result.update(
        output_throughput=throughput,
        completed=len(texts) - failed,
        failed=failed,
        generated_texts=texts,
        errors=["" for _ in texts[failed:]] + ["timeout"] * failed,
    )
    if spec:
        result.update(
            spec_decode_acceptance_length=2.5,
            spec_decode_acceptance_rate=50.0,
            spec_decode_num_drafts=10,
            spec_decode_draft_tokens=30,
            spec_decode_accepted_tokens=15,
            spec_decode_per_position_acceptance_rates=[0.8, 0.5, 0.2],
        )
    return result


def test_compare_answers_counts_as_the_identity_contract():
    plain = vllm_result(1.0, ["a", "b", "c", "d"])
    head = vllm_result(1.0, ["a", "x", "y", "d"])
    head["errors"][3] = "timeout"  # a failed request has no answer to compare
    seen = []

    def classify(prompt, reference, text):
        seen.append((prompt, reference, text))
        return {"index": 0, "kind": "near_tie" if text == "x" else "divergence"}

    found = compare_answers(["p0", "p1", "p2", "p3"], plain, head, classify)
    assert seen == [("p1", "b", "x"), ("p2", "c", "y")]
    assert {k: found[k] for k in ("compared", "identical", "near_tie", "divergence")} == {
        "compared": 3,
        "identical": 1,
        "near_tie": 1,
        "divergence": 1,
    }
    assert compare_answers(["p"] * 4, plain, plain)["identical"] == 4


def test_the_serving_section(tmp_path):
    texts = ["a", "b", "c", "d"]
    results = {
        1: {
            PLAIN: vllm_result(100.0, texts),
            HEAD: vllm_result(180.0, texts, spec=True),
            "ngram": vllm_result(120.0, texts, spec=True),
        },
        16: {
            PLAIN: vllm_result(900.0, texts),
            HEAD: vllm_result(720.0, texts, spec=True, failed=1),
            "ngram": vllm_result(990.0, ["a", "b", "c", "z"], spec=True),
        },
    }
    identity = {
        c: {name: compare_answers(texts, by[PLAIN], by[name]) for name in (HEAD, "ngram")}
        for c, by in results.items()
    }
    identity[16][HEAD] = {**identity[1][HEAD], "identical": 3, "divergence": 1}
    section = serving_section(results, identity, {"servers": "started here"}, tmp_path)
    one, sixteen = section["rows"]
    assert one["speedup"] == pytest.approx(1.8) and sixteen["speedup"] == pytest.approx(0.8)
    assert one[HEAD]["mean_tpot_ms"] == results[1][HEAD]["mean_tpot_ms"]
    assert one["acceptance_length"] == 2.5 and one["per_position_acceptance_rates"] == [0.8, 0.5, 0.2]
    assert sixteen["requests"] == 4
    notes = section["sanity"]
    assert any("concurrency 16: the server with the head is SLOWER" in n and "0.80x" in n for n in notes)
    assert any("concurrency 16: failed requests {'head': 1}" in n for n in notes)
    assert any("concurrency 16: only 4 requests" in n for n in notes)
    assert any("concurrency 16: 1 of 4 greedy answers" in n for n in notes)
    assert not any("concurrency 1:" in n for n in notes)
    assert (
        "| 1 | 4 | 100.0 | 180.0 | 1.80x |" in section["markdown"] and "2.500 (50.0%)" in section["markdown"]
    )
    assert "- servers: started here" in section["markdown"]
    assert section["plots"] == [tmp_path / "serving_speedup.png"] and section["plots"][0].is_file()
    # vLLM's own ngram beside the head: its figures, its speedup over plain, its answers against plain's
    ngram = sixteen["baselines"]["ngram"]
    assert ngram["speedup"] == pytest.approx(1.1) and ngram["output_throughput"] == 990.0
    assert ngram["identity"]["identical"] == 3 and ngram["identity"]["unclassified"] == 1
    assert one["baselines"]["ngram"]["identity"]["identical"] == 4
    assert (
        "| 1 | ngram | 120.0 | 1.20x |" in section["markdown"]
        and "| 16 | head | 720.0 | 0.80x |" in section["markdown"]
    )
    assert any("concurrency 16: vLLM's own ngram (1.10x) is faster than the head (0.80x)" in n for n in notes)
    assert any("concurrency 16: 1 of 4 greedy answers with vLLM's ngram differ" in n for n in notes)
    assert not any("concurrency 1: vLLM's own" in n for n in notes)


def cfg(**kw) -> EvaluateConfig:
    return EvaluateConfig(
        draft=DraftConfig(path="head"), decode=DecodeConfig(temperature=0.0), engine="vllm", **kw
    )


def test_the_sweep_keys():
    assert cfg(engine_concurrency=[16, 1, 4]).engine_concurrency == [1, 4, 16]
    assert cfg(engine_concurrency=[1], engine_baselines=["ngram", "suffix"]).engine_baselines == [
        "ngram",
        "suffix",
    ]
    assert cfg(engine_url="http://h", engine_plain_url="http://p", engine_concurrency=[1]).engine_plain_url
    assert cfg(engine_url="http://h").engine_concurrency == []  # the one-request check, as before
    for bad, message in (
        (dict(engine_concurrency=[0, 4]), "distinct levels >= 1"),
        (dict(engine_concurrency=[4, 4]), "distinct levels >= 1"),
        (dict(engine_url="http://h", engine_concurrency=[1]), "set engine_plain_url beside engine_url"),
        (dict(engine_plain_url="http://p"), "needs engine_url"),
        (dict(engine_concurrency=[1], engine_num_prompts=0), "engine_num_prompts must be >= 1"),
        (dict(engine_concurrency=[1], engine_baselines=["medusa"]), "distinct names of"),
        (dict(engine_concurrency=[1], engine_baselines=["ngram", "ngram"]), "distinct names of"),
        (dict(engine_baselines=["ngram"]), "set engine_concurrency"),
        (
            dict(
                engine_url="http://h",
                engine_plain_url="http://p",
                engine_concurrency=[1],
                engine_baselines=["ngram"],
            ),
            "no engine_url",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            cfg(**bad)
    with pytest.raises(ValueError, match="set engine=vllm"):
        EvaluateConfig(draft=DraftConfig(path="head"), engine_concurrency=[1])


def test_no_prompt_vllm_would_take_is_an_error_before_any_server(target, tmp_path):
    ids = target.tokenizer("Hi").input_ids  # 2 tokens: vLLM's loader needs 4
    records = [{"method": "ar", "turn": 0, "prompt_ids": ids}]
    with pytest.raises(EngineError, match=r"no prompt left for vLLM's serving benchmark: serving: 1 prompts"):
        serving_sweep(cfg(engine_concurrency=[1]), target, tmp_path / "head", records, tmp_path)
    assert not (tmp_path / "serving").exists()
