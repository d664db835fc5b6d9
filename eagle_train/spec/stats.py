"""Per-generation statistics of the speculative decoder (plain data; JSON-friendly via `to_dict`)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """What one `generate` call did and where its time went.

    A round drafts a tree, verifies it with one target forward and emits the round's root (the token the
    target chose last round: always accepted), the accepted draft tokens and nothing else; the bonus
    token becomes the next round's root. tau = mean over rounds of (accepted draft tokens + 1).
    """

    rounds: int = 0
    accepted_per_round: list[int] = field(default_factory=list)  # accepted draft tokens (root excluded)
    tree_depth_per_round: list[int] = field(default_factory=list)  # deepest draft node offered
    tree_size_per_round: list[int] = field(default_factory=list)  # nodes verified (root included)
    # Every draft node offered: its depth, the draft's probability of it given its parent, and whether
    # it was accepted (for calibration plots: confidence vs. acceptance per depth).
    node_depth: list[int] = field(default_factory=list)
    node_confidence: list[float] = field(default_factory=list)
    node_accepted: list[bool] = field(default_factory=list)
    prompt_tokens: int = 0
    new_tokens: int = 0
    time_prefill: float = 0.0  # seconds in the prompt's target forward (+ the draft's prompt pass)
    time_draft: float = 0.0  # drafting phase (draft forwards, top-k, tree building)
    time_verify: float = 0.0  # verification phase (target forward, acceptance)
    time_target_forward: float = 0.0  # inside target forwards only (prefill included)
    time_draft_forward: float = 0.0  # inside draft-head forwards only
    time_total: float = 0.0  # wall time of the whole generate call

    @property
    def tau(self) -> float:
        """Mean accepted length per round (accepted draft tokens + 1); 1.0 for plain decoding."""
        if not self.accepted_per_round:
            return 1.0
        return sum(a + 1 for a in self.accepted_per_round) / len(self.accepted_per_round)

    @property
    def acceptance_by_position(self) -> list[float]:
        """Rate at which draft position j (1-based: depth j) is accepted given position j-1 was and the
        tree offered depth j; entry j-1 of the list."""
        depth = max(self.tree_depth_per_round, default=0)
        rates = []
        for j in range(1, depth + 1):
            reached = [
                a >= j - 1 and d >= j
                for a, d in zip(self.accepted_per_round, self.tree_depth_per_round, strict=False)
            ]
            hits = sum(1 for a, r in zip(self.accepted_per_round, reached, strict=False) if r and a >= j)
            rates.append(hits / max(1, sum(reached)))
        return rates

    @property
    def time_other(self) -> float:
        """Wall time outside the target and draft forwards (the decoder's own overhead)."""
        return self.time_total - self.time_target_forward - self.time_draft_forward

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_total if self.time_total > 0 else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(
            tau=self.tau,
            acceptance_by_position=self.acceptance_by_position,
            time_other=self.time_other,
            tokens_per_second=self.tokens_per_second,
        )
        return data


class Stopwatch:
    """Accumulates elapsed seconds into a `GenerationStats` field: `with watch("time_draft"): ...`."""

    def __init__(self, stats: GenerationStats, sync=None):
        self.stats = stats
        self.sync = sync  # e.g. torch.cuda.synchronize on a GPU; None on the CPU

    def __call__(self, name: str) -> _Lap:
        return _Lap(self, name)


class _Lap:
    def __init__(self, watch: Stopwatch, name: str):
        self.watch, self.name = watch, name

    def __enter__(self) -> None:
        if self.watch.sync is not None:
            self.watch.sync()
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.watch.sync is not None:
            self.watch.sync()
        elapsed = time.perf_counter() - self.start
        setattr(self.watch.stats, self.name, getattr(self.watch.stats, self.name) + elapsed)
