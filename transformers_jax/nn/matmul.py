"""The 2-D product under every ``Dense``: ``[R, I] @ [I, O]`` with float32 accumulation.

On XLA:CPU the weight gradient ``x^T g`` (contracting the R rows) is emitted as a plain dot,
not a library call, and that dot is about twice as fast when its output has fewer rows than
columns: ``[I, O]`` with I = 512 > O = 128 takes 10 ms where ``[O, I]`` takes 5.5 (4,096 rows,
one core; BENCHMARKS.md says what it gains in the step). XLA folds a plain transpose of the
product back into the dot, so for ``I > O`` the gradient is computed as ``(g^T x)`` behind an
``optimization_barrier`` and then transposed (a copy of the small kernel-sized result). Every
other platform, and every kernel with I <= O, takes the plain product and its usual autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from transformers_jax.nn.attention import target_platform

_ROWS_BY_IN = (((1,), (0,)), ((), ()))  # [R, I] x [I, O] -> [R, O]
_ROWS_BY_OUT = (((1,), (1,)), ((), ()))  # [R, I] x [O, I] -> [R, O]


def _product(x_RI: jax.Array, w_IO: jax.Array) -> jax.Array:
    return lax.dot_general(x_RI, w_IO, _ROWS_BY_IN, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _product_short_grad(x_RI: jax.Array, w_IO: jax.Array) -> jax.Array:
    return _product(x_RI, w_IO)


def _forward(x_RI, w_IO):
    return _product(x_RI, w_IO), (x_RI, w_IO)


def _backward(residuals, g_RO):
    x_RI, w_IO = residuals
    # the input gradient exactly as autodiff of the plain product computes it
    dx_RI = jax.vjp(lambda x: _product(x, w_IO), x_RI)[1](g_RO)[0]
    # the kernel gradient as the transposed kernel's: a dot whose output is [O, I]
    w_OI = w_IO.T
    dw_OI = jax.vjp(lambda w: lax.dot_general(x_RI, w, _ROWS_BY_OUT,
                                              preferred_element_type=jnp.float32), w_OI)[1](g_RO)[0]
    return dx_RI, lax.optimization_barrier(dw_OI).T


_product_short_grad.defvjp(_forward, _backward)


def matmul(x_RI: jax.Array, w_IO: jax.Array) -> jax.Array:
    """``x_RI @ w_IO`` in float32 (inputs in the compute dtype), with the kernel gradient
    computed in its faster orientation on CPU."""
    if w_IO.shape[0] > w_IO.shape[1] and target_platform() == "cpu":
        return _product_short_grad(x_RI, w_IO)
    return _product(x_RI, w_IO)
