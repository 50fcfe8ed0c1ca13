"""What the round-based benchmarks share (``host_memory_ab.py``, ``concurrent_runs.py``): a
figure's spread over rounds, and printing (and keeping) their one JSON object."""

from __future__ import annotations

import json
import statistics


def spread(values: list[float]) -> dict:
    """Median, min and max of one figure over the rounds, and every value."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def emit(result: dict, out: str | None) -> int:
    """Print ``result`` as indented JSON and, with ``out``, write it there too; returns 0."""
    text = json.dumps(result, indent=1)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
