"""The ``mlp`` switch (``registry.MLPS``): the MLP's activation, whether it is gated, and the
Hugging Face names of that activation (what ``convert`` reads and writes)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import flax.linen as nn
import jax
from jax import lax

from transformers_jax.registry import MLPS


@dataclass(frozen=True)
class MLPKind:
    activation: Callable[[jax.Array], jax.Array]
    gated: bool  # gated: act(x W_gate) * (x W_up), as in SwiGLU
    # The names Hugging Face gives this activation (its ACT2FN keys), all computing it; the first
    # is written on export. Empty: the MLP does not convert.
    hf_names: tuple[str, ...] = ()


TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # one function, three spellings


def gelu_erf(x: jax.Array) -> jax.Array:
    """The exact GELU, ``x * Phi(x)``, with Phi from ``erf`` as PyTorch and Hugging Face write
    it. Flax's ``gelu(approximate=False)`` uses ``erfc``, which XLA:CPU expands into a branchy,
    tail-accurate polynomial that it also splits over three passes: 2.3 against 0.84 ms for
    the forward pass over ``[4096, 512]`` on one core (BENCHMARKS.md 2m). The two differ by
    under 1e-6 (relative 1e-7); for x below about -5, where Phi(x) is under 3e-7, this form
    returns the product's rounding noise instead of its tiny exact value."""
    return x * 0.5 * (1.0 + lax.erf(x * (1 / math.sqrt(2))))


MLPS.add("gelu", MLPKind(lambda x: nn.gelu(x, approximate=True), gated=False,  # GPT-2's tanh
                         hf_names=TANH_GELU_NAMES))
MLPS.add("gelu_exact", MLPKind(gelu_erf, gated=False, hf_names=("gelu",)))  # BERT
MLPS.add("relu", MLPKind(nn.relu, gated=False, hf_names=("relu",)))
MLPS.add("swiglu", MLPKind(nn.silu, gated=True, hf_names=("silu", "swish")))  # Llama
MLPS.add("geglu", MLPKind(lambda x: nn.gelu(x, approximate=True), gated=True,  # T5 v1.1
                          hf_names=TANH_GELU_NAMES))
