"""Fetching a target ahead of time (`python -m eagle_train.fetch target=...`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle_train.config.target import TargetConfig


@dataclass
class FetchConfig:
    """The target whose files are fetched and prepared now, rather than at the first stage that loads it."""

    target: TargetConfig = field(default_factory=TargetConfig)  # the preset or path to fetch
    load: bool = True  # also load the model once and check its logits (a broken conversion fails here)
