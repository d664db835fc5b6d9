"""Stage 1, `python -m eagle_train.extract`: run the frozen target over the data, store its features."""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle_train.config.data import DataConfig
from eagle_train.config.target import FLOAT_DTYPES, TargetConfig

HIDDEN_DTYPES = (*FLOAT_DTYPES, "fp8")  # stored dtypes (eagle_train.store.codec)
BACKENDS = ("hf", "vllm")
VERIFY = ("changed", "full")


@dataclass
class VllmEngineConfig:
    """backend=vllm of extract and regenerate: vLLM runs the target, from its own environment (`make vllm-env`)."""

    python: str | None = None  # vLLM's python (null = .venv-vllm/bin/python of this checkout)
    tensor_parallel_size: int = 1  # GPUs one target is split over (70B: a node's 8)
    max_num_seqs: int = 64  # conversations vLLM runs at once
    gpu_memory_utilization: float = 0.85  # share of each GPU vLLM may use (weights + its cache)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.max_num_seqs < 1:
            raise ValueError("vllm.tensor_parallel_size and vllm.max_num_seqs must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass
class VllmExtractConfig(VllmEngineConfig):
    """backend=vllm: vLLM computes the hidden states."""

    chunk: int = 256  # conversations per request to the vLLM worker (bounds its temporary files)
    timeout_s: float = 3600  # longest wait for one request before the extraction stops

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk < 1:
            raise ValueError("vllm.chunk must be >= 1")


@dataclass
class ExtractConfig:
    """Where the features go, how they are stored and how the target is batched.

    Only target, data, dtype and the aux layers decide the store's contents; batch and shard sizes do not.
    """

    target: TargetConfig = field(default_factory=TargetConfig)  # the frozen target model
    data: DataConfig = field(default_factory=DataConfig)  # the ShareGPT conversations to extract
    out_dir: str = "outputs/features/${target.name}/${data.name}"  # the store directory
    # stored hidden-state dtype: bfloat16 | float16 | float32 | fp8 (float8 e4m3 + a float32 scale per token:
    # half of bf16's bytes; eagle_train.store.codec)
    dtype: str = "bfloat16"
    backend: str = "hf"  # hf: the Hugging Face target here | vllm: vLLM in its own environment (see vllm)
    vllm: VllmExtractConfig = field(default_factory=VllmExtractConfig)  # backend=vllm only
    max_tokens: int = 16384  # token budget of one target forward (batch size x padded length)
    max_batch_size: int = 64  # most conversations in one target forward
    shard_samples: int | None = None  # most conversations per shard (null = no limit)
    shard_bytes: int = (
        512 * 2**20
    )  # most bytes of hidden states per shard (a shard holds at least one sample)
    overwrite: bool = False  # replace an existing store made with a different config
    # which kept shards a rerun re-hashes: changed (size, mtime or inode changed since last verified, or
    # training found it damaged) | full (every one: reads the whole store); a shard whose bytes differ is
    # extracted again
    verify: str = "changed"
    # also store the inputs of target.aux_layers, the features of EAGLE-3 heads (4 hidden states per
    # token: 4x the bytes; online training, data.source=online, needs no store at all)
    aux: bool = False
    progress: bool = True  # tqdm progress bar on the main process

    def __post_init__(self) -> None:
        if self.dtype not in HIDDEN_DTYPES:
            raise ValueError(f"dtype must be one of {HIDDEN_DTYPES}, got {self.dtype!r}")
        if self.verify not in VERIFY:
            raise ValueError(f"verify must be one of {VERIFY}, got {self.verify!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.max_tokens < 1 or self.max_batch_size < 1:
            raise ValueError(
                f"max_tokens and max_batch_size must be >= 1, got {self.max_tokens}, {self.max_batch_size}"
            )
        if self.shard_samples is not None and self.shard_samples < 1:
            raise ValueError(f"shard_samples must be >= 1 or null, got {self.shard_samples}")
        if self.shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {self.shard_bytes}")
        if not self.out_dir:
            raise ValueError("out_dir must be set")
