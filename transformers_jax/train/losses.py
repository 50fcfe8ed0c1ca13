"""Loss functions on logits: the pieces every objective (``train/objectives.py``) and every
parallel strategy (``parallel/strategies.py``) computes its loss and metrics from.

Shape legend: B batch, T length, V vocabulary, L labels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def token_losses(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Cross-entropy of every position ``[B, T]`` (nats)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)


def lm_loss(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array | None = None):
    """Mean next-token cross-entropy (and accuracy) over positions with weight 1."""
    losses = token_losses(logits_BTV, targets_BT)
    correct = (jnp.argmax(logits_BTV, -1) == targets_BT).astype(jnp.float32)
    if weights_BT is None:
        weights_BT = jnp.ones_like(losses)
    weights_BT = weights_BT.astype(jnp.float32)
    count = jnp.maximum(weights_BT.sum(), 1.0)
    return (losses * weights_BT).sum() / count, (correct * weights_BT).sum() / count


def token_metrics(logits_BTV, targets_BT, weights_BT) -> tuple[jax.Array, dict]:
    """``lm_loss`` (all positions when ``weights_BT`` is None) and the metrics of a token-level
    objective: ``loss``, ``accuracy`` and ``tokens`` (the sum of the weights)."""
    weights_BT = jnp.ones(targets_BT.shape, jnp.float32) if weights_BT is None else weights_BT
    loss, accuracy = lm_loss(logits_BTV, targets_BT, weights_BT)
    return loss, {"loss": loss, "accuracy": accuracy, "tokens": weights_BT.sum()}


def sequence_accuracy(logits_BTV, targets_BT, weights_BT) -> jax.Array:
    """Share of rows whose argmax is right at every weighted position."""
    wrong_BT = (jnp.argmax(logits_BTV, -1) != targets_BT) & (weights_BT > 0)
    return 1.0 - jnp.any(wrong_BT, axis=-1).astype(jnp.float32).mean()


def classification_loss(logits_BL: jax.Array, labels_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy of ``[B, L]`` logits against integer ``labels [B]``, and accuracy."""
    loss = optax.softmax_cross_entropy_with_integer_labels(logits_BL, labels_B).mean()
    accuracy = (jnp.argmax(logits_BL, -1) == labels_B).astype(jnp.float32).mean()
    return loss, accuracy
