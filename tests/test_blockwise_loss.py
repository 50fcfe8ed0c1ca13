"""The blockwise cross-entropy (``learning/blockwise.py``) equals the loss over the full
logits, value, accuracy and gradients, for a tied and an untied output layer and a soft-cap,
with a last block shorter than the rest; and its compiled step holds a block's logits, not
all of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformers_jax.learning.blockwise import blockwise_token_loss
from transformers_jax.learning.losses import lm_loss

N, C, V = 100, 16, 50


def untied(params, h_NC):
    return h_NC @ params["kernel"]


def tied_capped(params, h_NC):  # the token table transposed, then a soft-cap
    return 30.0 * jnp.tanh((h_NC @ params["table"].T) / 30.0)


@pytest.mark.parametrize("head, params", [
    (untied, {"kernel": jax.random.normal(jax.random.key(1), (C, V))}),
    (tied_capped, {"table": jax.random.normal(jax.random.key(2), (V, C))}),
], ids=["untied", "tied-softcap"])
def test_blockwise_equals_the_full_logits(head, params):
    hidden = jax.random.normal(jax.random.key(3), (N, C))
    targets = jax.random.randint(jax.random.key(4), (N,), 0, V)
    weights = (jnp.arange(N) % 7 != 0).astype(jnp.float32)  # some tokens left out

    def full(p, h):
        loss, accuracy = lm_loss(head(p, h)[None], targets[None], weights[None])
        return loss, accuracy

    def blocks(p, h):
        return blockwise_token_loss(head, p, h, targets, weights, block=32)  # 4 blocks, 4 short

    (loss, acc), grads = jax.value_and_grad(full, argnums=(0, 1), has_aux=True)(params, hidden)
    (b_loss, b_acc), b_grads = jax.jit(jax.value_and_grad(blocks, argnums=(0, 1),
                                                          has_aux=True))(params, hidden)
    np.testing.assert_allclose(b_loss, loss, rtol=1e-6)
    assert float(b_acc) == pytest.approx(float(acc))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 b_grads, grads)


def test_the_compiled_step_holds_a_block_of_logits_not_all():
    """4,096 tokens, a 32,768-word vocabulary: the full float32 logits are 512 MiB, and their
    gradient as much again; blocks of 256 tokens keep the step's temporaries far below one
    copy (XLA's own memory analysis of the compiled gradient, nothing run)."""
    n, c, v = 4096, 64, 32_768
    params = {"kernel": jax.ShapeDtypeStruct((c, v), jnp.float32)}
    hidden = jax.ShapeDtypeStruct((n, c), jnp.float32)
    targets = jax.ShapeDtypeStruct((n,), jnp.int32)

    def step(loss_fn):
        return jax.jit(jax.grad(loss_fn)).lower(params, hidden, targets).compile()

    full = step(lambda p, h, t: lm_loss((h @ p["kernel"])[None], t[None])[0])
    blocked = step(lambda p, h, t: blockwise_token_loss(untied, p, h, t, block=256)[0])
    logits = n * v * 4
    assert full.memory_analysis().temp_size_in_bytes >= logits
    assert blocked.memory_analysis().temp_size_in_bytes < logits / 4
