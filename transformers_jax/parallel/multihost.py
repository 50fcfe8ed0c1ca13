"""Several processes, one program: start-up, per-host batches, and who writes logs.

On a TPU VM slice or a GPU cluster (SLURM, Open MPI, Kubernetes with the right environment)
``initialize()`` with no arguments lets JAX discover the coordinator, the number of processes
and this process's id. Anywhere else (and in tests: several processes on one machine) pass them
explicitly; on CPU the cross-process collectives then go through gloo.

After start-up every process runs the same program on global arrays. Each process supplies only
the rows of the global batch that live on its own devices (``local_rows``), and
``jax.make_array_from_process_local_data`` stitches the pieces into one global array.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from transformers_jax.config import ConfigError

# A process silent this long is declared dead and the others stop with an error (JAX's own
# default is 100 s). Short enough that a preempted host does not hold the others for minutes,
# long enough for a slow compile or a checkpoint write (heartbeats come from a separate
# thread, so a long step does not stop them).
HEARTBEAT_TIMEOUT_S = 60
SHUTDOWN_TIMEOUT_S = 120


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: list[int] | None = None,
    cpu_collectives: str | None = "gloo",
    timeout_s: int = 300,
    heartbeat_timeout_s: int | None = None,
    shutdown_timeout_s: int | None = None,
) -> None:
    """Join (or start) the multi-process JAX runtime. Call before any other JAX operation.

    No arguments: auto-detect (TPU VMs, SLURM, Open MPI, ...). Explicit: all three of
    ``coordinator_address`` (``"host:port"`` of process 0), ``num_processes`` and
    ``process_id``. ``cpu_collectives`` (``"gloo"``, or None to leave JAX's default) is set
    before start-up so that CPU devices of different processes can talk to each other.
    Calling it again once initialised does nothing.

    A lost process: every process sends heartbeats to the coordination service (hosted by
    process 0); one silent for ``heartbeat_timeout_s`` (default ``HEARTBEAT_TIMEOUT_S``, or
    the environment variable ``TJAX_HEARTBEAT_TIMEOUT_S``) is declared dead and the others
    are stopped with an error instead of waiting forever in their next collective. Then the
    same command, run again, resumes every process from the last checkpoint.
    ``shutdown_timeout_s`` bounds the wait for the others at exit (default
    ``SHUTDOWN_TIMEOUT_S`` or ``TJAX_SHUTDOWN_TIMEOUT_S``).
    """
    if jax.distributed.is_initialized():
        return
    explicit = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    given = [k for k, v in explicit.items() if v is not None]
    if given and len(given) != len(explicit):
        missing = [k for k in explicit if k not in given]
        raise ConfigError(
            f"multi-host start-up got {', '.join(given)} but not {', '.join(missing)}: pass all "
            "three (coordinator 'host:port', process count, this process's id) or none of "
            "them to auto-detect the cluster"
        )
    if given:
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ConfigError(
                f"process_id={process_id}, num_processes={num_processes}: need "
                "num_processes >= 1 and 0 <= process_id < num_processes"
            )
        if ":" not in coordinator_address:
            raise ConfigError(
                f"coordinator_address={coordinator_address!r}: expected 'host:port', e.g. "
                "'10.0.0.1:1234' (process 0 listens there)"
            )
    heartbeat = _seconds(heartbeat_timeout_s, "TJAX_HEARTBEAT_TIMEOUT_S", HEARTBEAT_TIMEOUT_S)
    shutdown = _seconds(shutdown_timeout_s, "TJAX_SHUTDOWN_TIMEOUT_S", SHUTDOWN_TIMEOUT_S)
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=timeout_s,
        heartbeat_timeout_seconds=heartbeat,
        shutdown_timeout_seconds=shutdown,
    )


def _seconds(value: int | None, env: str, default: int) -> int:
    if value is None:
        text = os.environ.get(env)
        if text is None:
            return default
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"{env}={text!r}: expected a whole number of seconds") from None
    if value <= 0:
        raise ConfigError(f"{env.removeprefix('TJAX_').lower()}={value}: must be positive")
    return value


def is_main_process() -> bool:
    """Only process 0 prints progress and writes metrics files and logs."""
    return jax.process_index() == 0


def agrees_on_stops() -> bool:
    """Whether stop notices go through JAX's preemption service (``stop_agreed``): in a
    multi-process run with the service on (``jax_enable_preemption_service``, JAX's default)."""
    from jax._src import distributed

    return (jax.process_count() > 1
            and distributed.global_state.preemption_sync_manager is not None)


def stop_agreed(step: int) -> bool:
    """Whether every process is to stop after ``step`` because one of them got a stop notice
    (SIGTERM: a preemption, or a Ctrl-C turned into one). The preemption service passes the
    notice to every process and names one step, the same on all, where each gets True: each
    then saves its shards of one checkpoint and stops. Call it once per step, from the same
    first step on every process, and only where ``agrees_on_stops()``."""
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))


def local_rows(sharding: Sharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous block of global batch rows held by this process's devices.

    Raises if this process's rows are not one contiguous block (a mesh whose device order
    interleaves processes along the batch axis); ``jax.make_mesh`` orders devices so that they
    are.
    """
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        rows = index[0] if index else slice(None)
        start, stop, _ = rows.indices(global_shape[0])
        starts.append(start)
        stops.append(stop)
    start, stop = min(starts), max(stops)
    covered = np.zeros(global_shape[0], bool)
    for a, b in zip(starts, stops, strict=True):
        covered[a:b] = True
    if not covered[start:stop].all():
        raise ValueError(
            f"this process's batch rows are not contiguous (devices hold rows "
            f"{sorted(zip(starts, stops, strict=True))}); build the mesh with jax.make_mesh / "
            "parallel.make_mesh so that each host's devices are neighbours on the batch axes"
        )
    return slice(start, stop)


def global_batch(batch: dict, shardings: dict[str, Sharding], *, local: bool = False) -> dict:
    """Global arrays from a host batch.

    ``local=False``: ``batch`` is the whole global batch (every process may build it; each
    keeps only its own rows). ``local=True``: ``batch`` holds only this process's rows, as
    given by ``local_rows``; the global batch size is inferred from the process count.
    """
    out: dict[str, Any] = {}
    for key, value in batch.items():
        value = np.asarray(value)
        sharding = shardings[key]
        if jax.process_count() == 1:
            out[key] = jax.device_put(value, sharding)
            continue
        if local:
            global_shape = (value.shape[0] * jax.process_count(), *value.shape[1:])
            piece = value
        else:
            global_shape = value.shape
            piece = value[local_rows(sharding, global_shape)]
        out[key] = jax.make_array_from_process_local_data(sharding, piece, global_shape)
    return out


def fetch(tree: Any) -> Any:
    """Numpy copies of (possibly multi-process, sharded) global arrays, on every process."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def allgather_json(value: Any) -> list[Any]:
    """Every process's ``value`` (JSON-serialisable), in process order, on every process: what
    each host alone knows (its input-pipeline position) saved where process 0 writes."""
    import json

    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([data.size], np.int64))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded[None], tiled=True)
    return [json.loads(bytes(row[: int(n)]).decode())
            for row, n in zip(rows, np.ravel(sizes), strict=True)]
