"""A `vllm serve` that this package starts and stops, and vLLM's own serving benchmark run against a server.

The server runs from vLLM's environment (`engine_python`: `.venv-vllm`) on a free port of 127.0.0.1, its
output kept in a log file; `vllm_server` yields its base URL once /health answers and always stops it
(SIGTERM to its process group, SIGKILL after a grace period), on an error or Ctrl-C too. A server that
exits or never gets ready is an EngineError naming its log and quoting the log's last lines.

`run_serving_benchmark` runs vLLM's `vllm bench serve` (through vllm_cli.py: the `vllm` command) on a ShareGPT-format prompt file and returns the result JSON vLLM itself writes with
`--save-result --save-detailed`: the figures in the report are read from that file, never recomputed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eagle_train.engines.vllm_engine import EngineError, engine_python, failure_reason, log_tail

CLI = Path(__file__).with_name("vllm_cli.py")  # the `vllm` command, run in vLLM's environment
# the flags vLLM's own sweep (`vllm bench sweep serve`) adds to every benchmark run, plus the median
PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
PERCENTILES = "50,99"
STOP_GRACE_S = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env() -> dict[str, str]:
    """The environment of a vLLM subprocess: nothing from a hub, none of this package's PYTHONPATH, a small
    KV cache on a CPU unless the caller set one (vLLM ignores it on a GPU)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("PYTHONPATH", None)
    return env


def absolute(path: str | Path) -> str:
    """A local path made absolute (vLLM runs in another directory); anything else (a hub id) as given."""
    return str(Path(path).resolve()) if Path(path).exists() else str(path)


def serve_command(
    python: str | Path,
    model: str | Path,
    port: int,
    *,
    dtype: str,
    max_model_len: int,
    speculative: dict[str, Any] | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """`vllm serve MODEL` (through vllm_cli.py) on 127.0.0.1:`port`, prefix caching off so that a prompt
    asked again costs its full prefill; `speculative`: vLLM's speculative_config
    (eagle_train.engines.vllm_engine.speculative_config)."""
    cmd = [
        str(python),
        str(CLI),
        "serve",
        absolute(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--seed",
        "0",
        "--no-enable-prefix-caching",
    ]
    if speculative:
        cmd += ["--speculative-config", json.dumps(speculative)]
    return cmd + [str(a) for a in extra_args]


def server_failure(what: str, log: Path) -> EngineError:
    """An EngineError saying what went wrong, vLLM's own error line, the log's path and its last lines."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return EngineError(
        f"{what}: {failure_reason(text)}; log: {log}\n--- the last lines of {log.name} ---\n{log_tail(log)}"
    )


def is_healthy(base_url: str, timeout_s: float = 5) -> bool:
    """Whether the server's /health answers 200."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def wait_ready(process: subprocess.Popen, base_url: str, log: Path, timeout_s: float) -> None:
    """Poll /health until it answers; EngineError (naming the log) if the server exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not is_healthy(base_url):
        if process.poll() is not None:
            raise server_failure(f"vllm serve exited with code {process.returncode} before it was ready", log)
        if time.monotonic() > deadline:
            raise server_failure(f"vllm serve was not ready after {timeout_s:.0f} s", log)
        time.sleep(1)


def stop_server(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop the server and every process it started (its own process group): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if process.poll() is not None:
            break
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
    try:  # the engine core and other children of the group, once the leader is gone
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def vllm_server(cmd: list[str], port: int, log: Path, ready_timeout_s: float = 600) -> Iterator[str]:
    """Run `cmd` (a `serve_command`) with its output in `log`; yield the base URL once it is ready; stop it
    on the way out, whatever happened inside."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(), cwd=log.parent, start_new_session=True
        )
        try:
            base_url = f"http://127.0.0.1:{port}"
            wait_ready(process, base_url, log, ready_timeout_s)
            yield base_url
        finally:
            stop_server(process)


def bench_command(
    python: str | Path,
    base_url: str,
    dataset: Path,
    result: Path,
    *,
    tokenizer: str,
    num_prompts: int,
    concurrency: int,
    max_tokens: int,
    stop_token_ids: Sequence[int],
    warmups: int,
    label: str,
) -> list[str]:
    """`vllm bench serve` on `dataset` (ShareGPT JSON, its order kept, never oversampled): greedy, the
    same stop tokens as the built-in evaluation, `concurrency` requests in flight, all sent at once."""
    return [
        str(python),
        str(CLI),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base_url.rstrip("/"),
        "--endpoint",
        "/v1/completions",
        "--tokenizer",
        absolute(tokenizer),
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(dataset.resolve()),
        "--disable-shuffle",
        "--no-oversample",
        "--num-prompts",
        str(num_prompts),
        "--sharegpt-output-len",
        str(max_tokens),
        "--temperature",
        "0",
        "--extra-body",
        json.dumps({"stop_token_ids": [int(i) for i in stop_token_ids]}),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--num-warmups",
        str(warmups),
        "--percentile-metrics",
        PERCENTILE_METRICS,
        "--metric-percentiles",
        PERCENTILES,
        "--seed",
        "0",
        "--label",
        label,
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result.resolve().parent),
        "--result-filename",
        result.name,
    ]


def run_serving_benchmark(
    base_url: str,
    dataset: Path,
    result: Path,
    *,
    python: str | None = None,
    timeout_s: float = 3600,
    **bench: Any,
) -> dict[str, Any]:
    """Run vLLM's serving benchmark against `base_url` (keyword arguments: `bench_command`'s); its output
    goes to RESULT.log beside `result`; returns the result JSON vLLM wrote to `result`."""
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    log = result.with_suffix(".log")
    cmd = bench_command(engine_python(python), base_url, dataset, result, **bench)
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        try:
            done = subprocess.run(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=vllm_env(),
                cwd=result.parent,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as err:
            raise EngineError(f"vLLM's serving benchmark ran over {timeout_s:.0f} s; log: {log}") from err
    if done.returncode != 0 or not result.is_file():
        raise server_failure(f"vLLM's serving benchmark failed (exit {done.returncode})", log)
    return json.loads(result.read_text())
