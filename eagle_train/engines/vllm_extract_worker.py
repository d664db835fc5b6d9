"""Runs inside vLLM's own environment: vLLM computes the target's hidden states for feature extraction.

    .venv-vllm/bin/python vllm_extract_worker.py REPLY_FD      (requests on stdin, one JSON line each)

Standard library, vllm and what vLLM's environment brings (its torch and safetensors), never this
package. vLLM's own hidden-state extraction does the work: the `extract_hidden_states` speculative
method keeps the inputs of the layers named in `eagle_aux_hidden_state_layer_ids` in a cache-only
attention layer, and a KV connector writes each finished prompt's rows to a safetensors file
(`hidden_states` [L, layers, hidden], `token_ids` [L]). Layer index L (the number of layers) is the last
residual stream, before the final norm (the caller applies it: vLLM hands out no post-norm state).

vLLM 0.32's `ExampleHiddenStatesConnector` cannot write on a CPU build: it copies through a CUDA stream
and event (`torch.cuda.Stream()`), and it writes a finished prompt only at the next engine step, which
`LLM.generate` never takes after its last prompt finishes. `SyncHiddenStatesConnector` below copies
synchronously on any device (and writes under a temporary name, renamed when complete), and the worker
steps the engine until every file of a request is there.

    first line:  {model, dtype, max_model_len, layers: [int], out_dir, tensor_parallel_size, max_num_seqs,
                  gpu_memory_utilization}            -> {"ready": true, "vllm_version": "..."}
    then:        {"prompts": [[int]]}                -> {"files": [path per prompt]}   (the caller deletes them)
    at the end:  {"quit": true}
"""

from __future__ import annotations

import os
import sys
import time

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)
from vllm_worker_loop import load_llm, serve  # a sibling: this directory is first on sys.path

CONNECTOR_MODULE = "vllm_extract_worker"  # this file, importable by vLLM from its directory
MAX_FLUSH_STEPS = 200


class _Done:
    """A completed copy (the base class polls a CUDA event here)."""

    def query(self) -> bool:
        return True


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """The example connector with a synchronous copy and an atomic write: works on CPU and GPU."""

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None] + block_ids[:, None] * self._block_size).flatten()
        count = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), count).to("cpu")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        tmp = pending.filename + ".tmp"
        save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
        os.replace(tmp, pending.filename)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()


def start(config: dict):
    """The LLM, set up to extract the hidden states of `config["layers"]` into `config["out_dir"]`."""
    return load_llm(
        config,
        enable_prefix_caching=False,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": config["layers"]}},
        },
        kv_transfer_config={
            "kv_connector": "SyncHiddenStatesConnector",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "shared_storage_path": config["out_dir"],
                "use_synchronization_lock": False,
            },
        },
    )


def extract(llm, prompts: list[list[int]], timeout_s: float = 600) -> list[str]:
    """One file of hidden states per prompt (prompt order): generate one token each, then step the engine
    until the connector has written every file (it writes a finished prompt at the next step)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    files = [o.kv_transfer_params["hidden_states_path"] for o in outputs]
    deadline = time.monotonic() + timeout_s
    for _ in range(MAX_FLUSH_STEPS):
        if all(os.path.exists(f) for f in files) or time.monotonic() > deadline:
            break
        llm.llm_engine.step()
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise RuntimeError(
            f"vLLM wrote no hidden states for {len(missing)} of {len(files)} prompts ({missing[0]})"
        )
    return files


def main(argv: list[str]) -> int:
    return serve(argv, start, lambda llm, request: {"files": extract(llm, request["prompts"])})


if __name__ == "__main__":
    sys.exit(main(sys.argv))
