"""Train state and the jit-compiled train/eval steps. Everything is explicit: a step takes the
state and a batch and returns the new state and metrics; RNG lives in the state."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from transformers_jax.train.objectives import OBJECTIVES


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: number of updates applied
    params: Any
    opt_state: Any
    rng: jax.Array  # raw uint32 key data (checkpoint-friendly); split every step for dropout


def model_inputs(batch: dict) -> dict:
    """The optional model inputs a batch may carry besides ``inputs``."""
    return {k: batch.get(k) for k in ("positions", "segment_ids", "prefix_len")}


def _objective(objective):
    """The given objective, or next-token LM (``train/objectives.py`` holds them all)."""
    return OBJECTIVES.get("lm") if objective is None else objective


def init_state(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    seed: int,
    example_batch: dict,
    objective=None,
) -> TrainState:
    """Initialise parameters (unboxed from their logical-axis metadata) and optimizer state;
    ``objective`` says which batch keys the model reads (default: next-token LM)."""
    init_key, rng = jax.random.split(jax.random.key(seed))
    params = _objective(objective).init_params(model, init_key, example_batch)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.key_data(rng),
    )


def make_train_step(
    model: nn.Module, optimizer: optax.GradientTransformation, schedule=None, objective=None
):
    """``train_step(state, batch) -> (state, metrics)`` for ``objective`` (default LM); pure,
    ready for ``jax.jit``."""
    objective = _objective(objective)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rng, dropout_rng = jax.random.split(jax.random.wrap_key_data(state.rng))

        def loss_fn(params):
            return objective.loss(model, params, batch, dropout_rng, False)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, rng=jax.random.key_data(rng)
        )
        return keep_if_finite(state, new_state, metrics)

    return train_step


def keep_if_finite(state: TrainState, new_state: TrainState, metrics: dict
                   ) -> tuple[TrainState, dict]:
    """Inside the jitted step: keep ``state``'s params and optimizer state when the loss or the
    gradient norm is not finite (the step counter and RNG still advance, as the data does), and
    add ``nonfinite`` (0 or 1) to the metrics. A select per array, fused into the update: no
    extra pass over memory and nothing to fetch beyond the metrics already logged."""
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                        (new_state.params, new_state.opt_state), (state.params, state.opt_state))
    new_state = new_state.replace(params=kept[0], opt_state=kept[1])
    return new_state, {**metrics, "nonfinite": (~finite).astype(jnp.int32)}


def make_eval_step(model: nn.Module, objective=None):
    """``eval_step(params, batch) -> metrics`` without dropout."""
    objective = _objective(objective)

    def eval_step(params, batch: dict) -> dict:
        return objective.loss(model, params, batch, None, True)[1]

    return eval_step
