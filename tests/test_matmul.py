"""``nn.matmul``: the Dense product whose kernel gradient XLA:CPU computes in its faster
orientation. Its gradients must equal plain autodiff exactly, and the compiled program must
hold the transposed dot (else the speed-up is gone and nothing else would say so)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformers_jax.nn.matmul import _product, matmul

SHAPES = [(64, 32, 8), (64, 8, 32), (16, 16, 16), (48, 24, 12)]  # rows, in, out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows,n_in,n_out", SHAPES)
def test_value_and_gradients_equal_the_plain_product(rows, n_in, n_out, dtype):
    kx, kw, kg = jax.random.split(jax.random.key(rows + n_in + n_out), 3)
    x = jax.random.normal(kx, (rows, n_in)).astype(dtype)
    w = jax.random.normal(kw, (n_in, n_out)).astype(dtype)
    g = jax.random.normal(kg, (rows, n_out))

    def value_and_grads(f):
        y, pullback = jax.vjp(f, x, w)
        return (y, *pullback(g))

    ours = jax.jit(lambda: value_and_grads(matmul))()
    plain = jax.jit(lambda: value_and_grads(_product))()
    for a, b in zip(ours, plain, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _dot_outputs(n_in: int, n_out: int) -> list[str]:
    x = jnp.ones((256, n_in))
    w = jnp.ones((n_in, n_out))
    grad = jax.jit(jax.grad(lambda w: matmul(x, w).sum()))
    text = grad.lower(w).compile().as_text()
    return re.findall(r"= f32\[(\d+,\d+)\]\{[^}]*\} dot\(", text)


def test_the_kernel_gradient_has_fewer_output_rows_than_columns_on_cpu():
    # in > out: the gradient dot writes [out, in] (then a transpose), never [in, out]
    dots = _dot_outputs(96, 32)
    assert "32,96" in dots and "96,32" not in dots, dots
    # in < out: the plain autodiff dot already writes [in, out]
    assert "32,96" in _dot_outputs(32, 96)


def test_a_dense_layer_trains_the_same_with_either_product():
    import flax.linen as nn

    from transformers_jax.nn.layers import Dense

    layer = Dense((8,), ("embed", "mlp"), use_bias=True)
    x = jax.random.normal(jax.random.key(0), (4, 5, 24))
    params = nn.unbox(layer.init(jax.random.key(1), x)["params"])
    grads = jax.grad(lambda p: (layer.apply({"params": p}, x) ** 2).sum())(params)
    kernel = params["kernel"]

    def plain(k, b):
        return _product(x.reshape(-1, 24), k) + b

    want = jax.grad(lambda k, b: (plain(k, b) ** 2).sum(), argnums=(0, 1))(kernel, params["bias"])
    np.testing.assert_allclose(grads["kernel"], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grads["bias"], want[1], rtol=1e-6, atol=1e-6)
