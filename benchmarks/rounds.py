"""What the round-based benchmarks ``host_memory_ab.py``, ``concurrent_runs.py`` and
``commits_ab.py`` share: a figure's spread over rounds."""

from __future__ import annotations

import statistics


def spread(values: list[float]) -> dict:
    """Median, min and max of one figure over the rounds, and every value."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}
