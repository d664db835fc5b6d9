"""Regeneration's vLLM backend (`python -m eagle_train.regenerate backend=vllm`): vLLM writes the replies.

vLLM runs from its own environment (`make vllm-env`; `vllm.python`): one `vllm_generate_worker.py` for the
whole regeneration, fed one group of prompts at a time (token ids rendered here with the target's chat
template, exactly as the hf backend renders them; the same groups, resume points and output). Its log is
`<out>.vllm.log`. At temperature 0 the replies are the target's greedy ones (up to near-ties between
kernels); sampled replies are drawn by vLLM's generator, seeded per prompt (`seed`, then + 1 per prompt of
the group), so they differ from the hf backend's draws.
"""

from __future__ import annotations

from pathlib import Path

from eagle_train.config.extract import VllmEngineConfig
from eagle_train.engines.vllm_process import WorkerProcess

WORKER = Path(__file__).with_name("vllm_generate_worker.py")


class VllmGenerator:
    """Replies of `target` (a FrozenTarget: its config, tokenizer and stop ids; vLLM loads the weights)."""

    def __init__(self, target, cfg: VllmEngineConfig, log_path: Path, max_len: int):
        source = target.source
        self.stop_ids = target.stop_token_ids
        self.worker = WorkerProcess(
            WORKER,
            cfg.python,
            log_path,
            log_path.parent,
            {
                "model": str(Path(source).resolve()) if Path(source).exists() else source,
                "dtype": target.cfg.dtype,
                "max_model_len": max_len,
                "tensor_parallel_size": cfg.tensor_parallel_size,
                "max_num_seqs": cfg.max_num_seqs,
                "gpu_memory_utilization": cfg.gpu_memory_utilization,
            },
            "generate",
        )

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[tuple[list[int], str]]:
        """Per prompt (reply ids without the stop token, "stop" | "length"), as the hf backend returns them."""
        reply = self.worker.request(
            {
                "prompts": prompts,
                "seeds": [seed + i for i in range(len(prompts))],
                "max_tokens": max_new_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "stop_token_ids": self.stop_ids,
            }
        )
        stops, out = set(self.stop_ids), []
        for r in reply["replies"]:
            tokens = r["tokens"]
            cut = next((j for j, t in enumerate(tokens) if t in stops), len(tokens))
            out.append((tokens[:cut], "stop" if r["finish"] == "stop" else "length"))
        return out

    def close(self) -> None:
        self.worker.close()
