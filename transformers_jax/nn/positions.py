"""Every positional scheme: absolute embeddings, rotary embeddings and additive attention biases.

Shape legend: B batch, T length, H heads, D head width, R rotary width (``rotary_dim``),
Q query length, K key length.

Positions are always explicit int32 arrays ``[B, T]`` (or ``[B, Q]`` / ``[B, K]``): they restart
in each packed segment and carry the cache offset while decoding, so nothing here reads a
position off an array index.

Three interfaces, independent of the attention kernel (REFERENCES.md section 4):

- embedding: ``sinusoidal_embedding(positions, dim)`` is added to the token embeddings (the
  ``learned`` table is an ``nn.Embed`` owned by the model);
- rotary: ``apply_rope(x, positions, rope)`` rotates queries and keys before the dot product;
- bias: ``AlibiBias``, ``T5RelativeBias`` and ``FireBias`` map ``(q_pos, k_pos)`` to an additive
  float32 bias ``[B, H, Q, K]``. A model computes its bias module **once per forward pass** and
  shares the result with every layer (as T5 does), so there is one set of bias parameters.

``POSITIONS`` maps the config's ``position`` switch to a ``PositionScheme`` saying which of the
three a scheme is and, for biases, how to build the module from the config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax.config import RopeConfig
from transformers_jax.registry import Registry

# Absolute embeddings ---------------------------------------------------------------------------


def sinusoidal_embedding(positions: jax.Array, dim: int) -> jax.Array:
    """Vaswani et al. 2017: ``PE[p, 2i] = sin(p * w_i)``, ``PE[p, 2i+1] = cos(p * w_i)``.

    ``w_i = 10000**(-2i/dim)``; sin and cos are interleaved. positions int ``[B, T]``;
    returns float32 ``[B, T, dim]``. Moving by k positions rotates each (sin, cos) pair by
    the angle ``k * w_i``, which is what lets attention read relative offsets from it.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal_embedding needs an even dim (pairs of sin, cos), got {dim}")
    # Frequencies in float64 then rounded once, so they are as exact as float32 allows.
    w = (10000.0 ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)).astype(np.float32)
    angle_BTI = positions.astype(jnp.float32)[..., None] * w  # [B, T, dim/2]
    pe_BTI2 = jnp.stack([jnp.sin(angle_BTI), jnp.cos(angle_BTI)], axis=-1)
    return pe_BTI2.reshape(*positions.shape, dim)


# Rotary embeddings -----------------------------------------------------------------------------


def _default_inv_freq(base: float, rotary_dim: int) -> np.ndarray:
    """``1 / base**(2i/R)`` for i in [0, R/2), float64 (rounded to float32 by the caller)."""
    return 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def _yarn_inv_freq(rope: RopeConfig, rotary_dim: int) -> np.ndarray:
    """YaRN (Peng et al. 2023), as Hugging Face's default ``yarn`` rope type computes it.

    Dimension pairs that turn more than ``beta_fast`` times over the original context keep
    their frequency (extrapolate), those turning fewer than ``beta_slow`` times are divided by
    the factor (interpolate), with a linear ramp over the pair index in between.
    """
    d, base, s, l0 = rotary_dim, rope.base, rope.factor, rope.original_max_len

    def correction_dim(rotations: float) -> float:  # the pair index that turns `rotations` times
        return d * math.log(l0 / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), d - 1)
    if low == high:  # avoid dividing by zero in the ramp
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    inv = _default_inv_freq(base, d)
    return inv / s * ramp + inv * (1.0 - ramp)


def _llama3_inv_freq(rope: RopeConfig, rotary_dim: int) -> np.ndarray:
    """Llama 3.1: keep short wavelengths, divide long ones by the factor, blend in between.

    Same rule as Hugging Face's ``_compute_llama3_parameters``; wavelengths are compared with
    ``L0 / high_freq_factor`` and ``L0 / low_freq_factor``.
    """
    inv = _default_inv_freq(rope.base, rotary_dim)
    s, l0 = rope.factor, rope.original_max_len
    low_ff, high_ff = rope.low_freq_factor, rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > l0 / low_ff, inv / s, inv)
    smooth = (l0 / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * scaled / s + smooth * scaled
    medium = (wavelen >= l0 / high_ff) & (wavelen <= l0 / low_ff)
    return np.where(medium, blended, scaled)


def rope_frequencies(
    rope: RopeConfig, rotary_dim: int, seq_len: int | jax.Array | None = None
) -> tuple[jax.Array, float | jax.Array]:
    """Rotary inverse frequencies ``[R/2]`` float32 and the factor that multiplies cos and sin.

    ``rope.scaling`` picks the context-extension rule (factor s, original length L0):

    - ``none``: ``1 / base**(2i/R)``;
    - ``linear`` (position interpolation): ``inv_freq / s``;
    - ``ntk``: base becomes ``base * s**(R/(R-2))``;
    - ``dynamic_ntk``: base becomes ``base * (s*L/L0 - (s-1))**(R/(R-2))`` only when the current
      length ``L = seq_len`` exceeds L0 (``seq_len`` may be traced; None means L0, no change);
    - ``yarn``: ramp between extrapolation and interpolation; attention factor ``0.1 ln s + 1``;
    - ``llama3``: wavelength-based blend (Llama 3.1).

    The attention factor is 1.0 except for yarn.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and positive (pairs rotate), got {rotary_dim}")
    d, s = rotary_dim, rope.factor
    if rope.scaling == "none":
        inv = _default_inv_freq(rope.base, d)
    elif rope.scaling == "linear":
        inv = _default_inv_freq(rope.base, d) / s
    elif rope.scaling == "ntk":
        inv = _default_inv_freq(rope.base * s ** (d / (d - 2)), d)
    elif rope.scaling == "yarn":
        return jnp.asarray(_yarn_inv_freq(rope, d), jnp.float32), 0.1 * math.log(s) + 1.0
    elif rope.scaling == "llama3":
        inv = _llama3_inv_freq(rope, d)
    elif rope.scaling == "dynamic_ntk":
        return _dynamic_ntk_inv_freq(rope, d, seq_len), 1.0
    else:  # RopeConfig validates the name, so only a new, unimplemented scaling lands here
        raise ValueError(f"rope.scaling={rope.scaling!r} has no frequency rule")
    return jnp.asarray(inv, jnp.float32), 1.0


def _dynamic_ntk_inv_freq(
    rope: RopeConfig, rotary_dim: int, seq_len: int | jax.Array | None
) -> jax.Array:
    """Dynamic NTK in jnp, so that ``seq_len`` may be a traced value."""
    plain = jnp.asarray(_default_inv_freq(rope.base, rotary_dim), jnp.float32)
    if seq_len is None:
        return plain
    d, s, l0 = rotary_dim, rope.factor, rope.original_max_len
    length = jnp.asarray(seq_len, jnp.float32)
    # Up to L0 the model runs exactly as trained (the formula would shrink the base below it),
    # so the formula only ever sees lengths >= L0 and plain frequencies are used up to L0.
    stretch = s * jnp.maximum(length, l0) / l0 - (s - 1)
    base = rope.base * stretch ** (d / (d - 2))
    scaled = 1.0 / base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    return jnp.where(length > l0, scaled, plain)


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    rope: RopeConfig,
    rotary_dim: int | None = None,
    *,
    seq_len: int | jax.Array | None = None,
) -> jax.Array:
    """Rotate queries or keys by their positions (Su et al. 2021).

    x ``[B, T, H, D]``, positions int ``[B, T]``; returns the shape and dtype of x. The maths
    runs in float32 and is cast back once. Only the first ``rotary_dim`` dims of each head
    rotate (default ``int(D * rope.fraction)``, i.e. D unless partial rotary); the rest pass
    through. ``rope.pairing`` chooses which dims form a rotating pair: ``rotate_half`` pairs
    ``(x_i, x_{i+R/2})`` (GPT-NeoX, Llama), ``interleaved`` pairs ``(x_{2i}, x_{2i+1})`` (GPT-J).

    For ``dynamic_ntk`` the current length is ``max(positions) + 1`` over the whole batch
    (traced); pass ``seq_len`` to pin it, e.g. so queries and keys use the same base.
    """
    head_dim = x.shape[-1]
    r = int(head_dim * rope.fraction) if rotary_dim is None else rotary_dim
    if r <= 0 or r % 2 or r > head_dim:
        raise ValueError(
            f"rotary_dim={r} must be even, positive and at most the head width {head_dim}"
        )
    if rope.scaling == "dynamic_ntk" and seq_len is None:
        seq_len = jnp.max(positions) + 1
    inv_freq, attention_factor = rope_frequencies(rope, r, seq_len)

    angle_BTI = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
    # YaRN's attention factor scales cos and sin, i.e. both q and k, as Hugging Face does.
    cos_BT1I = (jnp.cos(angle_BTI) * attention_factor)[:, :, None, :]
    sin_BT1I = (jnp.sin(angle_BTI) * attention_factor)[:, :, None, :]

    x32 = x.astype(jnp.float32)
    rot_BTHR, pass_BTHP = x32[..., :r], x32[..., r:]
    if rope.pairing == "rotate_half":
        x1, x2 = rot_BTHR[..., : r // 2], rot_BTHR[..., r // 2 :]
    else:
        x1, x2 = rot_BTHR[..., 0::2], rot_BTHR[..., 1::2]
    # Each pair (x1, x2) turns by its angle: a 2-D rotation.
    y1 = x1 * cos_BT1I - x2 * sin_BT1I
    y2 = x2 * cos_BT1I + x1 * sin_BT1I
    if rope.pairing == "rotate_half":
        y_BTHR = jnp.concatenate([y1, y2], axis=-1)
    else:
        y_BTHR = jnp.stack([y1, y2], axis=-1).reshape(rot_BTHR.shape)
    return jnp.concatenate([y_BTHR, pass_BTHP], axis=-1).astype(x.dtype)


# Additive attention biases ---------------------------------------------------------------------


def _distance_BQK(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """``i - j`` for query position i and key position j: int ``[B, Q, K]``."""
    return q_pos[:, :, None] - k_pos[:, None, :]


def alibi_slopes(n_heads: int) -> np.ndarray:
    """ALiBi head slopes (Press et al. 2022), float64 ``[n_heads]``.

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
    """ALiBi: bias ``-m_h * |i - j|``, no parameters. ``(q_pos [B, Q], k_pos [B, K])`` to
    float32 ``[B, H, Q, K]``.

    In the causal region (j <= i) this is the paper's ``-m_h * (i - j)``; the absolute value
    makes the same module serve bidirectional attention symmetrically.
    """

    n_heads: int

    def __call__(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        slopes_H = jnp.asarray(alibi_slopes(self.n_heads), jnp.float32)
        dist_BQK = jnp.abs(_distance_BQK(q_pos, k_pos)).astype(jnp.float32)
        return -slopes_H[None, :, None, None] * dist_BQK[:, None, :, :]


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
    """T5 relative bias (Raffel et al. 2020): a learned scalar per (bucket, head).

    ``(q_pos [B, Q], k_pos [B, K])`` to float32 ``[B, H, Q, K]``. The table ``rel_embedding``
    is ``[num_buckets, n_heads]``. T5 itself does not scale logits by 1/sqrt(d) (config
    ``attention_scale=1.0``); that choice lives in attention, not here.
    """

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
        rp_BQK = -_distance_BQK(q_pos, k_pos)  # key_pos - query_pos
        bucket_BQK = t5_relative_bucket(
            rp_BQK, self.bidirectional, self.num_buckets, self.max_distance
        )
        bias_BQKH = table_NH[bucket_BQK]
        return jnp.transpose(bias_BQKH, (0, 3, 1, 2)).astype(jnp.float32)


class FireBias(nn.Module):
    """FIRE (Li et al. 2023): ``bias = MLP(psi(|i - j|) / psi(max(L, i)))``, psi(x) = log(cx + 1).

    ``(q_pos [B, Q], k_pos [B, K])`` to float32 ``[B, H, Q, K]``; i is the query position.
    Dividing by psi of the query position (at least the threshold L) maps every distance into
    [0, 1] whatever the context length, which is what lets FIRE extrapolate. The MLP is
    1 -> hidden -> n_heads with ReLU. c (init 0.1) and L (init 512) are learned and kept
    positive through an absolute value.
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

        dist_BQK = jnp.abs(_distance_BQK(q_pos, k_pos)).astype(jnp.float32)
        query_BQ1 = q_pos.astype(jnp.float32)[:, :, None]
        # The tiny floor only matters if c or L is driven to exactly 0 (psi would be 0 there).
        denom_BQ1 = jnp.maximum(psi(jnp.maximum(threshold, query_BQ1)), 1e-6)
        rel_BQK1 = (psi(dist_BQK) / denom_BQ1)[..., None]
        h_BQKF = nn.relu(nn.Dense(self.hidden, name="mlp_in")(rel_BQK1))
        bias_BQKH = nn.Dense(self.n_heads, name="mlp_out")(h_BQKF)
        return jnp.transpose(bias_BQKH, (0, 3, 1, 2)).astype(jnp.float32)


# The position switch ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PositionScheme:
    """How a position scheme enters the model.

    ``kind``: ``none`` (NoPE), ``embedding`` (added to token embeddings), ``rotary`` (q/k
    rotation with ``apply_rope``) or ``bias`` (additive attention bias). For ``bias``,
    ``make_bias(model_config, bidirectional)`` builds the module; the model calls it once per
    forward pass on (query positions, key positions) and hands the ``[B, H, Q, K]`` result to
    every layer.
    """

    kind: str
    make_bias: Callable[[Any, bool], nn.Module] | None = None


POSITIONS: Registry[PositionScheme] = Registry("position scheme")


def _alibi(cfg: Any, bidirectional: bool) -> nn.Module:
    return AlibiBias(cfg.n_heads)  # |i - j| is symmetric, so one module serves both directions


def _t5(cfg: Any, bidirectional: bool) -> nn.Module:
    return T5RelativeBias(cfg.n_heads, cfg.t5_num_buckets, cfg.t5_max_distance, bidirectional)


def _fire(cfg: Any, bidirectional: bool) -> nn.Module:
    return FireBias(cfg.n_heads, cfg.fire_hidden)


POSITIONS.add("none", PositionScheme("none"))
POSITIONS.add("sinusoidal", PositionScheme("embedding"))  # sinusoidal_embedding
POSITIONS.add("learned", PositionScheme("embedding"))  # the model owns the nn.Embed table
POSITIONS.add("rope", PositionScheme("rotary"))  # apply_rope with config.rope
POSITIONS.add("alibi", PositionScheme("bias", _alibi))
POSITIONS.add("t5", PositionScheme("bias", _t5))
POSITIONS.add("fire", PositionScheme("bias", _fire))
