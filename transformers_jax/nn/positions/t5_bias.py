"""The bias of ``t5`` (``t5.py``): a learned scalar per (distance bucket, head) added to the
scores (Raffel et al.)."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.nn.positions.base import distance_BQK


def t5_relative_bucket(
    relative_position: jax.Array,
    bidirectional: bool,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> jax.Array:
    """T5's bucket index (int32, same shape) of ``relative_position = key_pos - query_pos``.

    Bidirectional: half the buckets for keys after the query (``+num_buckets/2``), distance
    ``|rp|``; causal: distance ``max(-rp, 0)``. Of the buckets left, the first half hold one
    distance each, the rest grow logarithmically up to ``max_distance``; farther distances
    share the last bucket. The log is taken in float32, as in the reference implementations,
    so bucket edges agree with converted checkpoints.
    """
    rp = jnp.asarray(relative_position, jnp.int32)
    bucket = jnp.zeros_like(rp)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (rp > 0).astype(jnp.int32) * num_buckets
        n = jnp.abs(rp)
    else:
        n = jnp.maximum(-rp, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # jnp.maximum keeps log() away from 0; those entries take the is_small branch anyway.
    log_ratio = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact)
    large = max_exact + (
        log_ratio / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(is_small, n, large)


class T5RelativeBias(nn.Module):
    """``(q_pos [B, Q], k_pos [B, K])`` to float32 ``[B, H, Q, K]``; the table
    ``rel_embedding`` is ``[num_buckets, n_heads]``. T5 itself does not scale logits by
    1/sqrt(d) (config ``attention_scale=1.0``); that choice lives in attention, not here."""

    n_heads: int
    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True

    @nn.compact
    def __call__(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        table_NH = self.param(
            "rel_embedding",
            nn.initializers.normal(stddev=0.02),
            (self.num_buckets, self.n_heads),
            jnp.float32,
        )
        rp_BQK = -distance_BQK(q_pos, k_pos)  # key_pos - query_pos
        bucket_BQK = t5_relative_bucket(
            rp_BQK, self.bidirectional, self.num_buckets, self.max_distance
        )
        bias_BQKH = table_NH[bucket_BQK]
        return jnp.transpose(bias_BQKH, (0, 3, 1, 2)).astype(jnp.float32)
