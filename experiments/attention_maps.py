"""Where a trained model attends: per layer and head, the entropy of each query's attention
distribution and its mean attention distance, so "uses long context" is seen, not inferred.

    stats = attention_statistics(model, params, tokens_BT)   # {"entropy": [L][H], ...}

The model runs once (compiled; not with ``scan_layers``, whose one traced layer stands for all),
with every self-attention call observed on its way to the kernel: its queries and keys (after
the positional scheme's rotation), bias and mask give the softmax weights ``p[b, h, q, k]`` (the
reference formula), from which, averaged over the batch's queries, each layer adds its outputs
to the compiled function's (in the order the layers are traced: the model's):

- entropy ``-sum_k p log p`` in nats (0: one key; ``log(q + 1)``: uniform over the prefix),
- mean distance ``sum_k p |q - k|`` in tokens (how far back the weight sits).

Cross-attention (encoder-decoder) is not observed: its distances have no meaning.
"""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax.nn import layers
from transformers_jax.nn.attention import attention_weights


def _head_stats(p_BHQK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Entropy and mean distance per head ``[H]`` (means over batch and queries)."""
    q, k = p_BHQK.shape[2:]
    p = p_BHQK.astype(jnp.float32)
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
    offset = k - q  # queries are the last q of the k positions (no cache here: q == k)
    distance = jnp.abs(jnp.arange(q)[:, None] + offset - jnp.arange(k)[None, :])
    mean_distance = jnp.sum(p * distance, axis=-1)
    weight = (jnp.sum(p, axis=-1) > 0).astype(jnp.float32)  # rows with no visible key: out

    def per_head(x):
        return jnp.sum(x * weight, axis=(0, 2)) / jnp.maximum(jnp.sum(weight, axis=(0, 2)), 1.0)

    return per_head(entropy), per_head(mean_distance)


def attention_statistics(model, params, tokens_BT) -> dict:
    """``{"entropy": [layers][heads], "distance": [layers][heads], "length": T}`` for the
    self-attention of ``model`` on ``tokens_BT``. The statistics are outputs of one jitted
    function (not host callbacks), so its executable is cached like any other."""
    cfg = model.config
    if cfg.scan_layers:
        raise ValueError("attention_statistics observes each layer's call: use a model built "
                         "with scan_layers=False (its scanned parameters are stacked; train "
                         "it unscanned to analyse it)")
    original = layers.dot_product_attention
    found: list[tuple[jax.Array, jax.Array]] = []  # traced (entropy, distance) per layer

    def observed(q, k, v, *, bias=None, mask=None, scale=None, logit_softcap=None, **rest):
        if q.shape[1] == k.shape[1]:  # self-attention over the same window
            found.append(_head_stats(attention_weights(q, k, bias=bias, mask=mask, scale=scale,
                                                       logit_softcap=logit_softcap)))
        return original(q, k, v, bias=bias, mask=mask, scale=scale,
                        logit_softcap=logit_softcap, **rest)

    def statistics(p, t):
        found.clear()
        model.apply({"params": p}, t)  # only the statistics are kept: XLA drops the rest
        return list(found)

    with mock.patch.object(layers, "dot_product_attention", observed):
        per_layer = jax.jit(statistics)(params, jnp.asarray(tokens_BT))
    return {"entropy": [np.asarray(e).tolist() for e, _ in per_layer],
            "distance": [np.asarray(d).tolist() for _, d in per_layer],
            "length": int(np.asarray(tokens_BT).shape[1])}
