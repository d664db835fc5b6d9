"""The draft head's own settings; every shape comes from the target's config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftConfig:
    """EAGLE-1/2 draft head: fc over [embedding ; feature] then Llama decoder layer(s)."""

    num_layers: int = 1  # decoder layers in the head (EAGLE uses 1)
    fc_bias: bool = True  # bias on fc (SGLang and the reference: on; vLLM drops it on export)
    path: str | None = None  # a trained head (checkpoint or exported directory) to load

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"draft.num_layers must be >= 1, got {self.num_layers}")
