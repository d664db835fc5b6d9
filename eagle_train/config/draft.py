"""The draft head's own settings; every shape comes from the target's config."""

from __future__ import annotations

from dataclasses import dataclass

DRAFT_TYPES = ("eagle1", "eagle3")


@dataclass
class DraftConfig:
    """The draft head: EAGLE-1/2 (fc over [embedding ; last hidden state], the target's LM head) or
    EAGLE-3 (fc over three target layers, training-time test, its own LM head over a reduced vocabulary)."""

    type: str = "eagle1"  # eagle1 (EAGLE-1/2 head) | eagle3 (EAGLE-3 / EAGLE-3.1 head)
    num_layers: int = 1  # decoder layers in the head (EAGLE uses 1; eagle3: exactly 1, the midlayer)
    # bias on fc; null = the type's default: eagle1 on (SGLang, the reference; vLLM's export folds it),
    # eagle3 off (no engine's EAGLE-3 fc has one, so eagle3 refuses it)
    fc_bias: bool | None = None
    vocab_size: int | None = None  # eagle3: draft vocabulary size; null = min(32000, target vocabulary)
    fc_norm: bool = False  # eagle3 (EAGLE-3.1): an RMSNorm on each of the three features before fc
    norm_output: bool = False  # eagle3 (EAGLE-3.1): feed the post-norm state to the next draft step
    path: str | None = None  # a trained head (checkpoint or exported directory) to load

    def __post_init__(self) -> None:
        if self.type not in DRAFT_TYPES:
            raise ValueError(f"draft.type must be one of {DRAFT_TYPES}, got {self.type!r}")
        if self.num_layers < 1:
            raise ValueError(f"draft.num_layers must be >= 1, got {self.num_layers}")
        if self.type == "eagle3":
            if self.num_layers != 1:
                raise ValueError(
                    f"draft.type=eagle3 has one decoder layer (the midlayer), got {self.num_layers}"
                )
            if self.fc_bias:
                raise ValueError("draft.type=eagle3: fc has no bias (vLLM and SGLang build it without one)")
        elif self.fc_norm or self.norm_output or self.vocab_size is not None:
            raise ValueError(
                "draft.fc_norm, draft.norm_output and draft.vocab_size are EAGLE-3 settings (draft.type=eagle3)"
            )
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"draft.vocab_size must be >= 1 or null, got {self.vocab_size}")

    @property
    def has_fc_bias(self) -> bool:
        """fc_bias, or the type's default when it is null (the default is resolved here, never written
        back: Hydra builds the schema's defaults once, before the type is known)."""
        return self.type == "eagle1" if self.fc_bias is None else bool(self.fc_bias)
