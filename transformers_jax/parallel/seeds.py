"""Seeds trained together: S copies of one device's training step compiled as one program.

``stack_seeds(trainer, S)`` takes a ``single`` trainer (``make_trainer``) and maps its own step
function (``ParallelTrainer.step_fn``) over a leading seed axis: every leaf of the state (step
counter, parameters, optimizer state, RNG key data) and of the batch gains that axis,
``[S, ...]``, and seed s's slice evolves as that seed's state would alone. How the step maps
over the seeds is the backend's (``Programs.map_seeds``): ``jax.vmap`` for TPU and GPU, every
operation over all the seeds at once, so that S times the work fills the chip; one seed after
another in the same program (``lax.map``) on XLA:CPU, where the batched products ran slower
than the same products one seed at a time. The arithmetic is the same; XLA may fuse and round
some operations differently, so the agreement is to float tolerance, not bit for bit
(``tests/test_seeds.py`` states it).

Across devices: ``stack_seeds(trainer, S, devices=[...])`` lays the seed axis over a ``seed``
mesh axis of those devices, each holding S/n whole seeds (``shard_map``: no seed's arrays are
split, and no value crosses devices), so on 8 chips 8 seeds train at once in one program, each
chip its own, mapped over its seeds as its backend does. The single-device step's mesh-bound
constraints are left out there (``ParallelTrainer.step_fn`` carries none for ``single``: on
one device they constrain nothing).

Why: a small model leaves much of a device idle each step, and each step pays its dispatch
and per-step overheads. One program for S seeds pays those once for all S, and on an
accelerator gives every operation S times the work. ``train.seeds.train_seeds`` runs it; ``tjax
plan --seeds S`` compiles it for a target.

Shape legend: S seeds, B batch, T length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformers_jax import backends
from transformers_jax.config import ConfigError
from transformers_jax.learning.step import TrainState
from transformers_jax.parallel.strategies import ParallelTrainer

SEED_AXIS = "seed"


@dataclasses.dataclass
class SeedsTrainer:
    """``trainer``'s step over ``seeds`` stacked states (see the module docstring).

    ``state = seeds.stack([state_0, ..., state_{S-1}])``; ``state, metrics =
    seeds.step(state, seeds.place_batch([batch_0, ...]))`` (metrics: ``[S]`` arrays);
    ``seeds.unstack(state, s)`` is seed s's plain ``TrainState``. Ahead of time:
    ``seeds.lower(seeds.abstract_state(), seeds.abstract_batch(batch))`` for a batch of one
    seed's shapes.
    """

    trainer: ParallelTrainer
    seeds: int
    _step: Callable
    mesh: Mesh | None = None  # the ``seed`` axis over several devices; None: the trainer's one
    backend: backends.Backend | None = None  # maps over the seeds (default: the device's)

    @property
    def sharding(self) -> NamedSharding:
        """Where every stacked array lives: the trainer's one device, or seed slices over the
        ``seed`` mesh axis."""
        if self.mesh is None:
            return NamedSharding(self.trainer.mesh, P())
        return NamedSharding(self.mesh, P(SEED_AXIS))

    @property
    def devices(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    def traced(self):
        """The context the stacked programs are traced in: the trainer's on one device; none
        over a seed mesh (each seed's step is one device's, within ``shard_map``)."""
        return self.trainer.traced() if self.mesh is None else contextlib.nullcontext()

    def init(self, seeds: Sequence[int]) -> TrainState:
        """The stacked initial states of ``seeds`` (``len(seeds) == self.seeds``), one program
        for all (one compile, not one per seed); seed s's slice equals
        ``trainer.init_state(s)``."""
        if len(seeds) != self.seeds:
            raise ValueError(f"{len(seeds)} seeds for a program of {self.seeds}")
        backend = self.backend or backends.for_devices(self.trainer.mesh.devices.flat)
        fresh = self._over_seeds(backend.programs.map_seed_inits(self.trainer.init_fn))
        seeds_S = jax.device_put(np.asarray(seeds, np.int32), self.sharding)
        with self.traced():
            return jax.jit(fresh, out_shardings=self.sharding)(seeds_S)

    def _over_seeds(self, fn: Callable) -> Callable:
        """``fn`` of stacked arguments, run on each device's own seeds when over a mesh."""
        if self.mesh is None:
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=P(SEED_AXIS),
                             out_specs=P(SEED_AXIS))

    def stack(self, states: Sequence[TrainState]) -> TrainState:
        """One state of ``[S, ...]`` leaves, seed s at index s, placed as ``sharding`` says."""
        if len(states) != self.seeds:
            raise ValueError(f"{len(states)} states for {self.seeds} seeds")
        return jax.device_put(jax.tree.map(lambda *xs: jnp.stack(xs), *states), self.sharding)

    def unstack(self, state: Any, index: int) -> Any:
        """Seed ``index``'s own state (or any stacked tree) on the trainer's device (new
        arrays: the stacked state may be donated later)."""
        one = jax.tree.map(lambda x: x[index], state)
        return one if self.mesh is None else jax.device_put(
            one, NamedSharding(self.trainer.mesh, P()))

    def place_batch(self, batches: Sequence[dict]) -> dict:
        """The seeds' host batches (same keys and shapes) as one ``[S, B, ...]`` batch."""
        if len(batches) != self.seeds:
            raise ValueError(f"{len(batches)} batches for {self.seeds} seeds")
        return {k: jax.device_put(np.stack([np.asarray(b[k]) for b in batches]), self.sharding)
                for k in batches[0]}

    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with self.traced():
            return self._step(state, batch)

    def abstract_state(self) -> TrainState:
        """The stacked state's shapes on the trainer's device (which may be a compile target's
        device: nothing is allocated)."""
        one = self.trainer.abstract_state()
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((self.seeds, *s.shape), s.dtype,
                                           sharding=self.sharding), one)

    def abstract_batch(self, batch: dict) -> dict:
        """``[S, ...]`` shapes of a batch of one seed's shapes (arrays or shape structs)."""
        return {k: jax.ShapeDtypeStruct((self.seeds, *np.shape(v)), v.dtype,
                                        sharding=self.sharding) for k, v in batch.items()}

    def lower(self, state: Any, batch: dict) -> Any:
        """The stacked step lowered for (abstract or real) ``state`` and ``batch``."""
        with self.traced():
            return self._step.lower(state, batch)


def stack_seeds(trainer: ParallelTrainer, seeds: int, donate: bool = True,
                backend: backends.Backend | None = None,
                devices: Sequence[Any] | None = None) -> SeedsTrainer:
    """``trainer``'s step over ``seeds`` stacked states as one jitted program (``donate``: it
    reuses the input state's buffers), mapped over the seeds as the backend of the trainer's
    device does it (``Programs.map_seeds``; ``backend`` overrides it). Only a ``single``
    trainer. ``devices``: lay the seeds over a ``seed`` mesh axis of these devices (the first
    is the trainer's; ``seeds`` a multiple of their number), each training its own seeds;
    default the trainer's device alone."""
    if trainer.strategy != "single" or trainer.step_fn is None:
        raise ConfigError(f"train.strategy={trainer.strategy!r}: seeds train together on "
                          "whole devices, one seed never split across several "
                          "(train.strategy=single); train the seeds of a sharded run one "
                          "after another")
    if seeds < 1:
        raise ValueError(f"seeds={seeds}: need at least one")
    devices = list(devices) if devices is not None else []
    mesh = None
    if len(devices) > 1:
        if seeds % len(devices):
            raise ConfigError(f"{seeds} seeds over {len(devices)} devices: each device trains "
                              f"whole seeds, so give a multiple of {len(devices)} seeds or "
                              f"use {math.gcd(seeds, len(devices))} devices")
        if devices[0] != trainer.mesh.devices.flat[0]:
            raise ValueError("devices: the first must be the trainer's device")
        mesh = Mesh(np.asarray(devices), (SEED_AXIS,))
    backend = backend or backends.for_devices(devices or trainer.mesh.devices.flat)
    shell = SeedsTrainer(trainer, seeds, None, mesh, backend)
    placed = {} if mesh is None else {"out_shardings": shell.sharding}
    step = jax.jit(shell._over_seeds(backend.programs.map_seeds(trainer.step_fn)),
                   donate_argnums=(0,) if donate else (), **placed)
    return dataclasses.replace(shell, _step=step)


def seed_devices(seeds: int, devices: Sequence[Any]) -> list[Any]:
    """The devices a program of ``seeds`` seeds spreads over by default: as many of
    ``devices`` as divide the seeds evenly (the most that do), when their backend trains
    seeds side by side (``Programs.seeds_across_devices``); else the first alone."""
    devices = list(devices)
    if not backends.for_devices(devices).programs.seeds_across_devices:
        return devices[:1]
    n = max(k for k in range(1, len(devices) + 1) if seeds % k == 0)
    return devices[:n]
