"""The bias of ``kerple`` (``kerple.py``): a learned logarithmic distance kernel per head
(Chi et al. 2022, KERPLE, the "log" variant)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.nn.positions.base import distance_BQK


def clamp_below(x: jax.Array, floor: float) -> jax.Array:
    """``max(x, floor)`` in the forward pass, the identity in the backward pass.

    The reference code keeps r1, r2 >= eps by clamping the stored parameters before every
    forward pass (a projected gradient step), so the gradient at the floor is the unclamped
    one. A Flax module cannot write its parameters; passing the gradient straight through the
    clamp gives the same value and the same gradient, but the stored number may drift below
    the floor while the optimiser keeps pushing it down (it then takes as long to come back).
    """
    return x + jax.lax.stop_gradient(jnp.maximum(x, floor) - x)


class KerpleLogBias(nn.Module):
    """``bias = -r1_h * log(1 + r2_h * |i - j|)``: ``(q_pos [B, Q], k_pos [B, K])`` to
    float32 ``[B, H, Q, K]``.

    r1 (``r1``, the reference's ``bias_p``) and r2 (``r2``, its ``bias_a``) are ``[H]`` float32,
    initialised uniform in ``[0, init_r1)`` and ``[0, init_r2)`` (2 and 1 in the reference) and
    used as ``max(r, eps)`` (eps 0.01) so both stay positive: the kernel is then conditionally
    positive definite. |i - j| serves both directions (causal attention masks the other half).
    """

    n_heads: int
    init_r1: float = 2.0
    init_r2: float = 1.0
    eps: float = 0.01

    @nn.compact
    def __call__(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        def uniform(high: float):
            return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, 0.0, high)

        r1_H = self.param("r1", uniform(self.init_r1), (self.n_heads,), jnp.float32)
        r2_H = self.param("r2", uniform(self.init_r2), (self.n_heads,), jnp.float32)
        r1_H11 = clamp_below(r1_H, self.eps)[:, None, None]
        r2_H11 = clamp_below(r2_H, self.eps)[:, None, None]
        dist_B1QK = jnp.abs(distance_BQK(q_pos, k_pos)).astype(jnp.float32)[:, None]
        return -r1_H11 * jnp.log1p(r2_H11 * dist_B1QK)
