"""Regeneration of assistant replies by the target (`python -m eagle_train.regenerate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle_train.config.data import DataConfig
from eagle_train.config.extract import BACKENDS, VllmEngineConfig
from eagle_train.config.target import TargetConfig

TURN_MODES = ("first", "all")


@dataclass
class RegenerateConfig:
    """Which prompts, how the target writes the replies, where they go."""

    target: TargetConfig = field(default_factory=TargetConfig)  # the model that writes the replies
    data: DataConfig = field(default_factory=DataConfig)  # ShareGPT prompts (replies, if any, are replaced)
    # output ShareGPT JSONL; a rerun skips ids already in it (or in its .part files)
    out: str = "outputs/regenerated/${target.name}_${data.name}.jsonl"
    turns: str = "first"  # first: reply to the first user turn only | all: every user turn, in order
    # hf: the Hugging Face target's `generate` here, batch_size prompts left-padded per call | vllm: vLLM in
    # its own environment (`make vllm-env`), batch_size prompts per request, continuously batched
    # (vllm.max_num_seqs at once); one process, vllm.tensor_parallel_size GPUs
    backend: str = "hf"
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)  # backend=vllm only
    batch_size: int = 16  # prompts per `generate` call (hf: left-padded) or per vLLM request (a resume point)
    max_new_tokens: int = 256  # reply budget; a prompt + budget beyond the context length is skipped
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling (temperature > 0 only)
    seed: int = 0  # sampling seed (per batch: seed + rank * 1_000_003 + batch number)
    progress: bool = True  # tqdm progress bar with tokens/s on the main process
    # start `out` over when it holds another command's output (other settings, or not this stage's);
    # `out` equal to the input is refused always
    overwrite: bool = False
    # torch intra-op threads on CPU; null = torch's default. A small target on a busy CPU runs far faster
    # with 1 (measured: 2 threads under load were 70x slower for stories260K).
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.turns not in TURN_MODES:
            raise ValueError(f"turns must be one of {TURN_MODES}, got {self.turns!r}")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"batch_size and max_new_tokens must be >= 1, got {self.batch_size}, {self.max_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or null, got {self.num_threads}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
