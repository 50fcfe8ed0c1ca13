"""The ``mlp`` switch (``registry.MLPS``): the MLP's activation, whether it is gated, and the
Hugging Face names of that activation (what ``convert`` reads and writes)."""

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
    # The names Hugging Face gives this activation (its ACT2FN keys), all computing it; the first
    # is written on export. Empty: the MLP does not convert.
    hf_names: tuple[str, ...] = ()


TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # one function, three spellings


MLPS.add("gelu", MLPKind(lambda x: nn.gelu(x, approximate=True), gated=False,  # GPT-2's tanh
                         hf_names=TANH_GELU_NAMES))
MLPS.add("gelu_exact", MLPKind(lambda x: nn.gelu(x, approximate=False), gated=False,  # BERT
                               hf_names=("gelu",)))
MLPS.add("relu", MLPKind(nn.relu, gated=False, hf_names=("relu",)))
MLPS.add("swiglu", MLPKind(nn.silu, gated=True, hf_names=("silu", "swish")))  # Llama
MLPS.add("geglu", MLPKind(lambda x: nn.gelu(x, approximate=True), gated=True,  # T5 v1.1
                          hf_names=TANH_GELU_NAMES))
