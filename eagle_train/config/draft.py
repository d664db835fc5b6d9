"""The draft head's own settings; every shape comes from the target's config."""

from __future__ import annotations

from dataclasses import dataclass

DRAFT_TYPES = ("eagle1", "eagle3", "peagle")
EAGLE3_FAMILY = ("eagle3", "peagle")  # heads over three target features with their own LM head


@dataclass
class DraftConfig:
    """The draft head: EAGLE-1/2 (fc over [embedding ; last hidden state], the target's LM head),
    EAGLE-3 (fc over three target layers, training-time test, its own LM head over a reduced vocabulary)
    or P-EAGLE (an EAGLE-3 head that drafts K tokens in one forward from learned placeholders)."""

    type: str = "eagle1"  # eagle1 (EAGLE-1/2 head) | eagle3 (EAGLE-3 / EAGLE-3.1 head) | peagle (P-EAGLE)
    # decoder layers in the head (EAGLE uses 1); eagle3 / peagle: layer 0 is the fusion layer (the
    # midlayer), layers 1..N-1 plain pre-norm Llama layers (published P-EAGLE heads: 4)
    num_layers: int = 1
    # the width of the head's MLP; null = the target's intermediate_size (what EAGLE heads use). The engines
    # read it from the exported config.json, so any width serves
    intermediate_size: int | None = None
    # bias on fc; null = the type's default: eagle1 on (SGLang, the reference; vLLM's export folds it),
    # eagle3 / peagle off (no engine's EAGLE-3 fc has one, so they refuse it)
    fc_bias: bool | None = None
    vocab_size: int | None = None  # eagle3 / peagle: draft vocabulary size; null = min(32000, target vocab)
    fc_norm: bool = False  # eagle3 / peagle (EAGLE-3.1): an RMSNorm on each of the three features before fc
    norm_output: bool = False  # eagle3 (EAGLE-3.1): feed the post-norm state to the next draft step
    # peagle: the placeholder token of the K-1 draft slots after the real one (vLLM's `pard_token`); null =
    # chosen when training starts: a token the target's tokenizer reserves or never uses (its mask token,
    # an id past the tokenizer, unk, pad) that occurs nowhere in the training data (training/heads.py)
    mask_token_id: int | None = None
    path: str | None = None  # a trained head (checkpoint or exported directory) to load

    def __post_init__(self) -> None:
        if self.type not in DRAFT_TYPES:
            raise ValueError(f"draft.type must be one of {DRAFT_TYPES}, got {self.type!r}")
        if self.num_layers < 1:
            raise ValueError(f"draft.num_layers must be >= 1, got {self.num_layers}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"draft.intermediate_size must be >= 1 (or null), got {self.intermediate_size}")
        if self.type in EAGLE3_FAMILY:
            if self.fc_bias:
                raise ValueError(
                    f"draft.type={self.type}: fc has no bias (vLLM and SGLang build it without one)"
                )
        elif self.fc_norm or self.norm_output or self.vocab_size is not None:
            raise ValueError(
                "draft.fc_norm, draft.norm_output and draft.vocab_size are EAGLE-3 settings "
                "(draft.type=eagle3 or peagle)"
            )
        if self.type == "peagle" and self.norm_output:
            raise ValueError(
                "draft.type=peagle drafts in one forward: it never feeds a state back (norm_output)"
            )
        if self.mask_token_id is not None and (self.type != "peagle" or self.mask_token_id < 0):
            raise ValueError(
                f"draft.mask_token_id is a P-EAGLE setting (draft.type=peagle), >= 0; got {self.mask_token_id}"
            )
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"draft.vocab_size must be >= 1 or null, got {self.vocab_size}")

    @property
    def has_fc_bias(self) -> bool:
        """fc_bias, or the type's default when it is null (the default is resolved here, never written
        back: Hydra builds the schema's defaults once, before the type is known)."""
        return self.type == "eagle1" if self.fc_bias is None else bool(self.fc_bias)
