"""RoPE context-extension rules (``registry.ROPE_SCALINGS``): how the rotary frequencies change
when a model trained at ``original_max_len`` (L0) runs ``factor`` (s) times longer.

Each rule is one registered frozen config with ``inv_freq(base, R, seq_len) -> (inverse
frequencies [R/2] float32, attention factor)`` and its Hugging Face ``rope_type`` mapping
(``hf_parameters`` / ``from_hf``), so ``convert/`` needs no list of names. The attention
factor multiplies cos and sin (i.e. both q and k); it is 1 except for YaRN. The frequencies
are constants computed in NumPy, except where they follow a length known only when traced
(dynamic NTK).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from transformers_jax.config import ConfigError
from transformers_jax.registry import ROPE_SCALINGS, Switch

if TYPE_CHECKING:
    import jax


class UnmappableHF(ValueError):
    """A Hugging Face ``rope_parameters`` field this rule cannot express (``convert/`` names
    the model type around it)."""

    def __init__(self, field: str, value: Any, why: str):
        super().__init__(f"{field}={value!r}: {why}")
        self.field, self.value, self.why = field, value, why


def default_inv_freq(base: float, rotary_dim: int) -> np.ndarray:
    """``1 / base**(2i/R)`` for i in [0, R/2), float64 (rounded to float32 by the caller)."""
    return 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


@dataclasses.dataclass(frozen=True)
class RopeScaling(Switch):
    """Base: plain RoPE frequencies. ``hf_rope_type``: the Hugging Face name, None if none."""

    hf_rope_type: ClassVar[str | None] = None
    uses_length: ClassVar[bool] = False  # inv_freq depends on the current length (traced)

    def inv_freq(self, base: float, rotary_dim: int,
                 seq_len: int | jax.Array | None = None) -> tuple[np.ndarray | jax.Array, float]:
        """Inverse frequencies ``[..., R/2]`` float32 (a leading shape only for a ``seq_len``
        array of one length per position) and the attention factor."""
        return default_inv_freq(base, rotary_dim).astype(np.float32), 1.0

    def current_length(self, positions: jax.Array) -> jax.Array:
        """The length a rule that ``uses_length`` sees for ``positions`` ``[B, T]``."""
        return positions.max() + 1

    @classmethod
    def extending(cls, factor: float, original_max_len: int) -> RopeScaling:
        """This rule set to extend a model trained at ``original_max_len`` by ``factor`` (plain
        RoPE ignores both)."""
        return cls()

    def as_decoded(self) -> RopeScaling:
        """This rule as token-by-token decoding applies it, so that scoring a whole window
        measures what generation would compute (itself unless the rule depends on the
        current length)."""
        return self

    def hf_parameters(self) -> tuple[dict[str, Any], int | None]:
        """``(rope_parameters beyond rope_type/theta, pinned max_position_embeddings)``."""
        return {}, None

    @classmethod
    def from_hf(cls, params: dict[str, Any], max_positions: int, original: int) -> RopeScaling:
        """The rule for Hugging Face ``rope_parameters`` of this ``rope_type``; raises
        ``UnmappableHF`` naming a field it cannot express."""
        return cls()


@ROPE_SCALINGS.register("none")
@dataclasses.dataclass(frozen=True)
class NoScaling(RopeScaling):
    hf_rope_type: ClassVar[str | None] = "default"


@dataclasses.dataclass(frozen=True)
class Extension(RopeScaling):
    """A rule that extends the context by ``factor`` from ``original_max_len``."""

    factor: float | None = None  # s > 1
    original_max_len: int = 2048  # L0: the context the model was trained at

    def check(self, config: Any) -> None:
        field = "position.scaling"
        if self.factor is None or self.factor <= 1.0:
            raise ConfigError(f"{field}.factor={self.factor!r}: scaling={self.name} needs a "
                              "factor > 1 (the context extension; 1 means scaling=none)")
        if self.original_max_len <= 0:
            raise ConfigError(f"{field}.original_max_len={self.original_max_len!r}: must be "
                              "positive (the context the model was trained at)")

    def hf_parameters(self) -> tuple[dict[str, Any], int | None]:
        return {"factor": self.factor}, None

    @classmethod
    def extending(cls, factor: float, original_max_len: int) -> RopeScaling:
        return cls(factor=float(factor), original_max_len=int(original_max_len))

    @classmethod
    def hf_factor(cls, params: dict[str, Any], max_positions: int, original: int) -> float:
        if params.get("factor") is None:
            raise UnmappableHF("factor", None, f"rope_type={cls.hf_rope_type!r} needs it")
        return float(params["factor"])

    @classmethod
    def from_hf(cls, params: dict[str, Any], max_positions: int, original: int) -> RopeScaling:
        factor = cls.hf_factor(params, max_positions, original)
        if factor == 1.0:  # no extension: plain RoPE
            return NoScaling()
        return cls._from_hf(params, factor, max_positions, original)

    @classmethod
    def _from_hf(cls, params, factor, max_positions, original) -> RopeScaling:
        return cls(factor=factor, original_max_len=int(original))


@ROPE_SCALINGS.register("linear")
@dataclasses.dataclass(frozen=True)
class Linear(Extension):
    """Position interpolation (Chen et al. 2023): ``inv_freq / s``."""

    hf_rope_type: ClassVar[str | None] = "linear"

    def inv_freq(self, base, rotary_dim, seq_len=None):
        return (default_inv_freq(base, rotary_dim) / self.factor).astype(np.float32), 1.0


@ROPE_SCALINGS.register("ntk")
@dataclasses.dataclass(frozen=True)
class Ntk(Extension):
    """NTK-aware: the base becomes ``base * s**(R/(R-2))``. No Hugging Face rope_type."""

    def inv_freq(self, base, rotary_dim, seq_len=None):
        d = rotary_dim
        scaled = default_inv_freq(base * self.factor ** (d / (d - 2)), d)
        return scaled.astype(np.float32), 1.0


@ROPE_SCALINGS.register("dynamic_ntk")
@dataclasses.dataclass(frozen=True)
class DynamicNtk(Extension):
    """Dynamic NTK: base ``base * (s*L/L0 - (s-1))**(R/(R-2))`` only when the current length
    L exceeds L0 (L may be traced; None means L0, no change). Hugging Face measures L against
    ``max_position_embeddings``, so a conversion pins that to L0.

    ``length``: what "the current length" is. ``sequence`` (Hugging Face's forward pass): the
    longest position in the batch plus one, one base for the whole window. ``position``: each
    query and key at position t uses t + 1, as a model that decodes token by token sees it;
    then a full forward pass equals cached decoding, and evaluating a window measures the
    model as it would generate."""

    hf_rope_type: ClassVar[str | None] = "dynamic"
    uses_length: ClassVar[bool] = True
    length: str = "sequence"

    def check(self, config: Any) -> None:
        super().check(config)
        if self.length not in ("sequence", "position"):
            raise ConfigError(f"position.scaling.length={self.length!r}: sequence (one base "
                              "per window, as Hugging Face) or position (as it decodes)")

    def as_decoded(self) -> RopeScaling:
        return dataclasses.replace(self, length="position")

    def current_length(self, positions: jax.Array) -> jax.Array:
        if self.length == "position":
            return positions + 1
        return positions.max() + 1

    def hf_parameters(self):
        if self.length != "sequence":
            raise ValueError("position.scaling.length='position' has no Hugging Face form "
                             "(its forward pass uses one base per window): export with "
                             "length='sequence'")
        return {"factor": self.factor}, self.original_max_len

    def inv_freq(self, base, rotary_dim, seq_len=None):
        import jax.numpy as jnp  # here, not at the top: a config reads this file without JAX

        plain = default_inv_freq(base, rotary_dim).astype(np.float32)
        if seq_len is None:
            return plain, 1.0
        d, s, l0 = rotary_dim, self.factor, self.original_max_len
        length = jnp.asarray(seq_len, jnp.float32)[..., None]  # [..., 1]: one per position
        # Up to L0 the model runs exactly as trained (the formula would shrink the base there).
        stretch = s * jnp.maximum(length, l0) / l0 - (s - 1)
        new_base = base * stretch ** (d / (d - 2))
        scaled = 1.0 / new_base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
        return jnp.where(length > l0, scaled, plain), 1.0

    @classmethod
    def _from_hf(cls, params, factor, max_positions, original):
        return cls(factor=factor, original_max_len=int(max_positions))


@ROPE_SCALINGS.register("yarn")
@dataclasses.dataclass(frozen=True)
class Yarn(Extension):
    """YaRN (Peng et al. 2023), as Hugging Face's default ``yarn`` computes it: dimension pairs
    turning more than ``beta_fast`` times over L0 keep their frequency, those turning fewer
    than ``beta_slow`` times are divided by s, with a linear ramp over the pair index between;
    attention factor ``0.1 ln s + 1``."""

    hf_rope_type: ClassVar[str | None] = "yarn"
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def inv_freq(self, base, rotary_dim, seq_len=None):
        d, s, l0 = rotary_dim, self.factor, self.original_max_len

        def correction_dim(rotations: float) -> float:  # the pair index turning that often
            return d * math.log(l0 / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), d - 1)
        if low == high:  # avoid dividing by zero in the ramp
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        inv = default_inv_freq(base, d)
        inv = inv / s * ramp + inv * (1.0 - ramp)
        return inv.astype(np.float32), 0.1 * math.log(s) + 1.0

    def hf_parameters(self):
        return {"factor": self.factor, "original_max_position_embeddings": self.original_max_len,
                "beta_fast": self.beta_fast, "beta_slow": self.beta_slow}, None

    @classmethod
    def hf_factor(cls, params, max_positions, original):
        if params.get("factor") is None:  # transformers infers it from the two lengths
            return max_positions / original
        return float(params["factor"])

    @classmethod
    def _from_hf(cls, params, factor, max_positions, original):
        ours = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        theirs = _hf_yarn_attention_factor(factor, params)
        if abs(theirs - ours) > 1e-12:
            which = "attention_factor" if params.get("attention_factor") is not None else "mscale"
            raise UnmappableHF(which, params.get(which),
                               f"gives a YaRN attention factor of {theirs}; this project's "
                               f"YaRN uses 0.1 ln(factor) + 1 = {ours}")
        if params.get("truncate", True) is False:
            raise UnmappableHF("truncate", False,
                               "this project's YaRN rounds the correction range (truncate=True)")
        return cls(factor=factor, original_max_len=int(original),
                   beta_fast=float(params.get("beta_fast") or 32.0),
                   beta_slow=float(params.get("beta_slow") or 1.0))


def _hf_yarn_attention_factor(factor: float, params: dict[str, Any]) -> float:
    """The cos/sin multiplier ``transformers`` uses for YaRN."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    return mscale(factor)


@ROPE_SCALINGS.register("llama3")
@dataclasses.dataclass(frozen=True)
class Llama3(Extension):
    """Llama 3.1: keep short wavelengths, divide long ones by s, blend in between (wavelengths
    compared with ``L0 / high_freq_factor`` and ``L0 / low_freq_factor``)."""

    hf_rope_type: ClassVar[str | None] = "llama3"
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def inv_freq(self, base, rotary_dim, seq_len=None):
        inv = default_inv_freq(base, rotary_dim)
        s, l0 = self.factor, self.original_max_len
        low_ff, high_ff = self.low_freq_factor, self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > l0 / low_ff, inv / s, inv)
        smooth = (l0 / wavelen - low_ff) / (high_ff - low_ff)
        blended = (1 - smooth) * scaled / s + smooth * scaled
        medium = (wavelen >= l0 / high_ff) & (wavelen <= l0 / low_ff)
        return np.where(medium, blended, scaled).astype(np.float32), 1.0

    def hf_parameters(self):
        return {"factor": self.factor, "original_max_position_embeddings": self.original_max_len,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor}, None

    @classmethod
    def _from_hf(cls, params, factor, max_positions, original):
        return cls(factor=factor, original_max_len=int(original),
                   low_freq_factor=float(params["low_freq_factor"]),
                   high_freq_factor=float(params["high_freq_factor"]))
