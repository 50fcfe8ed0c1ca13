"""``fire``: a learned function of the normalised distance (Li et al. 2023, FIRE); the bias
module is in ``fire_bias.py``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from transformers_jax.config import ConfigError
from transformers_jax.nn.positions.base import PositionScheme
from transformers_jax.registry import POSITIONS

if TYPE_CHECKING:
    import flax.linen as nn


@POSITIONS.register("fire")
@dataclasses.dataclass(frozen=True)
class Fire(PositionScheme):
    """``hidden``: width of the MLP; ``init_c``, ``init_threshold``: starting c and L."""

    hidden: int = 32
    init_c: float = 0.1
    init_threshold: float = 512.0

    def check(self, config: Any) -> None:
        if self.hidden <= 0 or self.init_c <= 0 or self.init_threshold <= 0:
            raise ConfigError(f"position={self}: fire needs positive hidden, init_c and "
                              "init_threshold")

    @classmethod
    def length_settings(cls, train_len: int, max_eval: int) -> dict[str, Any]:
        return {"init_threshold": float(train_len)}  # the length normalisation acts from the start

    def length_warnings(self, config: Any, seq_len: int) -> list[str]:
        if self.init_threshold <= seq_len:
            return []
        return [f"position.init_threshold={self.init_threshold:g} exceeds the training length "
                f"{seq_len}: psi(max(L, i)) starts constant over every training position, so "
                f"the length normalisation does not act; set it to at most {seq_len}"]

    def bias(self, config: Any, bidirectional: bool) -> nn.Module:
        from transformers_jax.nn.positions.fire_bias import FireBias

        return FireBias(config.n_heads, self.hidden, self.init_c, self.init_threshold)
