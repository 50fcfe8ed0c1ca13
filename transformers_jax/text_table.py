"""Rows of text in aligned columns, as the commands print them for a person (``tjax presets``,
``tjax eval``)."""

from __future__ import annotations

from collections.abc import Sequence


def aligned(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """``header`` then ``rows``, each column as wide as its widest cell, two spaces apart."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in [header, *rows]]
