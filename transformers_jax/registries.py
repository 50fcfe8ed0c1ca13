"""One place that knows every registry behind the config's string switches.

``ModelConfig`` calls ``check_model_names`` at construction, so an unknown name fails at once
with the list of valid ones, before any parameter is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers_jax.config import ModelConfig


def check_model_names(config: ModelConfig) -> None:
    from transformers_jax.models import FAMILIES
    from transformers_jax.nn.attention import ATTENTION
    from transformers_jax.nn.layers import MLPS, NORMS
    from transformers_jax.nn.masks import MASKS
    from transformers_jax.nn.positions import POSITIONS

    FAMILIES.check(config.family, "family")
    ATTENTION.check(config.attention, "attention")
    MASKS.check(config.mask, "mask")
    POSITIONS.check(config.position, "position")
    NORMS.check(config.norm, "norm")
    MLPS.check(config.mlp, "mlp")
