"""The ``norm`` switch (``registry.NORMS``): which normalisation layer the model uses, with its
settings (``--model.norm=rmsnorm --model.norm.eps=1e-6``); and the ``norm_position`` switch
(``registry.NORM_PLACEMENTS``): where a block applies it around each residual branch. A config
is built without JAX, so ``layer`` imports Flax when it builds the module."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from transformers_jax.registry import NORM_PLACEMENTS, NORMS, ConfigError, Switch

if TYPE_CHECKING:
    import flax.linen as nn
    import jax

    Sublayer = Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Norm(Switch):
    """Base of every ``NORMS`` entry: ``layer`` builds the Linen module that normalises the last
    axis, ``[..., C] -> [..., C]``, in the config's dtypes. ``eps``: added to the variance (the
    mean square for RMSNorm) under the square root; Hugging Face's ``layer_norm_eps``,
    ``rms_norm_eps`` or ``layer_norm_epsilon``."""

    eps: float = 1e-5

    def check(self, config: Any) -> None:
        if self.eps <= 0:  # a negative epsilon takes the square root of a negative
            raise ConfigError(f"norm.eps={self.eps!r}: must be positive (e.g. 1e-5)")

    def layer(self, config: Any, name: str | None = None) -> nn.Module:
        raise NotImplementedError


@NORMS.register("layernorm")
@dataclasses.dataclass(frozen=True)
class LayerNorm(Norm):
    """``(x - mean) / sqrt(var + eps) * scale (+ bias with model.use_bias)``: GPT-2, BERT."""

    def layer(self, config: Any, name: str | None = None) -> nn.Module:
        import flax.linen as nn
        import jax.numpy as jnp

        return nn.LayerNorm(
            epsilon=self.eps,
            use_bias=config.use_bias,
            dtype=jnp.dtype(config.dtype),
            param_dtype=jnp.dtype(config.param_dtype),
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            name=name,
        )


@NORMS.register("rmsnorm")
@dataclasses.dataclass(frozen=True)
class RMSNorm(Norm):
    """``x / sqrt(mean(x^2) + eps) * scale``, no centring and no bias: Llama, T5."""

    def layer(self, config: Any, name: str | None = None) -> nn.Module:
        import flax.linen as nn
        import jax.numpy as jnp

        return nn.RMSNorm(
            epsilon=self.eps,
            dtype=jnp.dtype(config.dtype),
            param_dtype=jnp.dtype(config.param_dtype),
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            name=name,
        )



@dataclasses.dataclass(frozen=True)
class NormPlacement(Switch):
    """Base of every ``NORM_PLACEMENTS`` entry: where the norms of a block sit.

    ``residual(x, sublayer, norm, dropout)``: x after one residual branch. ``final_norm``: the
    stack ends with a norm (pre-LN leaves the residual stream itself unnormalised).
    ``embedding_norm``: no sublayer input is normalised by the block, so an encoder that
    normalises its embeddings (BERT, under post-LN) does it before the stack.
    """

    final_norm: ClassVar[bool] = True
    embedding_norm: ClassVar[bool] = False

    def residual(self, x: jax.Array, f: Sublayer, norm: Sublayer, drop: Sublayer) -> jax.Array:
        raise NotImplementedError


@NORM_PLACEMENTS.register("pre")
@dataclasses.dataclass(frozen=True)
class Pre(NormPlacement):
    """``x + f(norm(x))``: GPT-2, Llama, T5."""

    def residual(self, x, f, norm, drop):
        return x + drop(f(norm(x)))


@NORM_PLACEMENTS.register("post")
@dataclasses.dataclass(frozen=True)
class Post(NormPlacement):
    """``norm(x + f(x))``: the original transformer, BERT."""

    final_norm: ClassVar[bool] = False
    embedding_norm: ClassVar[bool] = True

    def residual(self, x, f, norm, drop):
        return norm(x + drop(f(x)))
