"""The ``norm`` switch (``registry.NORMS``): each entry builds a Linen norm from the config."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from transformers_jax.config import ModelConfig
from transformers_jax.registry import NORMS


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
