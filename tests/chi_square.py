"""One chi-square goodness-of-fit for the lossless-sampling tests, and the target's exact joint it tests against.

Observed counts against exact probabilities: the cells expected fewer than `min_expected` times are
pooled with whatever mass the listed cells do not cover (and with any sample outside them), the test's
validity condition; the expected counts are computed in float64 and rescaled to the observed total,
since scipy refuses sums that differ by more than 1.5e-8 relative (float32 probabilities do).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from scipy.stats import chisquare

from eagle_train.decoding.verify import process_logits


def chi_square_p(
    observed: Sequence[float], probabilities: Sequence[float], min_expected: float = 5.0
) -> float:
    """p-value of `observed` counts under `probabilities` (one per cell; they may sum to less than 1)."""
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probabilities = np.asarray(probabilities, dtype=np.float64).ravel()
    total = observed.sum()
    expected = probabilities * total
    big = expected >= min_expected
    cells_observed = list(observed[big])
    cells_expected = list(expected[big])
    pooled_observed = total - sum(cells_observed)
    pooled_expected = total - sum(cells_expected)
    if pooled_observed or pooled_expected > 1e-6:
        cells_observed.append(pooled_observed)
        cells_expected.append(max(pooled_expected, 1e-9))
    scaled = np.asarray(cells_expected) * (total / sum(cells_expected))
    return float(chisquare(cells_observed, scaled).pvalue)


@torch.no_grad()
def exact_joint(target, prompt: list[int], top_k: int, tokens: int) -> dict[tuple[int, ...], float]:
    """The target's probability of every continuation of at most `tokens` tokens (top-k at T=1), by plain
    cache-free forwards: a continuation ends early at a stop token, as `generate` does."""
    stops, joint, done = set(target.stop_token_ids), {(): 1.0}, {}
    for _ in range(tokens):
        nxt = {}
        for ctx, p in joint.items():
            logits, _ = target.features(torch.tensor([prompt + list(ctx)]))
            q = process_logits(logits[0, -1], 1.0, 1.0, top_k).double()
            for t in torch.nonzero(q).flatten().tolist():
                (done if t in stops else nxt)[(*ctx, t)] = p * float(q[t])
        joint = nxt
    return {**done, **joint}


def sequence_chi_square_p(counts: dict[tuple[int, ...], int], joint: dict[tuple[int, ...], float]) -> float:
    """p-value of the sequence counts under the exact joint (a sampled sequence outside it fails)."""
    cells = list(joint)
    observed = [counts.get(seq, 0) for seq in cells] + [sum(n for s, n in counts.items() if s not in joint)]
    return chi_square_p(observed, [joint[seq] for seq in cells] + [0.0])
