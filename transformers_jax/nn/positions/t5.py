"""``t5``: a learned scalar per (distance bucket, head) added to the scores (Raffel et al.)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.config import ConfigError
from transformers_jax.nn.positions.base import PositionScheme, distance_BQK
from transformers_jax.registry import POSITIONS


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


@POSITIONS.register("t5")
@dataclasses.dataclass(frozen=True)
class T5(PositionScheme):
    """``num_buckets`` buckets (half per direction when bidirectional); distances from
    ``max_distance`` on share the last one."""

    num_buckets: int = 32
    max_distance: int = 128

    def check(self, config: Any) -> None:
        if self.num_buckets < 4 or self.max_distance <= self.num_buckets // 2:
            raise ConfigError(
                f"position.num_buckets={self.num_buckets!r}: t5 needs >= 4 buckets and "
                f"position.max_distance (now {self.max_distance}) above half of them")

    @classmethod
    def length_settings(cls, train_len: int, max_eval: int) -> dict[str, Any]:
        return {"max_distance": train_len, "num_buckets": min(32, train_len)}  # all buckets train

    def length_warnings(self, config: Any, seq_len: int) -> list[str]:
        if self.max_distance <= seq_len:
            return []
        return [f"position.max_distance={self.max_distance} exceeds the training length "
                f"{seq_len}: the buckets for distances {seq_len}-{self.max_distance} never "
                f"train; set position.max_distance to at most {seq_len}"]

    def bias(self, config: Any, bidirectional: bool) -> nn.Module:
        return T5RelativeBias(config.n_heads, self.num_buckets, self.max_distance,
                              bidirectional)
