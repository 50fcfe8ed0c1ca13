"""A cross-entropy that never holds the ``[tokens, vocab]`` logits: the tokens go through the
output layer a block at a time, each block's logits recomputed in the backward pass instead
of kept (``jax.checkpoint`` inside ``lax.map``), so a step holds one block's logits and their
gradient, ``[block, V]``, whatever the sequence length. At 16K tokens and Llama 3's 128K
vocabulary the full float32 logits are 8.4 GB; in blocks of 1,024 they are 0.5 GB.

``head(params, h_NC) -> logits_NV`` is the model's output layer (its tied table or its own
kernel, its soft-cap): the loss is the same function of the same parameters, summed block by
block, so its value and gradients equal the full computation's to float rounding (the sums
are taken in another order). Wiring it into a family's forward pass is the model's to do: it
must hand over its final hidden states and its output layer (issue 67)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from transformers_jax.learning.losses import predicts_target, token_losses


def blockwise_token_loss(head: Callable[[Any, jax.Array], jax.Array], params: Any,
                         hidden_NC: jax.Array, targets_N: jax.Array,
                         weights_N: jax.Array | None = None, block: int = 1024
                         ) -> tuple[jax.Array, jax.Array]:
    """Mean next-token cross-entropy and accuracy over the tokens with weight (as
    ``losses.lm_loss``), the logits computed ``block`` tokens at a time. ``N`` need not be a
    multiple of ``block``: the last block is padded with weight 0."""
    N = hidden_NC.shape[0]
    weights_N = jnp.ones((N,), jnp.float32) if weights_N is None else weights_N.astype(
        jnp.float32)
    block = min(block, N)
    blocks = -(-N // block)
    pad = blocks * block - N
    h_KBC = jnp.pad(hidden_NC, ((0, pad), (0, 0))).reshape(blocks, block, -1)
    t_KB = jnp.pad(targets_N, (0, pad)).reshape(blocks, block)
    w_KB = jnp.pad(weights_N, (0, pad)).reshape(blocks, block)

    @jax.checkpoint  # the backward pass recomputes a block's logits rather than keep them
    def sums(params, h_BC, t_B, w_B):
        logits_BV = head(params, h_BC).astype(jnp.float32)
        loss = (token_losses(logits_BV, t_B) * w_B).sum()
        right = (predicts_target(logits_BV, t_B).astype(jnp.float32) * w_B).sum()
        return loss, right

    loss_K, right_K = lax.map(lambda xs: sums(params, *xs), (h_KBC, t_KB, w_KB))
    count = jnp.maximum(weights_N.sum(), 1.0)
    return loss_K.sum() / count, right_K.sum() / count
