"""The table of ``sinusoidal`` (``sinusoidal.py``): the fixed sin/cos embedding of Vaswani et
al. 2017, added to token embeddings."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


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
    """``positions [B, T] -> [B, T, C]``: the fixed table times ``scale``, in ``dtype`` (a
    dtype or its name); no parameters."""

    dim: int
    scale: float
    dtype: Any = jnp.float32

    def __call__(self, positions_BT: jax.Array) -> jax.Array:
        return (sinusoidal_embedding(positions_BT, self.dim) * self.scale).astype(self.dtype)
