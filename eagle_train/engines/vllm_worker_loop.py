"""Runs inside vLLM's own environment: the request loop of a long-lived worker (the protocol of
eagle_train.engines.vllm_process). Standard library and vllm only; the workers import it as a sibling
module (their directory is first on sys.path)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any


def load_llm(config: dict, **settings):
    """vLLM's `LLM` for the setup request {model, dtype, max_model_len, tensor_parallel_size, max_num_seqs,
    gpu_memory_utilization}, eager (no CUDA graphs to capture), seed 0, with the worker's own `settings`."""
    from vllm import LLM

    return LLM(
        model=config["model"],
        dtype=config["dtype"],
        max_model_len=config["max_model_len"],
        tensor_parallel_size=config["tensor_parallel_size"],
        max_num_seqs=config["max_num_seqs"],
        gpu_memory_utilization=config["gpu_memory_utilization"],
        enforce_eager=True,
        seed=0,
        **settings,
    )


def serve(argv: list[str], start: Callable[[dict], Any], handle: Callable[[Any, dict], dict]) -> int:
    """`start(setup)` with the first request, answered {"ready", "vllm_version"}; then `handle(state,
    request)` per request line until {"quit": true} or the end of stdin, an exception answered
    {"error": "Type: message"} (the caller stops with it). Replies go to the pipe `argv[1]` names."""
    if len(argv) != 2:
        print(f"usage: {os.path.basename(argv[0])} REPLY_FD (requests on stdin)", file=sys.stderr)
        return 2
    import vllm

    with os.fdopen(int(argv[1]), "w") as reply:

        def send(obj: dict) -> None:
            reply.write(json.dumps(obj) + "\n")
            reply.flush()

        state = start(json.loads(sys.stdin.readline()))
        send({"ready": True, "vllm_version": vllm.__version__})
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("quit"):
                break
            try:
                send(handle(state, request))
            except Exception as err:  # the caller stops the stage with vLLM's message
                send({"error": f"{type(err).__name__}: {err}"})
    return 0
