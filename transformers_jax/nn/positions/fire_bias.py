"""The bias of ``fire`` (``fire.py``): a learned function of the normalised distance (Li et
al. 2023, FIRE)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.nn.positions.base import distance_BQK


class FireBias(nn.Module):
    """``bias = MLP(psi(|i - j|) / psi(max(L, i)))``, ``psi(x) = log(cx + 1)``.

    ``(q_pos [B, Q], k_pos [B, K])`` to float32 ``[B, H, Q, K]``; i is the query position.
    Dividing by psi of the query position (at least the threshold L) maps every distance into
    [0, 1] whatever the context length, which is what lets FIRE extrapolate. The MLP is
    1 -> hidden -> n_heads with ReLU. c and L are learned and kept positive by an absolute value.
    """

    n_heads: int
    hidden: int = 32
    init_c: float = 0.1
    init_threshold: float = 512.0

    @nn.compact
    def __call__(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        c = jnp.abs(self.param("c", nn.initializers.constant(self.init_c), (), jnp.float32))
        threshold = jnp.abs(
            self.param("threshold", nn.initializers.constant(self.init_threshold), (), jnp.float32)
        )

        def psi(x: jax.Array) -> jax.Array:
            return jnp.log(c * x + 1.0)

        dist_BQK = jnp.abs(distance_BQK(q_pos, k_pos)).astype(jnp.float32)
        query_BQ1 = q_pos.astype(jnp.float32)[:, :, None]
        # The tiny floor only matters if c or L is driven to exactly 0 (psi would be 0 there).
        denom_BQ1 = jnp.maximum(psi(jnp.maximum(threshold, query_BQ1)), 1e-6)
        rel_BQK1 = (psi(dist_BQK) / denom_BQ1)[..., None]
        h_BQKF = nn.relu(nn.Dense(self.hidden, name="mlp_in")(rel_BQK1))
        bias_BQKH = nn.Dense(self.n_heads, name="mlp_out")(h_BQKF)
        return jnp.transpose(bias_BQKH, (0, 3, 1, 2)).astype(jnp.float32)
