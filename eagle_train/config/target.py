"""The target model: which causal LM, how to load it, and how to talk to it."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass
class TargetConfig:
    """A frozen Hugging Face causal LM (the model the draft head accelerates)."""

    name: str = "stories260k"  # short id used in run names and manifests
    path: str = "${data:models/stories260K}"  # local directory or hub id (${data:...}: shipped)
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (the checkpoint's own dtype)
    trust_remote_code: bool = False  # off unless the user turns it on
    revision: str | None = None  # hub revision (branch, tag or commit)
    # Name of a fallback chat template (see eagle_train.data.templates) used when the tokenizer has
    # none; null = use tokenizer.apply_chat_template and refuse tokenizers without a template.
    chat_template: str | None = None
    # Force the fallback template even if the tokenizer ships a template.
    force_template: bool = False
    system_prompt: str | None = None  # default system message inserted when a conversation has none
    stop_token_ids: list[int] = field(default_factory=list)  # extra end-of-generation ids (EOS is added)
    max_len: int | None = None  # maximum sequence length; null = the model's max_position_embeddings
    # Longest TRAINING sequence (extraction, online training) when data.max_len is not set; null = max_len.
    # The GPU presets set 2048 (the reference's): a 128k context would keep 10-30k-token conversations.
    train_max_len: int | None = None
    # eager | sdpa | flash_attention_2 (flash takes no 4-D tree mask: decoding runs sdpa, hf keeps flash)
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"target.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_len is not None and self.max_len <= 1:
            raise ValueError(f"target.max_len must be > 1, got {self.max_len}")
        if self.train_max_len is not None and self.train_max_len <= 1:
            raise ValueError(f"target.train_max_len must be > 1, got {self.train_max_len}")
