"""``none`` (NoPE): no position information at all; a causal mask alone still orders tokens."""

from __future__ import annotations

import dataclasses

from transformers_jax.nn.positions.base import PositionScheme
from transformers_jax.registry import POSITIONS


@POSITIONS.register("none")
@dataclasses.dataclass(frozen=True)
class NoPositions(PositionScheme):
    """Every hook is the base's no-op."""
