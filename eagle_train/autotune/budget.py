"""The tuner's time budget: a share of the evaluation it serves (`evaluate tune_share`, 10% by default).

Choosing a shape only pays when it costs little next to what it speeds up. The evaluation a benchmark's
tuning serves decodes `eval_tokens` tokens (answers x methods x max_new_tokens); at plain decoding's seconds
per token, measured on the first calibration prompt, that is its estimated time, and the tuner may spend
`share` of it. The parts reach cumulative shares of that budget in order (`PARTS`): the greedy decoding of
the calibration prompts, the replayed calibration, the real decoder's phases; the race takes what is left.
A part past its share stops at its next step, after a floor of work that keeps the choice meaningful (one
calibration prompt, `MIN_ROOTS` root positions, one prompt through the phase probes); the race is skipped
when it cannot fit two shapes on one prompt, or when the prediction is decisive. The cost curves are not
in the budget: they are measured once per machine and model and cached (autotune.costs).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

# cumulative shares of the budget each part may reach; the race has the rest
PARTS = {"sequences": 0.2, "calibration": 0.55, "phases": 0.75}
MIN_ROOTS = 16  # root positions of the first calibration prompt calibrated whatever the budget says
MIN_TOKENS = 16  # tokens a phase probe decodes at least


@dataclass
class Budget:
    """Seconds the tuning may take: `share` x `eval_tokens` x plain decoding's seconds per token (`fix`,
    once measured); unbounded while not fixed or when share is None."""

    share: float | None
    eval_tokens: int = 0
    start: float = field(default_factory=time.perf_counter)
    total_s: float = math.inf
    token_s: float | None = None  # plain decoding's seconds per token, measured

    @property
    def bounded(self) -> bool:
        return math.isfinite(self.total_s)

    def fix(self, token_s: float) -> None:
        """Set the budget from plain decoding's measured seconds per token."""
        self.token_s = token_s
        if self.share is not None:
            self.total_s = self.share * self.eval_tokens * token_s

    def deadline(self, part: str) -> float:
        """The perf_counter time by which `part` should be done (inf when unbounded)."""
        return self.start + PARTS[part] * self.total_s

    def past(self, part: str) -> bool:
        return time.perf_counter() > self.deadline(part)

    def left(self) -> float:
        """Seconds left of the whole budget (inf when unbounded)."""
        return self.start + self.total_s - time.perf_counter()

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def probe_tokens(self, decodes: int, limit: int) -> int:
        """Tokens each of `decodes` phase-probe decodes may take to end the phases on their deadline
        (speculative rounds counted at plain decoding's cost per token), between MIN_TOKENS and `limit`."""
        if not self.bounded or not self.token_s:
            return limit
        seconds = self.deadline("phases") - time.perf_counter()
        return max(min(limit, MIN_TOKENS), min(limit, int(seconds / (decodes * self.token_s))))

    def to_dict(self) -> dict:
        return {
            "share": self.share,
            "eval_tokens": self.eval_tokens,
            "token_s": self.token_s,
            "eval_estimate_s": self.eval_tokens * self.token_s if self.token_s else None,
            "budget_s": self.total_s if self.bounded else None,
            "spent_s": self.spent(),
        }


def race_plan(
    candidates: list[dict], prompts: int, repeats: int, tokens: int, left_s: float
) -> tuple[int, int, int] | None:
    """(candidates, prompts, repeats) of the race that fits `left_s` seconds, each decode of a candidate
    estimated at tokens / its predicted tokens/s: repeats give way first (down to 1), then prompts (down to
    1), then candidates (down to 2, the slowest predicted dropped). None when even two shapes on one prompt
    do not fit."""

    def cost(c: int, p: int, r: int) -> float:
        return p * r * sum(tokens / max(x["tokens_per_s"], 1e-9) for x in candidates[:c])

    c, p, r = len(candidates), prompts, repeats
    while cost(c, p, r) > left_s:
        if r > 1:
            r -= 1
        elif p > 1:
            p -= 1
        elif c > 2:
            c -= 1
        else:
            return None
    return c, p, r
