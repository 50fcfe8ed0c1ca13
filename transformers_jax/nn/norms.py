"""The ``norm`` switch (``registry.NORMS``): each entry builds a Linen norm from the config;
and the ``norm_position`` switch (``registry.NORM_PLACEMENTS``): where a block applies it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.config import ModelConfig
from transformers_jax.registry import NORM_PLACEMENTS, NORMS


@NORMS.register("layernorm")
def layernorm(config: ModelConfig, name: str | None = None) -> nn.Module:
    return nn.LayerNorm(
        epsilon=config.norm_eps,
        use_bias=config.use_bias,
        dtype=jnp.dtype(config.dtype),
        param_dtype=jnp.dtype(config.param_dtype),
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        name=name,
    )


@NORMS.register("rmsnorm")
def rmsnorm(config: ModelConfig, name: str | None = None) -> nn.Module:
    return nn.RMSNorm(
        epsilon=config.norm_eps,
        dtype=jnp.dtype(config.dtype),
        param_dtype=jnp.dtype(config.param_dtype),
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        name=name,
    )


def make_norm(config: ModelConfig, name: str | None = None) -> nn.Module:
    return NORMS.get(config.norm)(config, name=name)


Sublayer = Callable[[jax.Array], jax.Array]


@dataclass(frozen=True)
class NormPlacement:
    """Where the norms of a block sit: its residual branch, and the norms around the stack."""

    # (x, sublayer, norm, dropout) -> x after one residual branch
    residual: Callable[[jax.Array, Sublayer, Sublayer, Sublayer], jax.Array]
    # the stack ends with a norm (pre-LN leaves the residual stream itself unnormalised)
    final_norm: bool
    # no sublayer input is normalised by the block, so an encoder that normalises its
    # embeddings (BERT, under post-LN) does it before the stack
    embedding_norm: bool


NORM_PLACEMENTS.add("pre", NormPlacement(  # GPT-2, Llama, T5: x + f(norm(x))
    lambda x, f, norm, drop: x + drop(f(norm(x))), final_norm=True, embedding_norm=False))
NORM_PLACEMENTS.add("post", NormPlacement(  # the original transformer, BERT: norm(x + f(x))
    lambda x, f, norm, drop: norm(x + drop(f(x))), final_norm=False, embedding_norm=True))


def norm_placement(config: ModelConfig) -> NormPlacement:
    return NORM_PLACEMENTS.get(config.norm_position)
