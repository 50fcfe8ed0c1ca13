"""``rope``: rotary position embeddings (Su et al. 2021), with the context-extension rules of
``rope_scaling.py``.

Shape legend: B batch, T length, H heads, D head width, R rotary width.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from transformers_jax.config import ConfigError
from transformers_jax.nn.positions.base import PositionScheme, Role
from transformers_jax.nn.positions.rope_scaling import RopeScaling
from transformers_jax.registry import POSITIONS, ROPE_SCALINGS, switch_field

if TYPE_CHECKING:
    import jax

PAIRINGS = ("rotate_half", "interleaved")


@POSITIONS.register("rope")
@dataclasses.dataclass(frozen=True)
class Rope(PositionScheme):
    """Rotate each pair of a query's and a key's dims by ``position * inv_freq``; the dot
    product then depends on the positions only through their difference.

    ``pairing``: ``rotate_half`` pairs ``(x_i, x_{i+R/2})`` (GPT-NeoX, Llama), ``interleaved``
    pairs ``(x_{2i}, x_{2i+1})`` (GPT-J). ``fraction``: share of each head's dims that rotate
    (partial rotary); the rest pass through. ``scaling``: a ``ROPE_SCALINGS`` entry.
    """

    base: float = 10000.0
    pairing: str = "rotate_half"
    fraction: float = 1.0
    scaling: RopeScaling = switch_field(ROPE_SCALINGS, "none")

    def rotary_dim(self, config: Any) -> int:
        return int(config.dims_per_head * self.fraction)

    def check(self, config: Any) -> None:
        field = f"position={self.name}"
        if self.pairing not in PAIRINGS:
            raise ConfigError(f"position.pairing={self.pairing!r}: valid choices: "
                              f"{', '.join(PAIRINGS)}")
        if self.base <= 1:
            raise ConfigError(f"position.base={self.base!r}: must be > 1 (10000 is usual)")
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"position.fraction={self.fraction!r}: must be in (0, 1]")
        rot = self.rotary_dim(config)
        if rot % 2 or rot == 0:
            raise ConfigError(
                f"head_dim={config.dims_per_head!r}: {field} rotates pairs of dims, so the "
                f"rotary width (head_dim * position.fraction = {rot}) must be even and > 0; "
                "choose an even head_dim or change position.fraction")
        self.scaling.check(config)

    def shard_refusal(self, config: Any) -> str | None:
        # a rule that decodes otherwise than it runs on a window reads the window's length,
        # which one shard of it does not know
        if self.scaling.as_decoded() != self.scaling:
            return (f"position.scaling={self.scaling.name} takes its length from the whole "
                    "window, which one shard does not see")
        return None

    def rotate(self, config: Any, x_BTHD: jax.Array, positions_BT: jax.Array,
               role: Role) -> jax.Array:
        return apply_rope(x_BTHD, positions_BT, self, self.rotary_dim(config))


def rope_frequencies(
    rope: Rope, rotary_dim: int, seq_len: int | jax.Array | None = None
) -> tuple[jax.Array, float | jax.Array]:
    """Inverse frequencies ``[R/2]`` float32 and the factor that multiplies cos and sin, by
    ``rope.scaling`` (``seq_len``: the current length, for rules that use it)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and positive (pairs rotate), got {rotary_dim}")
    return rope.scaling.inv_freq(rope.base, rotary_dim, seq_len)


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    rope: Rope,
    rotary_dim: int | None = None,
    *,
    seq_len: int | jax.Array | None = None,
) -> jax.Array:
    """Rotate queries or keys by their positions.

    x ``[B, T, H, D]``, positions int ``[B, T]``; returns the shape and dtype of x. The maths
    runs in float32 and is cast back once. Only the first ``rotary_dim`` dims of each head
    rotate (default ``int(D * rope.fraction)``). For a scaling that uses the current length
    (dynamic NTK) the scaling says what it is (``current_length``: the longest position plus
    one, or each position's own) unless ``seq_len`` pins it.
    """
    import jax.numpy as jnp  # here, not at the top: a config reads this file without JAX

    head_dim = x.shape[-1]
    r = int(head_dim * rope.fraction) if rotary_dim is None else rotary_dim
    if r <= 0 or r % 2 or r > head_dim:
        raise ValueError(
            f"rotary_dim={r} must be even, positive and at most the head width {head_dim}"
        )
    if rope.scaling.uses_length and seq_len is None:
        seq_len = rope.scaling.current_length(positions)
    inv_freq, attention_factor = rope_frequencies(rope, r, seq_len)  # [R/2] or [B, T, R/2]

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
