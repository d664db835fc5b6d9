"""Per-generation statistics of the speculative decoder (plain data; JSON-friendly via `to_dict`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def mean_accept_length(accept_lengths: Iterable[int]) -> float | None:
    """tau: the mean of tokens per round (accepted draft tokens + 1, the target's bonus token included);
    None for no rounds. The one home of tau: the decoder's statistics, the report and the progress bar."""
    lengths = list(accept_lengths)
    return sum(lengths) / len(lengths) if lengths else None


def acceptance_by_position(accepted: Sequence[int], offered_depth: Sequence[int]) -> list[float | None]:
    """P(draft token k accepted | tokens 1..k-1 accepted) for k = 1..deepest offered, over the rounds that
    offered depth k and accepted 1..k-1 (None where no round did). Per round: accepted draft tokens and
    the deepest draft node offered. The one home of this statistic."""
    rounds = list(zip(accepted, offered_depth, strict=True))
    rates: list[float | None] = []
    for k in range(1, max((d for _, d in rounds), default=0) + 1):
        reached = [a for a, d in rounds if d >= k and a >= k - 1]
        rates.append(sum(a >= k for a in reached) / len(reached) if reached else None)
    return rates


def counts_tau(counts: dict[str, Any]) -> float | None:
    """tau from vLLM-style counters (drafts, accepted draft tokens): 1 + accepted draft tokens per draft (= mean of accepted + 1 over rounds)."""
    return 1 + counts["num_accepted_tokens"] / counts["num_drafts"] if counts["num_drafts"] else None


def counts_acceptance(counts: dict[str, Any]) -> list[float | None]:
    """Conditional acceptance by position from counters (equal to `acceptance_by_position` for chains that always draft every position)."""
    reached = [counts["num_drafts"], *counts["accepted_per_pos"][:-1]]
    return [hit / n if n else None for hit, n in zip(counts["accepted_per_pos"], reached, strict=True)]


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
    node_parent_accepted: list[bool] = field(
        default_factory=list
    )  # the node was tested (its parent accepted)
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
        return mean_accept_length(a + 1 for a in self.accepted_per_round) or 1.0

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """Conditional acceptance rate of draft positions 1..deepest (see `acceptance_by_position`)."""
        return acceptance_by_position(self.accepted_per_round, self.tree_depth_per_round)

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
