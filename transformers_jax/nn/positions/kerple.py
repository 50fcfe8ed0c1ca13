"""``kerple``: a learned logarithmic distance kernel per head (Chi et al. 2022, KERPLE, the
"log" variant); the bias module is in ``kerple_bias.py``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from transformers_jax.config import ConfigError
from transformers_jax.nn.positions.base import PositionScheme
from transformers_jax.registry import POSITIONS

if TYPE_CHECKING:
    import flax.linen as nn


@POSITIONS.register("kerple")
@dataclasses.dataclass(frozen=True)
class Kerple(PositionScheme):
    """``init_r1``, ``init_r2``: upper ends of the uniform initialisations of r1 and r2;
    ``eps``: the floor that keeps both positive (the reference's values: 2, 1, 0.01)."""

    init_r1: float = 2.0
    init_r2: float = 1.0
    eps: float = 0.01

    def check(self, config: Any) -> None:
        if self.init_r1 <= 0 or self.init_r2 <= 0 or self.eps <= 0:
            raise ConfigError(f"position={self}: kerple needs positive init_r1, init_r2 and eps "
                              "(r1 and r2 must stay positive)")

    def bias(self, config: Any, bidirectional: bool) -> nn.Module:
        from transformers_jax.nn.positions.kerple_bias import KerpleLogBias

        return KerpleLogBias(config.n_heads, self.init_r1, self.init_r2, self.eps)
