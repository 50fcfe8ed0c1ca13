"""What XLA:CPU gets besides the plain maths: where its compiler runs the same computation
faster, the CPU backend writes it another way. The numbers are the same (exactly in float32;
in bfloat16 within a rounding of the cotangent, see ``matmul``). The host's malloc setting,
which must be in place before JAX starts, is in ``cpu_malloc.py``.

**Dense gradients.** The weight gradient ``x^T g`` of ``[R, I] @ [I, O]`` (contracting the R
rows) is emitted as a plain dot, not a library call, and that dot is about twice as fast when
its output has fewer rows than columns: ``[I, O]`` with I = 512 > O = 128 takes 10 ms where
``[O, I]`` takes 5.5 (4,096 rows, one core). XLA folds a plain transpose of the product back
into the dot, so for ``I > O`` the gradient is computed as ``(g^T x)`` behind an
``optimization_barrier`` and then transposed (a copy of the small kernel-sized result). Kernels
with I <= O take the plain product and its usual autodiff.

With inputs in a lower precision (bfloat16 compute), autodiff of the mixed product converts both
operands of each gradient product to float32 (the cotangent arrives in float32), so both
gradients ran at float32 speed after a conversion pass. The backward pass here keeps the
operands in the compute dtype: the cotangent is rounded to it (it is already exact there when
the layer's output is cast to the compute dtype, as ``Dense``'s is), and the weight gradient
contracts the rows split in two, ``[2, R/2, I] x [2, R/2, O]``: XLA hands a product over two
contracted axes to its matmul library, where bfloat16 runs at about twice the float32 rate,
while a product over the one row axis stays in its own dot emitter (4,096 rows, one core: 3.2
against 5.6 ms for ``[128, 512]``, 3.6 against 10.3 for ``[512, 128]``).

**A transposed operand kept as a copy** (``materialised``): the chunked attention kernel's
backward pass multiplies by k^T; folded into that product, the transpose sends it to XLA's own
emitter instead of the matmul library.

**The KV-cache write after the read** (``ordered_after``): decoding one row at batch 1 reads the
old cache and then writes the step's keys and values in place. Nothing in the data says the
write must wait for the read, so XLA:CPU's copy insertion kept the old cache alive with two
copies of each layer's cache per token; a zero computed from the attention output and added to
the written values makes the order a data dependency (the copies go).

**The decoding loop's compile options**: XLA:CPU splits a loop fusion across its threads when
its cost model expects a gain (the ``cpu-parallel-task-assigner`` pass). A decoding step's
elementwise passes are one token per row, ``[batch, width]``: handing half of one to the other
thread costs more than it saves (a 4-layer width-128 model at batch 8 on 2 cores: the MLP
activation 16 -> 3 us a call, the whole loop 1.19x faster). Training keeps the pass (its step
was 6% slower without it).

**Seeds trained together** (``map_seeds``, ``parallel/seeds.py``): one seed after another
inside one program (``lax.map``) rather than ``jax.vmap``'s batched products. The default
model (width 128, 4 layers, batch 16 x 128) on 2 cores, 8 seeds: the vmapped step took 1.7x
as long as 8 steps alone (and 8 seeds' activations at once), the mapped one 0.97x; a tiny
model (width 32, 1 layer, batch 8 x 32): both 0.8x (2026-12-06, a loaded host).

**Row groups** (``train.concurrent_groups``): XLA:CPU runs independent operations of one program
side by side on its threads, so a batch computed as groups of rows whose forward and backward
passes share nothing but the parameters keeps both threads busy where one large batch leaves
them waiting on each other's small operations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from transformers_jax.backends.generic import (
    ROWS_BY_IN,
    ROWS_BY_OUT,
    Backend,
    Maths,
    Programs,
    product,
    product_transposed,
    varying_axes,
)

DECODE_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "cpu-parallel-task-assigner"}
_HALVES_BY_HALVES = (((0, 1), (0, 1)), ((), ()))  # [2, R/2, I] x [2, R/2, O] -> [I, O]


def _with_backward(forward, backward):
    """``forward(x, w)`` with the custom ``backward((x, w), g) -> (dx, dw)``."""
    forward = jax.custom_vjp(forward)
    forward.defvjp(lambda x, w: (forward(x, w), (x, w)), backward)
    return forward


def _short_grad_backward(residuals, g_RO):
    x_RI, w_IO = residuals
    # the input gradient exactly as autodiff of the plain product computes it
    dx_RI = jax.vjp(lambda x: product(x, w_IO), x_RI)[1](g_RO)[0]
    # the kernel gradient as the transposed kernel's: a dot whose output is [O, I]
    w_OI = w_IO.T
    dw_OI = jax.vjp(lambda w: lax.dot_general(x_RI, w, ROWS_BY_OUT,
                                              preferred_element_type=jnp.float32), w_OI)[1](g_RO)[0]
    return dx_RI, lax.optimization_barrier(dw_OI).T


def _low_precision_backward(residuals, g_RO):
    x_RI, w_IO = residuals
    g_RO = g_RO.astype(x_RI.dtype)
    dx_RI = lax.dot_general(g_RO, w_IO, ROWS_BY_OUT, preferred_element_type=jnp.float32)
    if w_IO.shape[0] > w_IO.shape[1]:  # [out, in]: the transposed copy is of the smaller g
        dw_IO = lax.optimization_barrier(_rows_contracted(g_RO, x_RI)).T
    else:
        dw_IO = _rows_contracted(x_RI, g_RO)
    return (_summed_like(dx_RI.astype(x_RI.dtype), x_RI),
            _summed_like(dw_IO.astype(w_IO.dtype), w_IO))


def _transposed_rows_backward(residuals, g_RO):
    x_RI, w_OI = residuals
    g_RO = g_RO.astype(x_RI.dtype)
    dx_RI = lax.dot_general(g_RO, w_OI, ROWS_BY_IN, preferred_element_type=jnp.float32)
    dw_OI = _rows_contracted(g_RO, x_RI)
    return (_summed_like(dx_RI.astype(x_RI.dtype), x_RI),
            _summed_like(dw_OI.astype(w_OI.dtype), w_OI))


def _summed_like(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """``grad`` summed over the mesh axes it varies over and ``primal`` does not (inside
    ``shard_map``: a replicated kernel's gradient is the sum over the shards, as autodiff
    gives it; custom gradients must do it themselves)."""
    extra = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
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


_product_short_grad = _with_backward(product, _short_grad_backward)
_product_low_precision_grad = _with_backward(product, _low_precision_backward)
_product_transposed_rows_grad = _with_backward(product_transposed, _transposed_rows_backward)


def row_group(batch: dict, groups: int, index: int) -> dict:
    """Rows ``index, index + groups, ...`` of every ``[B, ...]`` array of ``batch``
    (interleaved, so a batch sharded over devices in contiguous blocks keeps every group local
    to its devices)."""
    for x in jax.tree.leaves(batch):
        if np.shape(x)[0] % groups:
            raise ValueError(f"a batch of {np.shape(x)[0]} rows cannot be split into {groups} "
                             f"equal row groups; use a batch size that is a multiple of {groups}")

    def take(x):
        x = jnp.asarray(x)
        return x.reshape(x.shape[0] // groups, groups, *x.shape[1:]).swapaxes(0, 1)[index]

    return jax.tree.map(take, batch)


class CpuMaths(Maths):
    """XLA:CPU's maths hooks, written as this module's docstring says."""

    def matmul(self, x_RI: jax.Array, w_IO: jax.Array) -> jax.Array:
        """``x_RI @ w_IO`` in float32 (inputs in the compute dtype), with the gradients where
        XLA:CPU runs them fastest: the kernel gradient in its faster orientation in float32,
        both gradients in the compute dtype below float32."""
        if x_RI.dtype != jnp.float32 and x_RI.dtype == w_IO.dtype:
            return _product_low_precision_grad(x_RI, w_IO)
        if w_IO.shape[0] > w_IO.shape[1]:
            return _product_short_grad(x_RI, w_IO)
        return product(x_RI, w_IO)

    def matmul_transposed(self, x_RI: jax.Array, w_OI: jax.Array) -> jax.Array:
        """``x_RI @ w_OI^T`` in float32. The kernel gradient contracts the halved rows straight
        into ``[V, C]`` (in any dtype: autodiff's one-axis product runs in XLA's own emitter,
        and one computed as ``[C, V]`` and transposed made the gradient norm's sum over it
        about 25x slower); below float32 both gradients take operands in the compute dtype,
        as ``matmul``'s."""
        if x_RI.dtype == w_OI.dtype:
            return _product_transposed_rows_grad(x_RI, w_OI)
        return product_transposed(x_RI, w_OI)

    def elementwise(self, fn: Callable[..., jax.Array], *xs: jax.Array) -> jax.Array:
        """``fn(*xs)`` in float32, back to ``xs[0]``'s dtype once: in bfloat16 XLA:CPU rounds
        after every operation of a GELU, forward and backward, in several passes over the
        ``[B, T, F]`` hidden. (On a TPU the float32 copy would be kept for the backward pass:
        generic.)"""
        out = fn(*(x.astype(jnp.float32) for x in xs))
        return out.astype(xs[0].dtype)

    def materialised(self, x: jax.Array) -> jax.Array:
        """``x`` behind an ``optimization_barrier``: XLA cannot fold it into the product."""
        return lax.optimization_barrier(x)

    def decode_reads_first(self, batch: int) -> bool:
        """Read first for one row: written first, XLA:CPU made a second copy of the cache at
        every step of a batch-1 loop (the copies, per layer and token, cost more than the
        attention); for several rows it updates the written cache in place."""
        return batch == 1

    def ordered_after(self, values: Any, read: jax.Array) -> Any:
        """``values`` plus a zero that depends on ``read``: finite by construction (a NaN or
        inf in ``read`` adds 0, not NaN)."""
        first = read.reshape(-1)[0]
        zero = jnp.where(jnp.isfinite(first), first * 0, 0)
        return jax.tree.map(lambda v: v + zero, values)


class CpuPrograms(Programs):
    """XLA:CPU's program policies, as this module's docstring says."""

    decode_compiler_options = DECODE_COMPILER_OPTIONS
    # CPU "devices" are one host's cores cut up (--xla_force_host_platform_device_count): one
    # program on one device already uses every core
    seeds_across_devices = False

    def check_row_groups(self, groups: int) -> None:
        """Any positive number of groups."""
        if groups < 1:
            super().check_row_groups(groups)

    def map_seed_inits(self, init: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """One seed after another (``lax.map``), as the step. XLA:CPU never finished a
        vmapped initialisation of a 2-layer LSTM of width 192 with a 4096-token vocabulary
        (jax 0.10.2: every worker thread idle, the program still in flight); mapped, it runs."""
        return lambda seeds: lax.map(init, seeds)

    def map_seeds(self, step: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """One seed after another inside the program (``lax.map``): each seed's step keeps the
        products of a run alone, and the program pays its dispatch and per-step costs once."""
        return lambda state, batch: lax.map(lambda pair: step(*pair), (state, batch))

    def sum_row_groups(self, sums_of: Callable[[Any, Any], Any], batch: dict, rng: Any,
                       groups: int) -> Any:
        """The sums of ``groups`` groups of rows (``row_group``), added; group ``i`` > 0 draws
        its randomness from ``fold_in(rng, i)``."""
        self.check_row_groups(groups)
        total = None
        for i in range(groups):
            part = batch if groups == 1 else row_group(batch, groups, i)
            key = rng if (i == 0 or rng is None) else jax.random.fold_in(rng, i)
            piece = sums_of(part, key)
            total = piece if total is None else jax.tree.map(jnp.add, total, piece)
        return total


def cpu_backend() -> Backend:
    """XLA:CPU's backend: ``CpuMaths`` and ``CpuPrograms``."""
    return Backend("cpu", CpuMaths(), CpuPrograms("cpu"))
