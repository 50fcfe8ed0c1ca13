"""``learned``: a trained ``[max_len, C]`` table added to token embeddings (GPT-2, BERT)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from transformers_jax.nn.positions.base import PositionScheme
from transformers_jax.registry import POSITIONS

if TYPE_CHECKING:
    import flax.linen as nn


@POSITIONS.register("learned")
@dataclasses.dataclass(frozen=True)
class Learned(PositionScheme):
    """One row per position up to ``model.max_len``; nothing past it (no extrapolation)."""

    extrapolates: ClassVar[bool] = False

    def max_length(self, config: Any) -> int:
        return config.max_len

    def embedding(self, config: Any) -> nn.Module:
        from transformers_jax.nn.layers import make_embed

        return make_embed(config, config.max_len, ("length", "embed"))
