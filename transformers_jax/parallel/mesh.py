"""Device meshes from a one-line spec such as ``"data=4,fsdp=2,tensor=1"``.

Every mesh here has the same four named axes, in this order:

- ``data``: pure data parallelism (parameters replicated, batch split);
- ``fsdp``: data parallelism that also shards parameters and optimizer state (ZeRO-3 style);
- ``context``: context (sequence) parallelism: every activation's length split, attention
  computed across the shards (``parallel/context.py``); strategy ``jit`` only;
- ``tensor``: tensor (model) parallelism over attention heads, MLP width and vocabulary.

Axes left out of the spec have size 1; one axis may be ``-1`` to take the remaining devices.
A spec is written back (``format_mesh``) without ``context`` when it is 1, so every mesh
without context parallelism keeps the spelling it had before the axis existed.
Meshes are built with ``AxisType.Auto`` on every axis (classic GSPMD propagation): the current
``jax.make_mesh`` default is ``Explicit``, which changes how unsharded inputs are treated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

from transformers_jax.config import ConfigError

MESH_AXES = ("data", "fsdp", "context", "tensor")
CONTEXT_AXIS = "context"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_mesh(spec: str | Mapping[str, int] | None, n_devices: int) -> dict[str, int]:
    """``"data=4,fsdp=2"`` -> ``{"data": 4, "fsdp": 2, "context": 1, "tensor": 1}`` for
    ``n_devices`` devices.

    ``None``, ``""`` or ``"auto"`` put every device on ``data``. The product of the sizes must
    equal ``n_devices``; errors say what was wrong and suggest a shape that works.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "auto")):
        return {"data": n_devices, "fsdp": 1, "context": 1, "tensor": 1}
    if isinstance(spec, Mapping):
        items = [(str(k), str(v)) for k, v in spec.items()]
        text = ",".join(f"{k}={v}" for k, v in items)
    else:
        text = spec
        items = []
        for part in spec.split(","):
            if not part.strip():
                continue
            name, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(
                    f"mesh={spec!r}: {part.strip()!r} is not NAME=SIZE; write the mesh as "
                    "comma-separated NAME=SIZE pairs, e.g. 'data=4,fsdp=2,tensor=1'"
                )
            items.append((name.strip(), value.strip()))
    sizes: dict[str, int] = {}
    for name, value in items:
        if name not in MESH_AXES:
            raise ConfigError(
                f"mesh={text!r}: unknown mesh axis {name!r}; valid axes: {', '.join(MESH_AXES)}"
            )
        if name in sizes:
            raise ConfigError(f"mesh={text!r}: axis {name!r} is given twice")
        try:
            size = int(value)
        except ValueError:
            raise ConfigError(
                f"mesh={text!r}: size {value!r} of axis {name!r} is not an integer"
            ) from None
        if size == 0 or size < -1:
            raise ConfigError(
                f"mesh={text!r}: size of axis {name!r} must be a positive integer "
                "(or -1 for 'all remaining devices')"
            )
        sizes[name] = size
    inferred = [name for name, size in sizes.items() if size == -1]
    if len(inferred) > 1:
        raise ConfigError(f"mesh={text!r}: only one axis may be -1, got {inferred}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if inferred:
        if n_devices % known:
            raise ConfigError(
                f"mesh={text!r}: the fixed axes use {known} devices, which does not divide the "
                f"{n_devices} available; make their product one of {_divisors(n_devices)}"
            )
        sizes[inferred[0]] = n_devices // known
    shape = {name: sizes.get(name, 1) for name in MESH_AXES}
    if math.prod(shape.values()) != n_devices:
        rest = math.prod(size for name, size in shape.items() if name != "data")
        example = (
            {**shape, "data": n_devices // rest} if n_devices % rest == 0
            else {"data": n_devices}
        )
        raise ConfigError(
            f"mesh={text!r}: the axis sizes multiply to {math.prod(shape.values())} but there "
            f"are {n_devices} devices; choose sizes whose product is {n_devices}, e.g. "
            f"{format_mesh(example)!r}, or give one axis -1 to take the remaining devices"
        )
    return shape


def format_mesh(shape: Mapping[str, int]) -> str:
    """The spec string of a shape dict: ``data=4,fsdp=2,tensor=1`` (``context`` only when it
    is not 1: ``data=2,fsdp=1,context=4,tensor=1``). Axes missing from ``shape`` are 1."""
    return ",".join(f"{name}={shape.get(name, 1)}" for name in MESH_AXES
                    if name != CONTEXT_AXIS or shape.get(name, 1) != 1)


def make_mesh(
    spec: str | Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``data x fsdp x context x tensor`` mesh over ``devices`` (default: every device of every
    process), all axes ``AxisType.Auto``."""
    devices = list(jax.devices() if devices is None else devices)
    shape = parse_mesh(spec, len(devices))
    return jax.make_mesh(
        tuple(shape[name] for name in MESH_AXES),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
    )


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """Axis name -> size; every axis of ``MESH_AXES`` (1 where the mesh lacks it)."""
    return {**dict.fromkeys(MESH_AXES, 1),
            **dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))}
