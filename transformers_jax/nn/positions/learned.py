"""``learned``: a trained ``[max_len, C]`` table added to token embeddings (GPT-2, BERT)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp

from transformers_jax.nn.positions.base import PositionScheme
from transformers_jax.registry import POSITIONS


@POSITIONS.register("learned")
@dataclasses.dataclass(frozen=True)
class Learned(PositionScheme):
    """One row per position up to ``model.max_len``; nothing past it (no extrapolation)."""

    extrapolates: ClassVar[bool] = False

    def max_length(self, config: Any) -> int:
        return config.max_len

    def embedding(self, config: Any) -> nn.Module:
        return nn.Embed(
            config.max_len,
            config.d_model,
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(config.init_std), ("length", "embed")),
            param_dtype=jnp.dtype(config.param_dtype),
            dtype=jnp.dtype(config.dtype),
        )
