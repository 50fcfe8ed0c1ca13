"""What a platform adds to the programs compiled for it: the one seam between the model's maths
and a compiler's needs.

The model path (``nn/``, ``models/``) is written for any platform: a plain ``dot_general``,
the attention formula. Where one platform's compiler runs the same computation faster written
another way, the model calls a backend-neutral function here, and the backend of the platform
being compiled for supplies it. Each call's plain form (``generic.py``) is what TPU and GPU
programs get; what XLA:CPU gets instead is in ``cpu.py``:

- ``matmul(x, w)``, ``matmul_transposed(x, w)`` (``Dense``, the tied output layer): a
  ``dot_general`` with float32 sums. CPU: the same product with custom gradients (the kernel
  gradient in its faster orientation; below float32, operands kept in the compute dtype).
- ``elementwise(fn, *xs)`` (the MLP's activation): ``fn(*xs)`` in the compute dtype. CPU: in
  float32, rounded back once (in bfloat16 XLA:CPU rounds after every operation; on a TPU the
  float32 copy would be kept for the backward pass, about 20 GB more for GPT-2 XL on v5p).
- ``materialised(x)`` (the chunked attention's k^T): ``x``. CPU: behind an optimization
  barrier, so the transpose is not folded into the product that reads it.
- ``decode_reads_first(batch)`` (a decoding step's order, ``nn/kvcache.py``): write the new
  token, then attend over the cache. CPU, for one row: attend over the cache as it was plus the
  token, then write (written first, XLA:CPU copied the cache at every step).
- ``ordered_after(kv, out)`` (a batch-1 decoding step's cache write): ``kv``. CPU: plus a zero
  computed from ``out``, so the in-place write visibly follows the read.

These are a backend's ``maths`` (``generic.Maths``). Around the model, its ``programs``
(``generic.Programs``): the decoding loop's compile options (``decode_compiler_options``, read
by ``sample.generate_tokens``), the training step's row groups (``train.concurrent_groups``:
``sum_row_groups``; other platforms refuse more than one group), how the step of seeds trained
together maps over them (``map_seeds``: ``jax.vmap``; CPU: ``lax.map``) and whether they spread
over devices. And the host's malloc setting (``prepare_host``, before JAX starts;
``cpu_malloc.py``).

Named calls rather than a rewrite of the traced program from outside: a rewrite would find
Dense's products by the shape of a ``dot_general`` (catching any 2-D product, and changing its
bfloat16 rounding), re-interpret every nested program (scan, remat, custom_vjp, shard_map) at
about twice the tracing cost, and still could not say where a cache write must follow a read
or which transpose to keep: those are not substitutions of one primitive.

The backend is chosen by one rule, ``platform_compiled_for``: the platform of the devices of the
mesh the program is traced under (every step that ``parallel.make_trainer`` builds is traced
under its mesh, so ``tjax plan`` for a TPU from a CPU host gets the TPU program), else JAX's
default backend. A step whose shape depends on the backend (row groups, compile options) asks
for it once when it is built (``for_devices``, ``current``); the neutral calls ask while the
model is traced, under the same rule. TPU and GPU add nothing: their backend is the generic one.

Names load on first use (PEP 562): ``prepare_host`` and ``cpu_malloc`` import no JAX, so an
entry point re-executes itself with the malloc setting before it pays for JAX's start-up.
"""

from __future__ import annotations

import os

from transformers_jax.lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    **{name: "transformers_jax.backends.generic" for name in (
        "Backend", "Maths", "Programs", "varying_axes")},
    **{name: "transformers_jax.backends.choice" for name in (
        "BACKENDS", "current", "decode_reads_first", "elementwise", "for_devices",
        "for_platform", "matmul",
        "matmul_transposed", "materialised", "ordered_after", "platform_compiled_for",
        "platform_of")},
}
__all__ = sorted([*_EXPORTS, "prepare_host"])


def prepare_host() -> str:
    """Set this process up for the platform it computes on; call it first thing in a program's
    entry point, never from library code: it may re-execute the process. Where XLA:CPU
    computes (``JAX_PLATFORMS`` unset or naming ``cpu`` first), that is the CPU backend's
    malloc setting (``cpu_malloc.relaunch_with_tunables``); returns what the process runs
    with (``cpu_malloc.status``). ValueError for a ``TJAX_HOST_MALLOC`` it does not know."""
    from transformers_jax.backends import cpu_malloc

    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms and platforms.split(",")[0].strip().lower() != "cpu":
        return f"system default (JAX_PLATFORMS={platforms})"
    return cpu_malloc.relaunch_with_tunables()


__getattr__, __dir__ = lazy_exports("transformers_jax.backends", _EXPORTS, globals())

