"""Train state and the jit-compiled train/eval steps. Everything is explicit: a step takes the
state and a batch and returns the new state and metrics; RNG lives in the state."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: number of updates applied
    params: Any
    opt_state: Any
    rng: jax.Array  # raw uint32 key data (checkpoint-friendly); split every step for dropout


def model_inputs(batch: dict) -> dict:
    """The optional model inputs a batch may carry besides ``inputs``."""
    return {k: batch.get(k) for k in ("positions", "segment_ids", "prefix_len")}


def init_state(
    model: nn.Module, optimizer: optax.GradientTransformation, seed: int, example_batch: dict
) -> TrainState:
    """Initialise parameters (unboxed from their logical-axis metadata) and optimizer state."""
    init_key, rng = jax.random.split(jax.random.key(seed))
    variables = model.init(init_key, example_batch["inputs"], **model_inputs(example_batch))
    params = nn.meta.unbox(variables["params"])
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.key_data(rng),
    )


def lm_loss(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array | None = None):
    """Mean next-token cross-entropy (and accuracy) over positions with weight 1."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
    correct = (jnp.argmax(logits_BTV, -1) == targets_BT).astype(jnp.float32)
    if weights_BT is None:
        weights_BT = jnp.ones_like(losses)
    weights_BT = weights_BT.astype(jnp.float32)
    count = jnp.maximum(weights_BT.sum(), 1.0)
    return (losses * weights_BT).sum() / count, (correct * weights_BT).sum() / count


def _forward(model, params, batch, *, deterministic, rng=None):
    rngs = None if rng is None else {"dropout": rng}
    return model.apply(
        {"params": params},
        batch["inputs"],
        **model_inputs(batch),
        deterministic=deterministic,
        rngs=rngs,
    )


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation, schedule=None):
    """``train_step(state, batch) -> (state, metrics)``, pure and ready for ``jax.jit``."""

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rng, dropout_rng = jax.random.split(jax.random.wrap_key_data(state.rng))

        def loss_fn(params):
            logits = _forward(model, params, batch, deterministic=False, rng=dropout_rng)
            loss, accuracy = lm_loss(logits, batch["targets"], batch.get("weights"))
            return loss, accuracy

        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "accuracy": accuracy, "grad_norm": optax.tree.norm(grads)}
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, rng=jax.random.key_data(rng)
        )
        return new_state, metrics

    return train_step


def make_eval_step(model: nn.Module):
    """``eval_step(params, batch) -> metrics`` without dropout."""

    def eval_step(params, batch: dict) -> dict:
        logits = _forward(model, params, batch, deterministic=True)
        loss, accuracy = lm_loss(logits, batch["targets"], batch.get("weights"))
        return {"loss": loss, "accuracy": accuracy}

    return eval_step
