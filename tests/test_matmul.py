"""The CPU backend's Dense product (``backends.cpu``): gradients computed where XLA:CPU runs
them fastest. In float32 its gradients must equal plain autodiff exactly; in bfloat16 they
equal plain autodiff of a cotangent in the compute dtype, up to the order of summation. The
compiled program must hold the intended dots (else the speed-up is gone and nothing else would
say so)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformers_jax import backends
from transformers_jax.backends.generic import product

CPU = backends.for_platform("cpu")
matmul, matmul_transposed = CPU.maths.matmul, CPU.maths.matmul_transposed  # bound once: `is` works

SHAPES = [(64, 32, 8), (64, 8, 32), (16, 16, 16), (48, 24, 12), (15, 24, 12)]  # rows, in, out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows,n_in,n_out", SHAPES)
def test_value_and_gradients_equal_the_plain_product(rows, n_in, n_out, dtype):
    kx, kw, kg = jax.random.split(jax.random.key(rows + n_in + n_out), 3)
    x = jax.random.normal(kx, (rows, n_in)).astype(dtype)
    w = jax.random.normal(kw, (n_in, n_out)).astype(dtype)
    g = jax.random.normal(kg, (rows, n_out))

    def value_and_grads(f, g):
        y, pullback = jax.vjp(f, x, w)
        return (y, *pullback(g))

    ours = jax.jit(lambda: value_and_grads(matmul, g))()
    if dtype == jnp.float32:
        plain = jax.jit(lambda: value_and_grads(product, g))()
    else:  # the cotangent in the compute dtype (a Dense layer's output already is)
        plain = jax.jit(lambda: value_and_grads(product, g.astype(dtype).astype(g.dtype)))()
    for a, b in zip(ours, plain, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if dtype == jnp.float32:
            np.testing.assert_array_equal(a, b)
        else:  # float32 sums in another order, rounded to bfloat16: within one rounding
            ulp = 2.0**-7
            np.testing.assert_allclose(a, b, rtol=ulp, atol=ulp * np.abs(b).max())


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


def _compiled_pullback(product, x, w, g) -> str:
    """The ENTRY computation of the compiled gradients of ``product(x, w)`` for cotangent g."""
    pullback = jax.jit(lambda x, w, g: jax.vjp(product, x, w)[1](g))
    text = pullback.lower(x, w, g).compile().as_text()
    entry = text[text.index("\nENTRY "):]
    return entry[: entry.index("\n}")]


@pytest.mark.parametrize("n_in,n_out", [(96, 32), (32, 96)])
def test_bfloat16_gradients_take_bfloat16_operands_and_halved_rows_on_cpu(n_in, n_out):
    entry = _compiled_pullback(matmul, jnp.ones((256, n_in), jnp.bfloat16),
                               jnp.ones((n_in, n_out), jnp.bfloat16), jnp.ones((256, n_out)))
    # both gradients are library products (the halved rows make XLA hand the weight gradient
    # to its library; over the one row axis it stays in its own float32-speed emitter) ...
    assert entry.count("__ynn_fusion") == 2, entry
    assert not re.search(r" dot\(", entry), entry
    # ... and neither widens an activation-sized operand to float32
    assert not re.search(r"= f32\[256,\d+\]\{[^}]*\} (convert|fusion)\((?!.*ynn)", entry), entry


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [64, 15])
def test_the_transposed_product_and_its_gradients(rows, dtype):
    # a tied output projection: x [R, C] against the token table [V, C]
    kx, kw, kg = jax.random.split(jax.random.key(rows), 3)
    x = jax.random.normal(kx, (rows, 24)).astype(dtype)
    table = jax.random.normal(kw, (40, 24)).astype(dtype)
    g = jax.random.normal(kg, (rows, 40)).astype(dtype).astype(jnp.float32)

    def value_and_grads(f):
        y, pullback = jax.vjp(f, x, table)
        return (y, *pullback(g))

    ours = jax.jit(lambda: value_and_grads(matmul_transposed))()
    plain = jax.jit(lambda: value_and_grads(lambda x, w: product(x, w.T)))()
    for a, b in zip(ours, plain, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        ulp = 2.0**-7 if dtype == jnp.bfloat16 else 1e-6  # float32: only the summation order
        np.testing.assert_allclose(a, b, rtol=ulp, atol=ulp * np.abs(b).max())


def test_the_transposed_products_kernel_gradient_is_a_table_shaped_library_product():
    entry = _compiled_pullback(matmul_transposed, jnp.ones((256, 24)), jnp.ones((96, 24)),
                               jnp.ones((256, 96)))
    # [V, C] straight from the product (a [C, V] one transposed slowed the norm's sum 25x)
    assert re.search(r"= f32\[96,24\]\{1,0\} fusion\([^\n]*__ynn_fusion", entry), entry
    assert not re.search(r" dot\(", entry), entry


@pytest.mark.parametrize("product", [matmul, matmul_transposed])
def test_inside_shard_map_a_replicated_kernels_gradient_is_summed_over_shards(product):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("data",))
    x = jax.random.normal(jax.random.key(0), (32, 16)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (16, 8) if product is matmul else (8, 16))
    w = w.astype(jnp.bfloat16)

    def loss(x, w):
        return jnp.sum(product(x, w) ** 2)

    sharded = jax.shard_map(jax.grad(loss, argnums=1), mesh=mesh, in_specs=(P("data"), P()),
                            out_specs=P(), check_vma=True)
    whole = jax.grad(loss, argnums=1)(x, w)
    x_sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    w_replicated = jax.device_put(w, NamedSharding(mesh, P()))
    whole = np.asarray(whole, np.float32)  # bfloat16 partial sums: a few roundings apart
    np.testing.assert_allclose(np.asarray(jax.jit(sharded)(x_sharded, w_replicated), np.float32),
                               whole, rtol=2.0**-6, atol=2.0**-6 * np.abs(whole).max())


def test_a_dense_layer_trains_the_same_with_either_product():
    import flax.linen as nn

    from transformers_jax.nn.layers import Dense

    layer = Dense((8,), ("embed", "mlp"), use_bias=True)
    x = jax.random.normal(jax.random.key(0), (4, 5, 24))
    params = nn.unbox(layer.init(jax.random.key(1), x)["params"])
    grads = jax.grad(lambda p: (layer.apply({"params": p}, x) ** 2).sum())(params)
    kernel = params["kernel"]

    def plain(k, b):
        return product(x.reshape(-1, 24), k) + b

    want = jax.grad(lambda k, b: (plain(k, b) ** 2).sum(), argnums=(0, 1))(kernel, params["bias"])
    np.testing.assert_allclose(grads["kernel"], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grads["bias"], want[1], rtol=1e-6, atol=1e-6)
