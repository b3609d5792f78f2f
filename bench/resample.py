"""95% intervals of a ratio of two noisy costs, by resampling (bootstrap).

Seeded, so the same measurements always give the same interval.
"""

from __future__ import annotations

import random
from typing import Callable

BOOTSTRAP = 2000


def ratio_interval(draw: Callable[[random.Random], tuple[float, float]], seed: int = 0) -> list[float] | None:
    """The 2.5th and 97.5th percentiles of numerator / denominator over
    BOOTSTRAP resamples, each drawn by draw(rng); None when the denominator
    is not positive in over a tenth of them (it is within the noise)."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(BOOTSTRAP):
        num, den = draw(rng)
        if den > 0:
            ratios.append(num / den)
    if len(ratios) < BOOTSTRAP * 0.9:
        return None
    ratios.sort()
    return [ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]]
