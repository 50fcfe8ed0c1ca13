"""``alibi``: a fixed linear distance penalty per head (Press et al. 2022), no parameters; the
bias module is in ``alibi_bias.py``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from transformers_jax.nn.positions.base import PositionScheme
from transformers_jax.registry import POSITIONS

if TYPE_CHECKING:
    import flax.linen as nn


@POSITIONS.register("alibi")
@dataclasses.dataclass(frozen=True)
class Alibi(PositionScheme):
    def bias(self, config: Any, bidirectional: bool) -> nn.Module:
        from transformers_jax.nn.positions.alibi_bias import AlibiBias

        return AlibiBias(config.n_heads)  # |i - j| is symmetric: one module for both
