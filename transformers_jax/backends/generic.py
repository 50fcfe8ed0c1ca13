"""The backend every platform starts from: the plain maths, as JAX writes it.

TPU and GPU programs are what plain JAX makes of the model, so their backend is this one as it
is; a platform whose compiler needs something else overrides a hook (``cpu.py``). Each hook's
default here is the definition the model means, so a reader of ``Dense`` or of an attention
kernel can take the hook for what this file does. The hooks come in two kinds: ``Maths``, called
while the model is traced, and ``Programs``, asked by whoever builds a program around it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from transformers_jax.config import ConfigError

ROWS_BY_IN = (((1,), (0,)), ((), ()))  # [R, I] x [I, O] -> [R, O]
ROWS_BY_OUT = (((1,), (1,)), ((), ()))  # [R, I] x [O, I] -> [R, O]


def product(x_RI: jax.Array, w_IO: jax.Array) -> jax.Array:
    """``x_RI @ w_IO`` ``[R, O]`` with float32 sums whatever the inputs' dtype."""
    return lax.dot_general(x_RI, w_IO, ROWS_BY_IN, preferred_element_type=jnp.float32)


def product_transposed(x_RI: jax.Array, w_OI: jax.Array) -> jax.Array:
    """``x_RI @ w_OI^T`` ``[R, O]`` with float32 sums (a tied output projection: the kernel is
    the token table ``[V, C]``)."""
    return lax.dot_general(x_RI, w_OI, ROWS_BY_OUT, preferred_element_type=jnp.float32)


def varying_axes(*trees: Any) -> frozenset:
    """The mesh axes any leaf of ``trees`` varies over inside ``shard_map`` (else none): what a
    custom gradient or a loop carry must agree with under ``check_vma=True``."""
    def axes(x) -> frozenset:  # ShapedArray.vma in older JAX, .mat.varying since 0.9
        aval = jax.typeof(x)
        return frozenset(getattr(getattr(aval, "mat", None), "varying", None)
                         or getattr(aval, "vma", None) or ())

    return frozenset().union(*(axes(x) for x in jax.tree.leaves(trees)))


class Maths:
    """The hooks a traced function calls (``Dense``, the MLP, attention kernels, the cache):
    here each is the plain computation, which TPU and GPU programs get as it is."""

    def matmul(self, x_RI: jax.Array, w_IO: jax.Array) -> jax.Array:
        """The product under every ``Dense``: ``x_RI @ w_IO`` in float32 (``product``), with
        the gradients autodiff gives it."""
        return product(x_RI, w_IO)

    def matmul_transposed(self, x_RI: jax.Array, w_OI: jax.Array) -> jax.Array:
        """``x_RI @ w_OI^T`` in float32 (``product_transposed``), the gradients autodiff's."""
        return product_transposed(x_RI, w_OI)

    def elementwise(self, fn: Callable[..., jax.Array], *xs: jax.Array) -> jax.Array:
        """``fn(*xs)`` (an activation: elementwise, result in ``xs[0]``'s dtype), computed as
        written, in the arrays' own dtype. A backend whose compiler rounds a lower precision
        after every operation may compute it in float32 and round once."""
        return fn(*xs)

    def materialised(self, x: jax.Array) -> jax.Array:
        """``x`` itself. A kernel hands over a transposed operand here: a backend whose
        compiler runs the product faster from a copy in that layout than with the transpose
        folded into it may keep the copy."""
        return x

    def decode_reads_first(self, batch: int) -> bool:
        """Whether a decoding step of ``batch`` rows attends over its cache as it was plus the
        new token, then writes the token (``nn.kvcache.RowSlot.read_first``), rather than
        writing first and attending over the written cache. The two give the same numbers;
        written first is the plain order, which a compiler updates in place."""
        del batch
        return False

    def ordered_after(self, values: Any, read: jax.Array) -> Any:
        """``values`` (the keys and values a decoding step writes into its cache) as they are.
        ``read`` is the attention output that read the old cache: a backend whose compiler
        cannot see that the write must follow the read (and copies the cache to be safe) may
        tie the written values to it."""
        del read
        return values


class Programs:
    """The policies a runner asks when it builds a program around the model: the decoding
    loop's compile options, how a training step splits its rows, how seeds trained together
    map over the seeds and spread over devices. Here: the plain program, one of each."""

    # Options for the compiler of the decoding loop (``sample.generate_tokens``).
    decode_compiler_options: Mapping[str, str] = MappingProxyType({})
    # Seeds trained together spread over the devices by default (``parallel.seeds``), each
    # device its own seeds: devices that compute apart gain a seed each.
    seeds_across_devices: bool = True

    def __init__(self, platform: str):
        self.platform = platform  # named in a refusal

    def check_row_groups(self, groups: int) -> None:
        """Refuse ``train.concurrent_groups`` > 1, an XLA:CPU setting: it splits each batch into
        groups of rows whose forward and backward passes are independent, so that XLA:CPU's
        thread pool runs them side by side. An accelerator runs one large batch at least as
        well, so the setting would only make the program longer: a clear error rather than a
        silent no-op, since a config that asks for it was written for a CPU."""
        if groups < 1:
            raise ConfigError(f"train.concurrent_groups={groups}: must be a positive integer")
        if groups > 1:
            raise ConfigError(
                f"train.concurrent_groups={groups}: row groups computed side by side are an "
                f"XLA:CPU setting (its threads run the independent groups together); the "
                f"devices compiled for are {self.platform} devices, which gain nothing from "
                "them: leave train.concurrent_groups at 1 for them")

    def sum_row_groups(self, sums_of: Callable[[Any, Any], Any], batch: dict, rng: Any,
                       groups: int) -> Any:
        """``sums_of(batch, rng)``: a pytree of sums over ``batch`` (a training step's weighted
        loss sums), computed as ``groups`` groups of rows and added up. One group here."""
        self.check_row_groups(groups)
        return sums_of(batch, rng)

    def map_seed_inits(self, init: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``init(seed)`` of one seed as a function of stacked seeds (``parallel.seeds``):
        ``jax.vmap``, as the step."""
        return jax.vmap(init)

    def map_seeds(self, step: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """``step(state, batch)`` of one seed, as a function of states and batches stacked on a
        leading seed axis (``parallel.seeds``): ``jax.vmap``, every operation over all the
        seeds at once, so that an accelerator's units fill with S times the work."""
        return jax.vmap(step)


class Backend:
    """What a platform contributes to the programs compiled for it, in two parts: ``maths``,
    the hooks traced into the model's computation, and ``programs``, the policies asked when
    a program is built around it. Both plain by default, which TPU and GPU take as they are;
    one instance per platform (``backends.for_platform``)."""

    def __init__(self, platform: str, maths: Maths | None = None,
                 programs: Programs | None = None):
        self.platform = platform  # the JAX platform compiled for: cpu, tpu, gpu
        self.maths = Maths() if maths is None else maths
        self.programs = Programs(platform) if programs is None else programs

    @property
    def generic(self) -> bool:
        """Whether the platform adds nothing: the plain maths and the plain programs."""
        return type(self.maths) is Maths and type(self.programs) is Programs

    def __repr__(self) -> str:
        return (f"<backend for {self.platform}: {type(self.maths).__name__}, "
                f"{type(self.programs).__name__}>")
