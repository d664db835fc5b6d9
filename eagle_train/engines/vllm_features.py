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

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagle_train.config.extract import VllmExtractConfig
from eagle_train.engines.vllm_engine import EngineError
from eagle_train.engines.vllm_process import WorkerProcess
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
        source = self.target.source
        self.worker = WorkerProcess(
            WORKER,
            self.cfg.python,
            self.log_path,
            self.tmp,
            {
                "model": str(Path(source).resolve()) if Path(source).exists() else source,
                "dtype": self.target.cfg.dtype,
                "max_model_len": max_len,
                "layers": self.layers,
                "out_dir": str(self.tmp),
                "tensor_parallel_size": self.cfg.tensor_parallel_size,
                "max_num_seqs": self.cfg.max_num_seqs,
                "gpu_memory_utilization": self.cfg.gpu_memory_utilization,
            },
            "extract",
        )
        self.version = self.worker.version

    def states(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """The states vLLM computed for each prompt [L, len(layers), hidden], token ids checked."""
        start = time.perf_counter()
        files = self.worker.request({"prompts": prompts})["files"]
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
        self.worker.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
