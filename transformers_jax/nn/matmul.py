"""The 2-D product under every ``Dense``, ``[R, I] @ [I, O]`` with float32 accumulation, and
under a tied output projection, ``[R, C] @ [V, C]^T`` (``matmul_transposed``).

On XLA:CPU the weight gradient ``x^T g`` (contracting the R rows) is emitted as a plain dot,
not a library call, and that dot is about twice as fast when its output has fewer rows than
columns: ``[I, O]`` with I = 512 > O = 128 takes 10 ms where ``[O, I]`` takes 5.5 (4,096 rows,
one core; BENCHMARKS.md says what it gains in the step). XLA folds a plain transpose of the
product back into the dot, so for ``I > O`` the gradient is computed as ``(g^T x)`` behind an
``optimization_barrier`` and then transposed (a copy of the small kernel-sized result). Every
other platform, and every kernel with I <= O, takes the plain product and its usual autodiff.

With inputs in a lower precision (bfloat16 compute), XLA:CPU's autodiff of the mixed product
converts both operands of each gradient product to float32 (the cotangent arrives in float32),
so both gradients ran at float32 speed after a conversion pass. On CPU the backward pass then
keeps the operands in the compute dtype: the cotangent is rounded to it (it is already exact
there when the layer's output is cast to the compute dtype, as ``Dense``'s is), and the weight
gradient contracts the rows split in two, ``[2, R/2, I] x [2, R/2, O]``: XLA hands a product
over two contracted axes to its matmul library, where bfloat16 runs at about twice the float32
rate, while a product over the one row axis stays in its own dot emitter (4,096 rows, one core:
3.2 against 5.6 ms for ``[128, 512]``, 3.6 against 10.3 for ``[512, 128]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from transformers_jax.nn.attention import _vma, target_platform

_ROWS_BY_IN = (((1,), (0,)), ((), ()))  # [R, I] x [I, O] -> [R, O]
_ROWS_BY_OUT = (((1,), (1,)), ((), ()))  # [R, I] x [O, I] -> [R, O]
_HALVES_BY_HALVES = (((0, 1), (0, 1)), ((), ()))  # [2, R/2, I] x [2, R/2, O] -> [I, O]


def _product(x_RI: jax.Array, w_IO: jax.Array) -> jax.Array:
    return lax.dot_general(x_RI, w_IO, _ROWS_BY_IN, preferred_element_type=jnp.float32)


def _product_transposed(x_RI: jax.Array, w_OI: jax.Array) -> jax.Array:
    return lax.dot_general(x_RI, w_OI, _ROWS_BY_OUT, preferred_element_type=jnp.float32)


def _with_backward(product, backward):
    """``product(x, w)`` with the custom ``backward((x, w), g) -> (dx, dw)``."""
    product = jax.custom_vjp(product)
    product.defvjp(lambda x, w: (product(x, w), (x, w)), backward)
    return product


def _short_grad_backward(residuals, g_RO):
    x_RI, w_IO = residuals
    # the input gradient exactly as autodiff of the plain product computes it
    dx_RI = jax.vjp(lambda x: _product(x, w_IO), x_RI)[1](g_RO)[0]
    # the kernel gradient as the transposed kernel's: a dot whose output is [O, I]
    w_OI = w_IO.T
    dw_OI = jax.vjp(lambda w: lax.dot_general(x_RI, w, _ROWS_BY_OUT,
                                              preferred_element_type=jnp.float32), w_OI)[1](g_RO)[0]
    return dx_RI, lax.optimization_barrier(dw_OI).T


def _low_precision_backward(residuals, g_RO):
    x_RI, w_IO = residuals
    g_RO = g_RO.astype(x_RI.dtype)
    dx_RI = lax.dot_general(g_RO, w_IO, _ROWS_BY_OUT, preferred_element_type=jnp.float32)
    if w_IO.shape[0] > w_IO.shape[1]:  # [out, in]: the transposed copy is of the smaller g
        dw_IO = lax.optimization_barrier(_rows_contracted(g_RO, x_RI)).T
    else:
        dw_IO = _rows_contracted(x_RI, g_RO)
    return (_summed_like(dx_RI.astype(x_RI.dtype), x_RI),
            _summed_like(dw_IO.astype(w_IO.dtype), w_IO))


def _summed_like(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """``grad`` summed over the mesh axes it varies over and ``primal`` does not (inside
    ``shard_map``: a replicated kernel's gradient is the sum over the shards, as autodiff
    gives it; custom gradients must do it themselves)."""
    extra = tuple(sorted(_vma(grad) - _vma(primal)))
    return lax.psum(grad, extra) if extra else grad


def _rows_contracted(a_RA: jax.Array, b_RB: jax.Array) -> jax.Array:
    """``a^T b`` ``[A, B]`` float32, over the rows split in two (a bitcast): XLA:CPU gives a
    product over two contracted axes to its matmul library, one over the row axis alone to its
    own emitter. Odd row counts keep the one-axis product."""
    rows = a_RA.shape[0]
    if rows % 2:
        return lax.dot_general(a_RA, b_RB, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
    return lax.dot_general(a_RA.reshape(2, rows // 2, -1), b_RB.reshape(2, rows // 2, -1),
                           _HALVES_BY_HALVES, preferred_element_type=jnp.float32)


_product_short_grad = _with_backward(_product, _short_grad_backward)
_product_low_precision_grad = _with_backward(_product, _low_precision_backward)


def matmul(x_RI: jax.Array, w_IO: jax.Array) -> jax.Array:
    """``x_RI @ w_IO`` in float32 (inputs in the compute dtype), with the gradients computed
    where XLA:CPU runs them fastest: the kernel gradient in its faster orientation in float32,
    both gradients in the compute dtype below float32."""
    if target_platform() != "cpu":
        return _product(x_RI, w_IO)
    if x_RI.dtype != jnp.float32 and x_RI.dtype == w_IO.dtype:
        return _product_low_precision_grad(x_RI, w_IO)
    if w_IO.shape[0] > w_IO.shape[1]:
        return _product_short_grad(x_RI, w_IO)
    return _product(x_RI, w_IO)


def _transposed_rows_backward(residuals, g_RO):
    x_RI, w_OI = residuals
    g_RO = g_RO.astype(x_RI.dtype)
    dx_RI = lax.dot_general(g_RO, w_OI, _ROWS_BY_IN, preferred_element_type=jnp.float32)
    dw_OI = _rows_contracted(g_RO, x_RI)
    return (_summed_like(dx_RI.astype(x_RI.dtype), x_RI),
            _summed_like(dw_OI.astype(w_OI.dtype), w_OI))


_product_transposed_rows_grad = _with_backward(_product_transposed, _transposed_rows_backward)


def matmul_transposed(x_RI: jax.Array, w_OI: jax.Array) -> jax.Array:
    """``x_RI @ w_OI^T`` in float32: a tied output projection, whose kernel is the token table
    ``[V, C]``. On CPU the kernel gradient contracts the halved rows straight into ``[V, C]``
    (in any dtype: autodiff's one-axis product runs in XLA's own emitter, and one computed as
    ``[C, V]`` and transposed made the gradient norm's sum over it about 25x slower); below
    float32 both gradients take operands in the compute dtype, as ``matmul``'s."""
    if target_platform() == "cpu" and x_RI.dtype == w_OI.dtype:
        return _product_transposed_rows_grad(x_RI, w_OI)
    return _product_transposed(x_RI, w_OI)
