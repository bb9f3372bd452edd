"""The straggler rule: a worker slower than half the median pace, as status flags it and SSP stops waiting for it."""

from __future__ import annotations

import statistics

__all__ = ["PACE_SAMPLES", "STRAGGLER_FRACTION", "stragglers"]

#: A worker is a straggler below this fraction of the median step rate.
STRAGGLER_FRACTION = 0.5
#: The SSP bound judges a worker's own pace once this many gaps between its updates have measured it.
PACE_SAMPLES = 3


def stragglers(rates: dict[str, float], fraction: float = STRAGGLER_FRACTION) -> set[str]:
    """The keys of `rates` whose rate is below `fraction` x the median of all of them.

    One worker alone is never a straggler (it is its own median). The median of an even
    count is the mean of the middle two.
    """
    if len(rates) < 2:
        return set()
    cut = fraction * statistics.median(rates.values())
    return {k for k, r in rates.items() if r < cut}
