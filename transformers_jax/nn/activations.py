"""The ``mlp`` switch (``registry.MLPS``): the MLP's activation, whether it is gated, and the
Hugging Face names of that activation (what ``convert`` reads and writes). The MLP itself is
``nn.layers.MLP``; its width is ``model.d_ff``. A config is built without JAX, so each
``activation`` imports JAX when the model calls it."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, ClassVar

from transformers_jax.registry import MLPS, Switch

if TYPE_CHECKING:
    import jax

TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # one function, three spellings


def gelu_erf(x: jax.Array) -> jax.Array:
    """The exact GELU, ``x * Phi(x)``, with Phi from ``erf`` as PyTorch and Hugging Face write
    it. Flax's ``gelu(approximate=False)`` uses ``erfc``, which XLA:CPU expands into a branchy,
    tail-accurate polynomial that it also splits over three passes: 2.3 against 0.84 ms for
    the forward pass over ``[4096, 512]`` on one core. The two differ by under 1e-6 (relative
    1e-7); for x below about -5, where Phi(x) is under 3e-7, this form returns the product's
    rounding noise instead of its tiny exact value."""
    from jax import lax

    return x * 0.5 * (1.0 + lax.erf(x * (1 / math.sqrt(2))))


@dataclasses.dataclass(frozen=True)
class MLPKind(Switch):
    """Base of every ``MLPS`` entry: the activation of the MLP's hidden layer.

    ``gated``: the hidden layer is ``activation(x W_gate) * (x W_up)`` (SwiGLU, GeGLU), a third
    matrix; else ``activation(x W_up)``. ``hf_names``: the names Hugging Face gives this
    activation (its ``ACT2FN`` keys), all computing it; the first is written on export, and
    none means the MLP does not convert.
    """

    gated: ClassVar[bool] = False
    hf_names: ClassVar[tuple[str, ...]] = ()

    def activation(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError


@MLPS.register("gelu")
@dataclasses.dataclass(frozen=True)
class Gelu(MLPKind):
    """GELU by its tanh approximation: GPT-2."""

    hf_names: ClassVar[tuple[str, ...]] = TANH_GELU_NAMES

    def activation(self, x: jax.Array) -> jax.Array:
        import jax

        return jax.nn.gelu(x, approximate=True)


@MLPS.register("gelu_exact")
@dataclasses.dataclass(frozen=True)
class GeluExact(MLPKind):
    """The exact GELU (``gelu_erf``): BERT."""

    hf_names: ClassVar[tuple[str, ...]] = ("gelu",)

    def activation(self, x: jax.Array) -> jax.Array:
        return gelu_erf(x)


@MLPS.register("relu")
@dataclasses.dataclass(frozen=True)
class Relu(MLPKind):
    """ReLU: the original transformer, T5 v1.0."""

    hf_names: ClassVar[tuple[str, ...]] = ("relu",)

    def activation(self, x: jax.Array) -> jax.Array:
        import jax

        return jax.nn.relu(x)


@MLPS.register("swiglu")
@dataclasses.dataclass(frozen=True)
class SwiGLU(MLPKind):
    """SiLU-gated (Shazeer 2020): Llama."""

    gated: ClassVar[bool] = True
    hf_names: ClassVar[tuple[str, ...]] = ("silu", "swish")

    def activation(self, x: jax.Array) -> jax.Array:
        import jax

        return jax.nn.silu(x)


@MLPS.register("geglu")
@dataclasses.dataclass(frozen=True)
class GeGLU(MLPKind):
    """Gated by the tanh GELU: T5 v1.1, Flan-T5."""

    gated: ClassVar[bool] = True
    hf_names: ClassVar[tuple[str, ...]] = TANH_GELU_NAMES

    def activation(self, x: jax.Array) -> jax.Array:
        import jax

        return jax.nn.gelu(x, approximate=True)
