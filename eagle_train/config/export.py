"""Export of a trained head to a serving engine's layout (`python -m eagle_train.export`)."""

from __future__ import annotations

from dataclasses import dataclass

from eagle_train.config.target import FLOAT_DTYPES

EXPORT_FORMATS = ("vllm", "sglang", "eagle", "speculators")
FC_BIAS_POLICIES = ("fold", "refuse")
EXPORT_DTYPES = FLOAT_DTYPES


@dataclass
class ExportConfig:
    """Which checkpoint, which layout, where to."""

    ckpt: str = ""  # this project's head checkpoint (model.safetensors + config.json from training)
    # vllm | sglang | eagle (the SafeAILab/EAGLE reference's pytorch_model.bin layout) | speculators
    # (vLLM's self-describing packaging: target and K inside; EAGLE-3 heads only)
    format: str = "vllm"
    # output directory, written atomically; an existing non-empty one must be an earlier export of this
    # format (replaced whole) unless overwrite is set
    out_dir: str = ""
    # write into a non-empty directory that is not an earlier export of this format: this layout's files
    # are replaced, nothing else is deleted
    overwrite: bool = False
    # vLLM's EAGLE fc has no bias: fold = move a trained fc bias exactly into layer 0's attention biases;
    # refuse = stop with an error (then train with draft.fc_bias=false).
    fc_bias: str = "fold"
    dtype: str | None = None  # float32 | bfloat16 | float16 for the written tensors; null = the checkpoint's
    target_id: str | None = None  # target id written into config.json; null = the one the checkpoint records
    max_len: int | None = None  # training maximum length written into config.json; null = the recorded one
    # Where format=eagle (the reference loads it from the head's file) and a P-EAGLE head (it ships the
    # target's embedding with its learned mask row) read the target's input embedding; null = the target
    # source the checkpoint records.
    target_path: str | None = None
    # Re-express the head exactly with this larger head_dim (eagle_train.interop.reexpress), for a target
    # re-expressed the same way (vLLM's CPU attention needs 32+); null = keep the head's own.
    head_dim: int | None = None
    speculative_tokens: int = 3  # format=speculators: K, the draft tokens vLLM proposes per step

    def __post_init__(self) -> None:
        if self.format not in EXPORT_FORMATS:
            raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {self.format!r}")
        if self.fc_bias not in FC_BIAS_POLICIES:
            raise ValueError(f"fc_bias must be one of {FC_BIAS_POLICIES}, got {self.fc_bias!r}")
        if self.dtype is not None and self.dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype must be one of {EXPORT_DTYPES} or null, got {self.dtype!r}")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"head_dim must be >= 1 or null, got {self.head_dim}")
        if self.speculative_tokens < 1:
            raise ValueError(f"speculative_tokens must be >= 1, got {self.speculative_tokens}")
        if self.max_len is not None and self.max_len <= 1:
            raise ValueError(f"max_len must be > 1, got {self.max_len}")
