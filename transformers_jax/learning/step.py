"""Train state and the jit-compiled train/eval steps. Everything is explicit: a step takes the
state and a batch and returns the new state and metrics; RNG lives in the state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from transformers_jax import backends
from transformers_jax.learning.losses import lm_loss
from transformers_jax.learning.objectives import OBJECTIVES


class SkipsNonFinite(optax.GradientTransformationExtraArgs):
    """An optimizer whose ``update`` takes ``keep`` (a boolean scalar) and, where it is False,
    returns zero updates and its state unchanged: ``learning.step.apply_gradients`` then selects
    nothing after it. It is also handed ``norm=``, the gradients' global norm, which the step has
    computed already (None: compute it): like every optax ``GradientTransformationExtraArgs``,
    its ``update`` must accept keyword arguments it does not use (``**extra_args``)."""


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
    """The given objective, or next-token LM (``learning/objectives.py`` holds them all)."""
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
    model: nn.Module, optimizer: optax.GradientTransformation, schedule=None, objective=None,
    groups: int = 1,
):
    """``train_step(state, batch) -> (state, metrics)`` for ``objective`` (default LM); pure,
    ready for ``jax.jit`` on this host's default device (no mesh). ``groups > 1`` computes the
    batch as that many independent groups of rows (``grouped_sums_and_grads``): the same update,
    in pieces XLA:CPU runs side by side (the backend refuses them on other platforms)."""
    objective = _objective(objective)
    if groups < 1:
        raise ValueError(f"groups must be a positive integer, got {groups}")
    backends.current().programs.check_row_groups(groups)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rng, dropout_rng = jax.random.split(jax.random.wrap_key_data(state.rng))
        if groups > 1:
            sums, weight, grad_of_sum = grouped_sums_and_grads(
                model, state.params, batch, dropout_rng, groups, objective=objective)
            return apply_update(optimizer, state, jax.random.key_data(rng), sums, weight,
                                grad_of_sum, schedule)

        def loss_fn(params):
            return objective.loss(model, params, batch, dropout_rng, False)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return apply_gradients(optimizer, state, grads, {**metrics, "loss": loss}, schedule,
                               jax.random.key_data(rng))

    return train_step


# Token-weighted sums: the pieces of a batch (shards, micro-batches, row groups) add up -------
def weighted_sums(
    model: nn.Module,
    params: Any,
    batch: dict,
    *,
    deterministic: bool,
    rng: jax.Array | None = None,
    objective: Any = None,
) -> tuple[dict[str, jax.Array], jax.Array]:
    """``(sums, weight)`` of one batch (or shard, or micro-batch): its token weight ``W`` (the
    sum of ``weights``; the row count for row-level objectives) and every metric times ``W``.

    Adding these over shards and dividing by the added weights gives exactly the metrics of
    the whole batch on one device. ``objective=None`` is next-token prediction through
    ``learning.losses.lm_loss`` (``make_train_step``'s loss); otherwise a
    ``learning.objectives.Objective``, whose mean loss and metrics are weighted by its ``tokens``
    metric when it reports one. (Both divide by ``max(W, 1)``, and so does this.)
    """
    if objective is None:
        logits_BTV = model.apply(
            {"params": params},
            batch["inputs"],
            **model_inputs(batch),
            deterministic=deterministic,
            rngs=None if rng is None else {"dropout": rng},
        )
        weights_BT = batch.get("weights")
        if weights_BT is None:
            weights_BT = jnp.ones(batch["targets"].shape, jnp.float32)
        weights_BT = weights_BT.astype(jnp.float32)
        loss, accuracy = lm_loss(logits_BTV, batch["targets"], weights_BT)
        metrics, weight = {"loss": loss, "accuracy": accuracy}, weights_BT.sum()
    else:
        loss, metrics = objective.loss(model, params, batch, rng, deterministic)
        metrics = {**metrics, "loss": loss}
        weight = metrics.get("tokens")
        if weight is None:  # a mean over rows
            weight = jnp.shape(batch["inputs"])[0]
        weight = jnp.asarray(weight, jnp.float32)
    count = jnp.maximum(weight, 1.0)
    per_row = set(getattr(objective, "row_metrics", ()))  # means over rows, not tokens
    sums = {k: jnp.asarray(v, jnp.float32) * (1.0 if k == "tokens" else count)
            for k, v in metrics.items() if k not in per_row}
    if per_row:  # weighted by the rows, and divided by the added rows in finish_metrics
        rows = jnp.asarray(jnp.shape(batch["inputs"])[0], jnp.float32)
        sums[_PER_ROW] = {"rows": rows, **{k: jnp.asarray(metrics[k], jnp.float32) * rows
                                           for k in per_row if k in metrics}}
    return sums, weight


_PER_ROW = "per_row"  # weighted_sums' nested sums of an objective's row_metrics


def finish_metrics(sums: dict, weight: jax.Array) -> dict:
    """Global metrics from global sums: each divided by the global weight (a ``tokens``
    count stays a sum), an objective's per-row metrics by the global row count."""
    count = jnp.maximum(weight, 1.0)
    out = {k: v if k == "tokens" else v / count for k, v in sums.items() if k != _PER_ROW}
    if _PER_ROW in sums:
        per_row = dict(sums[_PER_ROW])
        rows = jnp.maximum(per_row.pop("rows"), 1.0)
        out.update({k: v / rows for k, v in per_row.items()})
    return out


def split_micro_batches(batch: dict, k: int) -> dict:
    """``[B, ...] -> [k, B/k, ...]``; row r goes to micro-batch ``r % k``.

    Interleaving (rather than cutting B into k contiguous blocks) keeps every micro-batch
    spread evenly over the data-parallel devices when B is sharded.
    """

    def split(x):
        x = jnp.asarray(x)
        return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def grouped_sums_and_grads(model: nn.Module, params: Any, batch: dict, rng: jax.Array | None,
                           groups: int = 1, *, objective: Any = None):
    """``(sums, weight, grad of sums["loss"])`` of ``batch`` (``weighted_sums``), computed as
    ``groups`` groups of rows whose forward and backward passes share nothing but the
    parameters, as the backend of the platform compiled for splits them
    (``Programs.sum_row_groups``: XLA:CPU runs the groups side by side on its threads; other
    platforms take one group only)."""

    def loss_sum(p):
        def sums_of(part: dict, key: jax.Array | None):
            return weighted_sums(model, p, part, deterministic=False, rng=key,
                                 objective=objective)

        total = backends.current().programs.sum_row_groups(sums_of, batch, rng, groups)
        return total[0]["loss"], total

    (_, (sums, weight)), grads = jax.value_and_grad(loss_sum, has_aux=True)(params)
    return sums, weight, grads


def apply_update(
    optimizer: optax.GradientTransformation,
    state: TrainState,
    rng: jax.Array,
    sums: dict,
    weight: jax.Array,
    grad_of_sum: Any,
    schedule: Callable | None,
) -> tuple[TrainState, dict]:
    """Normalise the global sums by the global weight, update, and report metrics."""
    count = jnp.maximum(weight, 1.0)
    grads = jax.tree.map(lambda g: g / count, grad_of_sum)
    # a non-finite update is not applied
    return apply_gradients(optimizer, state, grads, finish_metrics(sums, weight), schedule, rng)


def apply_gradients(optimizer: optax.GradientTransformation, state: TrainState, grads,
                    metrics: dict, schedule, rng: jax.Array) -> tuple[TrainState, dict]:
    """Inside the jitted step: the optimizer's update, unless the loss or the gradient norm is
    not finite. Then ``state``'s params and optimizer state stay (the step counter and RNG
    still advance, as the data does), and ``nonfinite`` (0 or 1) joins the metrics; ``metrics``
    must hold the ``loss``. A ``SkipsNonFinite`` optimizer (``learning.optim.clipped_adamw``)
    skips the update itself, which lets XLA update its state in place (a second select made
    XLA:CPU copy each moment first); any other optimizer's state is kept by a select per
    array, fused into the update."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    if isinstance(optimizer, SkipsNonFinite):
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params, keep=finite,
                                              norm=grad_norm)
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
