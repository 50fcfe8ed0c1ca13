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


class SkipsNonFinite(optax.GradientTransformationExtraArgs):
    """An optimizer whose ``update`` takes ``keep`` (a boolean scalar) and, where it is False,
    returns zero updates and its state unchanged: ``train.step.apply_gradients`` then selects
    nothing after it."""


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
        return apply_gradients(optimizer, state, grads, {**metrics, "loss": loss}, schedule,
                               jax.random.key_data(rng))

    return train_step


def apply_gradients(optimizer: optax.GradientTransformation, state: TrainState, grads,
                    metrics: dict, schedule, rng: jax.Array) -> tuple[TrainState, dict]:
    """Inside the jitted step: the optimizer's update, unless the loss or the gradient norm is
    not finite. Then ``state``'s params and optimizer state stay (the step counter and RNG
    still advance, as the data does), and ``nonfinite`` (0 or 1) joins the metrics; ``metrics``
    must hold the ``loss``. A ``SkipsNonFinite`` optimizer (``train.optim.clipped_adamw``)
    skips the update itself, which lets XLA update its state in place (a second select made
    XLA:CPU copy each moment first); any other optimizer's state is kept by a select per
    array, fused into the update."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    if isinstance(optimizer, SkipsNonFinite):
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params, keep=finite)
        kept = optax.apply_updates(state.params, updates), opt_state
    else:
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                            (optax.apply_updates(state.params, updates), opt_state),
                            (state.params, state.opt_state))
    metrics = {**metrics, "grad_norm": grad_norm, "nonfinite": (~finite).astype(jnp.int32)}
    if schedule is not None:
        metrics["learning_rate"] = schedule(state.step)
    return state.replace(step=state.step + 1, params=kept[0], opt_state=kept[1], rng=rng), metrics


def make_eval_step(model: nn.Module, objective=None):
    """``eval_step(params, batch) -> metrics`` without dropout."""
    objective = _objective(objective)

    def eval_step(params, batch: dict) -> dict:
        return objective.loss(model, params, batch, None, True)[1]

    return eval_step
