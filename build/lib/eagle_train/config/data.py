"""Which conversations to train on, and how to clean them (see eagle_train.data.sharegpt for the policy)."""

from __future__ import annotations

from dataclasses import dataclass

from eagle_train.config.base import expand_data_ref

LEADING_ASSISTANT = ("drop_turns", "drop_conversation")
REPEATED_ROLES = ("merge", "drop_conversation")


@dataclass
class DataConfig:
    """A ShareGPT conversation file (JSON array or JSONL) and how it is cut and cleaned."""

    name: str = "tinystories"  # short id for manifests and run names
    # ShareGPT JSON/JSONL file (relative to the current directory); ${data:...} names a shipped file
    path: str = "${data:tinystories/tinystories_sharegpt.jsonl}"
    max_len: int | None = None  # truncate to this many tokens; None = the target's max_len
    limit: int | None = None  # use only the first N conversations (after normalisation)
    eval_fraction: float = 0.05  # held-out share for training metrics (deterministic split by id hash)
    # assistant turns before the first user turn: drop_turns (remove them) | drop_conversation
    leading_assistant: str = "drop_turns"
    # consecutive turns of one role (after empty turns are removed): merge (join with a blank line) | drop_conversation
    repeated_roles: str = "merge"

    def __post_init__(self) -> None:
        self.path = expand_data_ref(str(self.path))
        if self.max_len is not None and self.max_len <= 1:
            raise ValueError(f"data.max_len must be > 1, got {self.max_len}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"data.limit must be > 0 or null, got {self.limit}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.leading_assistant not in LEADING_ASSISTANT:
            raise ValueError(
                f"data.leading_assistant must be one of {LEADING_ASSISTANT}, got {self.leading_assistant!r}"
            )
        if self.repeated_roles not in REPEATED_ROLES:
            raise ValueError(
                f"data.repeated_roles must be one of {REPEATED_ROLES}, got {self.repeated_roles!r}"
            )
