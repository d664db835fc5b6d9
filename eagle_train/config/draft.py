"""The draft head's own settings; every shape comes from the target's config."""

from __future__ import annotations

from dataclasses import dataclass

DRAFT_TYPES = ("eagle1", "eagle3", "peagle", "dflash")
EAGLE3_FAMILY = ("eagle3", "peagle")  # heads over three target features with their own LM head
MASK_TOKEN_TYPES = ("peagle", "dflash")  # heads that draft through a placeholder (mask) token


@dataclass
class DraftConfig:
    """The draft head: EAGLE-1/2 (fc over [embedding ; last hidden state], the target's LM head),
    EAGLE-3 (fc over three target layers, training-time test, its own LM head over a reduced vocabulary)
    P-EAGLE (an EAGLE-3 head that drafts K tokens in one forward from learned placeholders) or DFlash
    (Qwen3-style layers drafting a block of mask tokens in one forward, the target's context injected as
    keys and values in every layer: docs/dflash.md; trained, decoded and exported)."""

    # eagle1 (EAGLE-1/2 head) | eagle3 (EAGLE-3 / EAGLE-3.1 head) | peagle (P-EAGLE) | dflash (DFlash)
    type: str = "eagle1"
    # decoder layers in the head (EAGLE uses 1); eagle3 / peagle: layer 0 is the fusion layer (the
    # midlayer), layers 1..N-1 plain pre-norm Llama layers (published P-EAGLE heads: 4); dflash: N
    # Qwen3-style layers (published DFlash heads: 5)
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
    # peagle: the placeholder token of the K-1 draft slots after the real one (vLLM's `pard_token`); dflash:
    # the mask token of a block's B-1 slots after its anchor; null = chosen when training starts: a token
    # the target's tokenizer reserves or never uses (its mask token, an id past the tokenizer, unk, pad)
    # that occurs nowhere in the training data (heads/peagle.choose_mask_token)
    mask_token_id: int | None = None
    # dflash: the tokens one draft forward predicts, the anchor's slot included (published: 16)
    block_size: int = 16
    # dflash: the target layers whose OUTPUTS feed fc (z-lab's ids, 0-based); null = the published rule:
    # one draft layer -> [L // 2], else num_layers ids spread evenly over [1, L - 3] (config.target)
    target_layer_ids: list[int] | None = None
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
        if self.mask_token_id is not None and (self.type not in MASK_TOKEN_TYPES or self.mask_token_id < 0):
            raise ValueError(
                "draft.mask_token_id is a P-EAGLE and DFlash setting (draft.type=peagle or dflash), >= 0; "
                f"got {self.mask_token_id}"
            )
        self._check_dflash()
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"draft.vocab_size must be >= 1 or null, got {self.vocab_size}")

    def _check_dflash(self) -> None:
        if self.type != "dflash":
            if self.target_layer_ids is not None:
                raise ValueError("draft.target_layer_ids is a DFlash setting (draft.type=dflash)")
            return
        if self.fc_bias:
            raise ValueError("draft.type=dflash: fc has no bias (z-lab's and vLLM's DFlash fc has none)")
        if self.block_size < 2:
            raise ValueError(
                f"draft.block_size must be >= 2 (an anchor and a mask slot), got {self.block_size}"
            )
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
            if not self.target_layer_ids or min(self.target_layer_ids) < 0:
                raise ValueError(
                    f"draft.target_layer_ids must be layer ids >= 0, got {self.target_layer_ids}"
                )

    @property
    def has_fc_bias(self) -> bool:
        """fc_bias, or the type's default when it is null (the default is resolved here, never written
        back: Hydra builds the schema's defaults once, before the type is known)."""
        return self.type == "eagle1" if self.fc_bias is None else bool(self.fc_bias)
