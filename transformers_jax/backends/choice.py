"""Which backend a program gets: the one of the platform it is compiled for, decided by one
rule (``platform_compiled_for``), and the backend-neutral functions the model calls."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax

from transformers_jax.backends.cpu import cpu_backend
from transformers_jax.backends.generic import Backend

# One backend per platform: XLA:CPU's own; TPU and GPU (and any other) the plain maths.
BACKENDS: dict[str, Backend] = {"cpu": cpu_backend(), "tpu": Backend("tpu"),
                                "gpu": Backend("gpu")}


def _named(platform: str) -> str:
    return "gpu" if platform in ("cuda", "rocm") else platform


def platform_of(device: Any) -> str:
    """A device's JAX platform (``cpu``, ``tpu``, ``gpu``; ``cuda`` and ``rocm`` read ``gpu``).
    Devices of a compile-only topology (``jax.experimental.topologies``) count as what they
    describe, not as this host."""
    return _named(device.platform)


def platform_compiled_for() -> str:
    """The platform the computation now being traced is compiled for: that of the mesh in
    context (``jax.set_mesh``, a ``shard_map``, ``jax.sharding.use_abstract_mesh``: every step
    that ``parallel.make_trainer`` builds traces under its mesh), so a compile for a TPU
    topology from a CPU host gets the TPU program; else ``jax.default_backend()``."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return _named(jax.default_backend() if device is None else device.platform)


def for_platform(platform: str) -> Backend:
    """The backend of ``platform`` (``cpu``, ``tpu``, ``gpu``): the generic one where the
    platform adds nothing."""
    backend = BACKENDS.get(platform)
    if backend is None:  # a platform we know nothing of: the plain maths
        backend = BACKENDS[platform] = Backend(platform)
    return backend


def for_devices(devices: Iterable[Any]) -> Backend:
    """The backend of the platform of ``devices`` (a mesh's: ``mesh.devices.flat``)."""
    platforms = {platform_of(d) for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"devices of one platform expected, got {sorted(platforms) or 'none'}")
    return for_platform(platforms.pop())


def current() -> Backend:
    """The backend of the program now being traced (``platform_compiled_for``)."""
    return for_platform(platform_compiled_for())


# The backend-neutral calls of the model path: each is the current backend's maths hook, whose
# plain form (``generic.Maths``) is the maths itself.
def matmul(x_RI: jax.Array, w_IO: jax.Array) -> jax.Array:
    """``x_RI @ w_IO`` ``[R, O]`` with float32 sums (``Maths.matmul``)."""
    return current().maths.matmul(x_RI, w_IO)


def matmul_transposed(x_RI: jax.Array, w_OI: jax.Array) -> jax.Array:
    """``x_RI @ w_OI^T`` ``[R, O]`` with float32 sums (``Maths.matmul_transposed``)."""
    return current().maths.matmul_transposed(x_RI, w_OI)


def elementwise(fn: Callable[..., jax.Array], *xs: jax.Array) -> jax.Array:
    """``fn(*xs)``, an activation, in ``xs[0]``'s dtype (``Maths.elementwise``)."""
    return current().maths.elementwise(fn, *xs)


def materialised(x: jax.Array) -> jax.Array:
    """``x``, which a product reads next (``Maths.materialised``)."""
    return current().maths.materialised(x)


def decode_reads_first(batch: int) -> bool:
    """Whether a one-token decoding step reads its cache before writing
    (``Maths.decode_reads_first``)."""
    return current().maths.decode_reads_first(batch)


def ordered_after(values: Any, read: jax.Array) -> Any:
    """``values``, to be written where ``read`` was read from (``Maths.ordered_after``)."""
    return current().maths.ordered_after(values, read)
