"""A long-lived vLLM worker in vLLM's own environment (`make vllm-env`), one JSON line per request.

The worker script (standard library and vllm only) reads its requests on stdin and writes one reply line per
request to the pipe whose descriptor is its one argument; its stdout and stderr go to a log file. The first
request sets vLLM up and is answered {"ready": true, "vllm_version": ...}; a reply {"error": ...} ends the
stage with vLLM's message; {"quit": true} stops it. Extraction (`vllm_extract_worker.py`) and regeneration
(`vllm_generate_worker.py`) run this way.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

from eagle_train.engines.vllm_engine import EngineError, engine_python, failure_reason


class WorkerProcess:
    """`worker` started in vLLM's environment (`python`: its interpreter, None = .venv-vllm's) in `cwd`, its
    output in `log_path`, set up by `setup` (the first request); `what` names it in errors."""

    def __init__(self, worker: Path, python: str | None, log_path: Path, cwd: Path, setup: dict, what: str):
        self.log_path, self.what = log_path, what
        read_fd, write_fd = os.pipe()
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        env.pop("PYTHONPATH", None)  # nothing of this environment leaks into vLLM's
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if not torch.cuda.is_available():
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [str(engine_python(python)), str(worker), str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=[write_fd],
            env=env,
            cwd=cwd,
            text=True,
        )
        os.close(write_fd)
        self._replies = os.fdopen(read_fd)
        self.version = self.request(setup)["vllm_version"]

    def request(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Send one request and wait for its reply (EngineError: the worker stopped, or vLLM failed)."""
        self._send(obj)
        line = self._replies.readline()  # blocks until the worker answers or exits
        if not line:
            raise self._failure()
        reply = json.loads(line)
        if "error" in reply:
            raise EngineError(f"vLLM could not {self.what}: {reply['error']}; log: {self.log_path}")
        return reply

    def _send(self, obj: dict[str, Any]) -> None:
        try:
            self.process.stdin.write(json.dumps(obj) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self._failure() from None

    def _failure(self) -> EngineError:
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        return EngineError(
            f"vLLM's worker ({self.what}) stopped (exit {code}): {failure_reason(text)}; log: {self.log_path}"
        )

    def close(self) -> None:
        """Stop the worker (killed if it does not quit within two minutes)."""
        if self.process.poll() is None:
            try:
                self._send({"quit": True})
                self.process.stdin.close()
                self.process.wait(timeout=120)
            except (EngineError, subprocess.TimeoutExpired, OSError):
                self.process.kill()
                self.process.wait()
        self._replies.close()
        self._log.close()
