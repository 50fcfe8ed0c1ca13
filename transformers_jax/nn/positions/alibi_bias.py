"""The bias of ``alibi`` (``alibi.py``): a fixed linear distance penalty per head (Press et al.
2022), no parameters."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax.nn.positions.base import distance_BQK


def alibi_slopes(n_heads: int) -> np.ndarray:
    """Head slopes, float64 ``[n_heads]``.

    For n a power of two, ``m_h = 2**(-8(h+1)/n)``: a geometric sequence from ``2**(-8/n)``
    to ``2**-8``. Otherwise take the c = 2**floor(log2 n) slopes of c heads, then every other
    slope of 2c heads (the ones that fall between them), the first n - c of those.
    """
    if n_heads <= 0:
        raise ValueError(f"n_heads must be positive, got {n_heads}")

    def power_of_two(n: int) -> np.ndarray:
        return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)

    c = 2 ** math.floor(math.log2(n_heads))
    if c == n_heads:
        return power_of_two(n_heads)
    return np.concatenate([power_of_two(c), power_of_two(2 * c)[0::2][: n_heads - c]])


class AlibiBias(nn.Module):
    """Bias ``-m_h * |i - j|``: ``(q_pos [B, Q], k_pos [B, K])`` to float32 ``[B, H, Q, K]``.

    In the causal region (j <= i) this is the paper's ``-m_h * (i - j)``; the absolute value
    makes the same module serve bidirectional attention symmetrically.
    """

    n_heads: int

    def __call__(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        slopes_H = jnp.asarray(alibi_slopes(self.n_heads), jnp.float32)
        dist_BQK = jnp.abs(distance_BQK(q_pos, k_pos)).astype(jnp.float32)
        return -slopes_H[None, :, None, None] * dist_BQK[:, None, :, :]
