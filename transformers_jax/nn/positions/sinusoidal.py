"""``sinusoidal``: the fixed sin/cos table of Vaswani et al. 2017, added to token embeddings."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax.config import ConfigError
from transformers_jax.nn.positions.base import PositionScheme
from transformers_jax.registry import POSITIONS


def sinusoidal_embedding(positions: jax.Array, dim: int) -> jax.Array:
    """``PE[p, 2i] = sin(p * w_i)``, ``PE[p, 2i+1] = cos(p * w_i)``, ``w_i = 10000**(-2i/dim)``.

    positions int ``[B, T]``; returns float32 ``[B, T, dim]`` (sin and cos interleaved). Moving
    by k positions rotates each (sin, cos) pair by the angle ``k * w_i``, which is what lets
    attention read relative offsets from it.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal_embedding needs an even dim (pairs of sin, cos), got {dim}")
    # Frequencies in float64 then rounded once, so they are as exact as float32 allows.
    w = (10000.0 ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)).astype(np.float32)
    angle_BTI = positions.astype(jnp.float32)[..., None] * w  # [B, T, dim/2]
    pe_BTI2 = jnp.stack([jnp.sin(angle_BTI), jnp.cos(angle_BTI)], axis=-1)
    return pe_BTI2.reshape(*positions.shape, dim)


class SinusoidalTable(nn.Module):
    """``positions [B, T] -> [B, T, C]``: the fixed table times ``scale``; no parameters."""

    dim: int
    scale: float
    dtype: Any = jnp.float32

    def __call__(self, positions_BT: jax.Array) -> jax.Array:
        return (sinusoidal_embedding(positions_BT, self.dim) * self.scale).astype(self.dtype)


FORMS = ("vaswani", "rms")


@POSITIONS.register("sinusoidal")
@dataclasses.dataclass(frozen=True)
class Sinusoidal(PositionScheme):
    """``form="vaswani"`` (default): as the original transformer (Vaswani et al. 2017, sec.
    3.4), token embeddings times sqrt(d_model) plus the table at amplitude 1, so the fixed
    table keeps its weight as the learned embeddings grow.

    ``form="rms"``: this project's earlier form, no token scaling and the table scaled so each
    component's RMS is ``init_std``. Kept for configs and checkpoints made with it; in the
    length experiment it trained like no positions at all (2.137 vs NoPE 2.174 nats), because
    the token embeddings soon outgrow a fixed table of RMS 0.02."""

    form: str = "vaswani"

    def check(self, config: Any) -> None:
        if self.form not in FORMS:
            raise ConfigError(f"position.form={self.form!r}: valid choices: vaswani (tokens "
                              "times sqrt(d_model) plus the unit table, as the paper), rms "
                              "(table at the token embeddings' init RMS, no scaling)")
        if config.d_model % 2:
            raise ConfigError(f"d_model={config.d_model!r}: sinusoidal positions need an even "
                              "d_model (pairs of sin and cos)")

    def token_scale(self, config: Any) -> float:
        return math.sqrt(config.d_model) if self.form == "vaswani" else 1.0

    def embedding(self, config: Any) -> nn.Module:
        if self.form == "vaswani":
            scale = 1.0
        else:
            scale = config.init_std * math.sqrt(2.0)  # sin and cos have RMS 1/sqrt(2)
        return SinusoidalTable(config.d_model, scale, jnp.dtype(config.dtype))
