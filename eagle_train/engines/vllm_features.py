"""Extraction's vLLM backend (`python -m eagle_train.extract backend=vllm`): vLLM computes the features.

vLLM runs from its own environment (`make vllm-env`; `vllm.python`): one `vllm_extract_worker.py` for the
whole extraction, started when the backend opens and fed one chunk of a shard's conversations at a time
(their token ids, tokenized here exactly as the hf backend does: same template, same shards, same
manifest, resumable the same way). For each conversation it returns a file of the inputs of the layers
asked for; layer L (the number of layers) is the residual stream before the final norm, which this side
applies with the target's own norm module (read from the checkpoint with the embedding and LM head,
eagle_train.modeling.frozen): hidden = norm(h_L), the LM head's input, as the hf backend stores it.
The token ids vLLM ran are checked against ours, exactly. vLLM's tensor parallelism
(`vllm.tensor_parallel_size`) spreads a 70B target over a node's GPUs.

Its temporary files live in `out_dir/.vllm_features.partial-*` (removed when the backend closes, or by
the next run after a kill) and the worker's log in `out_dir/vllm_extract.log`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagle_train.config.extract import VllmExtractConfig
from eagle_train.engines.vllm_engine import EngineError, engine_python, failure_reason
from eagle_train.runtime.atomic_files import partial_prefix
from eagle_train.store.manifest import feature_widths

WORKER = Path(__file__).with_name("vllm_extract_worker.py")
LOG_NAME = "vllm_extract.log"


class VllmFeatures:
    """The features of `target` (a FrozenTarget with its final norm) computed by vLLM: `batches(rows)`
    gives them chunk by chunk, as the hf backend's do."""

    def __init__(
        self, target, cfg: VllmExtractConfig, out_dir: Path, max_len: int, aux_layers: list[int] | None = None
    ):
        self.target, self.cfg, self.aux_layers = target, cfg, aux_layers
        # the inputs of the aux layers (EAGLE-3), then the last residual stream (before the final norm)
        self.layers = [*(aux_layers or []), int(target.config.num_hidden_layers)]
        out_dir.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=partial_prefix("vllm_features"), dir=out_dir))
        self.log_path = out_dir / LOG_NAME
        self.version = ""
        self._start(max_len)

    @property
    def widths(self) -> dict[str, int]:
        return feature_widths(self.target.hidden_size, self.aux_layers)

    def _start(self, max_len: int) -> None:
        read_fd, write_fd = os.pipe()
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        env.pop("PYTHONPATH", None)  # nothing of this environment leaks into vLLM's
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if not torch.cuda.is_available():
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [str(engine_python(self.cfg.python)), str(WORKER), str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=[write_fd],
            env=env,
            cwd=self.tmp,
            text=True,
        )
        os.close(write_fd)
        self._replies = os.fdopen(read_fd)
        self._send(
            {
                "model": str(Path(self.target.source).resolve())
                if Path(self.target.source).exists()
                else self.target.source,
                "dtype": self.target.cfg.dtype,
                "max_model_len": max_len,
                "layers": self.layers,
                "out_dir": str(self.tmp),
                "tensor_parallel_size": self.cfg.tensor_parallel_size,
                "max_num_seqs": self.cfg.max_num_seqs,
                "gpu_memory_utilization": self.cfg.gpu_memory_utilization,
            }
        )
        self.version = self._receive()["vllm_version"]

    def _send(self, obj: dict[str, Any]) -> None:
        try:
            self.process.stdin.write(json.dumps(obj) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self._failure() from None

    def _receive(self) -> dict[str, Any]:
        line = self._replies.readline()  # blocks until the worker answers or exits
        if not line:
            raise self._failure()
        reply = json.loads(line)
        if "error" in reply:
            raise EngineError(f"vLLM could not extract: {reply['error']}; log: {self.log_path}")
        return reply

    def _failure(self) -> EngineError:
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        return EngineError(
            f"vLLM's extraction worker stopped (exit {code}): {failure_reason(text)}; log: {self.log_path}"
        )

    def states(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """The states vLLM computed for each prompt [L, len(layers), hidden], token ids checked."""
        start = time.perf_counter()
        self._send({"prompts": prompts})
        files = self._receive()["files"]
        out = []
        for ids, file in zip(prompts, files, strict=True):
            saved = load_file(file)
            os.unlink(file)
            if saved["token_ids"].tolist() != ids:
                raise EngineError(
                    f"{file}: vLLM ran other token ids than the conversation's ({len(ids)} tokens)"
                )
            out.append(saved["hidden_states"])
        self.seconds = time.perf_counter() - start
        return out

    @torch.no_grad()
    def features(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        """vLLM's states [L, layers, hidden] -> the store's features: hidden = norm(h_L) and, for EAGLE-3,
        aux [L, 3 * hidden] = the inputs of the aux layers side by side (low, mid, high)."""
        norm = self.target.norm
        last = states[:, -1].to(norm.weight.dtype)
        features = {"hidden": norm(last)}
        if self.aux_layers:
            features["aux"] = states[:, :-1].flatten(1)  # [L, 3 * hidden]
        return features

    def batches(self, rows: Sequence[dict[str, Any]]) -> Iterator[tuple[list[int], list, list | None]]:
        """(row indices, hidden [L_i, hidden] per row, aux [L_i, 3 * hidden] per row or None) per chunk of
        `rows` (`vllm.chunk` conversations), as the hf backend's batches."""
        for begin in range(0, len(rows), self.cfg.chunk):
            chunk = rows[begin : begin + self.cfg.chunk]
            prompts = [[int(t) for t in row["input_ids"]] for row in chunk]
            features = [self.features(states) for states in self.states(prompts)]
            aux = [f["aux"] for f in features] if self.aux_layers else None
            yield list(range(begin, begin + len(chunk))), [f["hidden"] for f in features], aux

    def close(self) -> None:
        """Stop the worker and remove its temporary files."""
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
        shutil.rmtree(self.tmp, ignore_errors=True)
