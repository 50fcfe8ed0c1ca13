"""Seeds trained together: S copies of one device's training step compiled as one program.

``stack_seeds(trainer, S)`` takes a ``single`` trainer (``make_trainer``) and maps its own step
function (``ParallelTrainer.step_fn``) over a leading seed axis: every leaf of the state (step
counter, parameters, optimizer state, RNG key data) and of the batch gains that axis,
``[S, ...]``, and seed s's slice evolves as that seed's state would alone. How the step maps
over the seeds is the backend's (``Backend.map_seeds``): ``jax.vmap`` for TPU and GPU, every
operation over all the seeds at once, so that S times the work fills the chip; one seed after
another in the same program (``lax.map``) on XLA:CPU, where the batched products ran slower
than the same products one seed at a time. The arithmetic is the same; XLA may fuse and round
some operations differently, so the agreement is to float tolerance, not bit for bit
(``tests/test_seeds.py`` states it).

Why: a small model leaves much of a device idle each step, and each step pays its dispatch
and per-step overheads. One program for S seeds pays those once for all S, and on an
accelerator gives every operation S times the work. ``train.seeds.train_seeds`` runs it; ``tjax
plan --seeds S`` compiles it for a target.

Shape legend: S seeds, B batch, T length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformers_jax import backends
from transformers_jax.config import ConfigError
from transformers_jax.parallel.strategies import ParallelTrainer
from transformers_jax.train.step import TrainState


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

    @property
    def sharding(self) -> NamedSharding:
        """Where every stacked array lives: the trainer's one device."""
        return NamedSharding(self.trainer.mesh, P())

    def init(self, seeds: Sequence[int]) -> TrainState:
        """The stacked initial states of ``seeds`` (``len(seeds) == self.seeds``), one program
        for all (one compile, not one per seed); seed s's slice equals
        ``trainer.init_state(s)``."""
        if len(seeds) != self.seeds:
            raise ValueError(f"{len(seeds)} seeds for a program of {self.seeds}")
        fresh = jax.jit(jax.vmap(self.trainer.init_fn), out_shardings=self.sharding)
        with self.trainer.traced():
            return fresh(jnp.asarray(seeds, jnp.int32))

    def stack(self, states: Sequence[TrainState]) -> TrainState:
        """One state of ``[S, ...]`` leaves on the trainer's device, seed s at index s."""
        if len(states) != self.seeds:
            raise ValueError(f"{len(states)} states for {self.seeds} seeds")
        return jax.device_put(jax.tree.map(lambda *xs: jnp.stack(xs), *states), self.sharding)

    def unstack(self, state: TrainState, index: int) -> TrainState:
        """Seed ``index``'s own state (new arrays: the stacked state may be donated later)."""
        return jax.tree.map(lambda x: x[index], state)

    def place_batch(self, batches: Sequence[dict]) -> dict:
        """The seeds' host batches (same keys and shapes) as one ``[S, B, ...]`` batch."""
        if len(batches) != self.seeds:
            raise ValueError(f"{len(batches)} batches for {self.seeds} seeds")
        return {k: jax.device_put(np.stack([np.asarray(b[k]) for b in batches]), self.sharding)
                for k in batches[0]}

    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with self.trainer.traced():
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
        with self.trainer.traced():
            return self._step.lower(state, batch)


def stack_seeds(trainer: ParallelTrainer, seeds: int, donate: bool = True,
                backend: backends.Backend | None = None) -> SeedsTrainer:
    """``trainer``'s step over ``seeds`` stacked states as one jitted program (``donate``: it
    reuses the input state's buffers), mapped over the seeds as the backend of the trainer's
    device does it (``Backend.map_seeds``; ``backend`` overrides it). Only a ``single``
    trainer: seeds on a mesh would need the seed axis in the mesh, which this does not build."""
    if trainer.strategy != "single" or trainer.step_fn is None:
        raise ConfigError(f"train.strategy={trainer.strategy!r}: seeds train together on one "
                          "device only (train.strategy=single); train the seeds of a "
                          "multi-device run one after another")
    if seeds < 1:
        raise ValueError(f"seeds={seeds}: need at least one")
    backend = backend or backends.for_devices(trainer.mesh.devices.flat)
    step = jax.jit(backend.map_seeds(trainer.step_fn), donate_argnums=(0,) if donate else ())
    return SeedsTrainer(trainer, seeds, step)
