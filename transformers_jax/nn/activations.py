"""The ``mlp`` switch (``registry.MLPS``): the MLP's activation and whether it is gated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import flax.linen as nn
import jax

from transformers_jax.registry import MLPS


@dataclass(frozen=True)
class MLPKind:
    activation: Callable[[jax.Array], jax.Array]
    gated: bool  # gated: act(x W_gate) * (x W_up), as in SwiGLU


MLPS.add("gelu", MLPKind(lambda x: nn.gelu(x, approximate=True), gated=False))  # GPT-2's tanh
MLPS.add("gelu_exact", MLPKind(lambda x: nn.gelu(x, approximate=False), gated=False))  # BERT
MLPS.add("relu", MLPKind(nn.relu, gated=False))
MLPS.add("swiglu", MLPKind(nn.silu, gated=True))  # Llama
MLPS.add("geglu", MLPKind(lambda x: nn.gelu(x, approximate=True), gated=True))  # T5 v1.1
