"""Stage 1, `python -m eagle_train.extract`: run the frozen target over the data, store its features."""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle_train.config.data import DataConfig
from eagle_train.config.target import TargetConfig

HIDDEN_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class ExtractConfig:
    """Where the features go, how they are stored and how the target is batched.

    Only target, data, dtype and the aux layers decide the store's contents; batch and shard sizes do not.
    """

    target: TargetConfig = field(default_factory=TargetConfig)  # the frozen target model
    data: DataConfig = field(default_factory=DataConfig)  # the ShareGPT conversations to extract
    out_dir: str = "outputs/features/${target.name}/${data.name}"  # the store directory
    dtype: str = "bfloat16"  # stored hidden-state dtype: bfloat16 | float16 | float32
    max_tokens: int = 16384  # token budget of one target forward (batch size x padded length)
    max_batch_size: int = 64  # most conversations in one target forward
    shard_samples: int | None = None  # most conversations per shard (null = no limit)
    shard_bytes: int = (
        512 * 2**20
    )  # most bytes of hidden states per shard (a shard holds at least one sample)
    overwrite: bool = False  # replace an existing store made with a different config
    # also store the inputs of target.aux_layers, the features of EAGLE-3 heads (4 hidden states per
    # token: 4x the bytes; online training, data.source=online, needs no store at all)
    aux: bool = False
    progress: bool = True  # tqdm progress bar on the main process

    def __post_init__(self) -> None:
        if self.dtype not in HIDDEN_DTYPES:
            raise ValueError(f"dtype must be one of {HIDDEN_DTYPES}, got {self.dtype!r}")
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
