"""``xpos``: RoPE with an exponential decay in the distance (Sun et al. 2022, "A
Length-Extrapolatable Transformer").

Shape legend: B batch, T length, H heads, D head width, R rotary width, I = R/2 pairs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from transformers_jax.config import ConfigError
from transformers_jax.nn.positions.base import Role
from transformers_jax.nn.positions.rope import Rope, apply_rope
from transformers_jax.registry import POSITIONS

if TYPE_CHECKING:
    import jax

# Bits of a float's exponent range left for the key's own magnitude (and the dot product's sum)
# on top of the xPos scale: the scale may reach 2**(max exponent - HEADROOM_BITS).
HEADROOM_BITS = 8
# The e for which 2**e overflows each compute dtype (``finfo(dtype).maxexp``).
MAX_EXPONENT = {"float32": 128, "bfloat16": 128, "float16": 16}


def xpos_zeta(rotary_dim: int, gamma: float) -> np.ndarray:
    """``zeta_i = (2i/R + gamma) / (1 + gamma)`` for pair i in [0, R/2), float64.

    The same as torchscale's ``(arange(0, R, 2) + gamma*R) / ((1 + gamma)*R)``; for gamma = 0.4
    it runs from 0.4/1.4 = 0.2857 (the fastest-rotating pair decays most) towards 1.
    """
    return (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim + gamma) / (1.0 + gamma)


@POSITIONS.register("xpos")
@dataclasses.dataclass(frozen=True)
class XPos(Rope):
    """RoPE (every ``rope`` setting: pairing, fraction, scaling) with each rotary pair i of a
    query at position n scaled by ``zeta_i**(n/scale_base)`` and of a key at position m by
    ``zeta_i**(-m/scale_base)``, so pair i of ``q_n . k_m`` carries
    ``zeta_i**((n - m)/scale_base)``: a decay in the distance, on top of the rotation. Dims
    outside the rotary fraction are left as they are (no rotation, no scale).

    Positions are *not* centred. torchscale centres them on the current block
    (``-(T//2) .. T - T//2``) so the scales stay near 1, but then a key's scale would depend on
    the length of the call that computed it, and keys are stored in the KV cache after
    ``rotate``: a key's transform must depend only on its own position. Uncentred, the key
    scale grows as ``(1/zeta_0)**(m/scale_base) = 3.5**(m/512)`` (gamma 0.4, scale_base 512)
    while the query scale shrinks by the same rule; their product is the small decay, but each
    factor must stay finite. ``max_length`` refuses positions at which the key scale would pass
    ``2**(e - 8)``, where 2**e overflows the compute dtype (e = 128; 16 in float16), leaving
    2**8 for the key's own size: 33,995 positions in float32 and bfloat16 (the scale alone
    overflows float32 near 36,200; the query scale turns subnormal near 35,700), 2,267 in
    float16. The transform itself is computed in float32.
    """

    gamma: float = 0.4
    scale_base: float = 512.0

    def check(self, config: Any) -> None:
        super().check(config)
        if self.gamma <= 0:
            raise ConfigError(f"position.gamma={self.gamma!r}: xpos needs gamma > 0 (0.4 in the "
                              "paper); at 0 the fastest pair's scale would be 0")
        if self.scale_base <= 0:
            raise ConfigError(f"position.scale_base={self.scale_base!r}: must be positive "
                              "(512 in the paper)")

    def max_length(self, config: Any) -> int:
        """Positions 0 .. N-1 whose key scale stays within the compute dtype (see the class)."""
        zeta_0 = self.gamma / (1.0 + self.gamma)  # the smallest zeta: pair 0
        bits = MAX_EXPONENT[config.dtype] - HEADROOM_BITS
        limit = self.scale_base * bits * math.log(2) / -math.log(zeta_0)
        return int(limit) + 1

    def length_field(self, config: Any) -> str:
        return "model.position.scale_base"

    def rotate(self, config: Any, x_BTHD: jax.Array, positions_BT: jax.Array,
               role: Role) -> jax.Array:
        import jax.numpy as jnp  # here, not at the top: a config reads this file without JAX

        if role not in ("query", "key"):
            raise ValueError(f"role must be 'query' or 'key', got {role!r}")
        r = self.rotary_dim(config)
        y_BTHD = apply_rope(x_BTHD.astype(jnp.float32), positions_BT, self, r)
        log_zeta_I = jnp.asarray(np.log(xpos_zeta(r, self.gamma)), jnp.float32)
        sign = 1.0 if role == "query" else -1.0  # queries zeta**(n/s), keys zeta**(-m/s)
        exponent_BT1 = sign * positions_BT.astype(jnp.float32)[..., None] / self.scale_base
        scale_BTI = jnp.exp(exponent_BT1 * log_zeta_I)
        # The scale of pair i goes to both of its dims, laid out as apply_rope pairs them.
        if self.pairing == "rotate_half":
            scale_BTR = jnp.concatenate([scale_BTI, scale_BTI], axis=-1)
        else:
            scale_BTR = jnp.repeat(scale_BTI, 2, axis=-1)
        rot_BTHR = y_BTHD[..., :r] * scale_BTR[:, :, None, :]
        return jnp.concatenate([rot_BTHR, y_BTHD[..., r:]], axis=-1).astype(x_BTHD.dtype)
