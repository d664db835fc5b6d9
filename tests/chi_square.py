"""One chi-square goodness-of-fit for the lossless-sampling tests.

Observed counts against exact probabilities: the cells expected fewer than `min_expected` times are
pooled with whatever mass the listed cells do not cover (and with any sample outside them), the test's
validity condition; the expected counts are computed in float64 and rescaled to the observed total,
since scipy refuses sums that differ by more than 1.5e-8 relative (float32 probabilities do).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import chisquare


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
