"""``reference``: the whole ``[Q, K]`` score matrix at once, einsum + softmax; the oracle every
other implementation is checked against."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from transformers_jax.nn.attention.api import Mask, check_inputs, group_heads
from transformers_jax.nn.masks import as_dense


def reference_probs(q, k, bias, mask, scale: float, logit_softcap) -> jax.Array:
    """The softmax weights of q ``[B, Q, H, D]`` over k ``[B, K, N, D]``, grouped by key/value
    head: ``[B, N, G, Q, K]`` in float32; rows with no visible key are all zero. ``bias`` and
    ``mask`` (dense or None) broadcast to ``[B, H, Q, K]``; ``scale`` is applied as given."""
    b, q_len, h, d = q.shape
    n = k.shape[2]
    q = q.reshape(b, q_len, n, h // n, d)  # [B, Q, N, G, D]
    s = jnp.einsum("bqngd,bknd->bngqk", q, k, preferred_element_type=jnp.float32) * scale
    if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
    if bias is not None:
        s = s + group_heads(bias, n).astype(jnp.float32)
    if mask is not None:
        s = jnp.where(group_heads(mask, n), s, -jnp.inf)
    # Subtract the row maximum for stability; a row with nothing visible has max -inf, use 0
    # there so exp(-inf - 0) = 0 and the row sums to 0 rather than NaN.
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))  # [B, N, G, Q, K]
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def reference_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=None):
    """Plain einsum + softmax; materialises the ``[B, H, Q, K]`` scores. The oracle."""
    del chunk_size  # only the chunked kernel tiles
    b, q_len, h, d = q.shape
    p = reference_probs(q, k, bias, as_dense(mask), scale, logit_softcap)  # [B, N, G, Q, K]
    out = jnp.einsum("bngqk,bknd->bqngd", p, v.astype(jnp.float32))  # [B, Q, N, G, D]
    return out.reshape(b, q_len, h, d).astype(q.dtype)


def attention_weights(
    q: jax.Array,
    k: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask: Mask = None,
    scale: float | None = None,
    logit_softcap: float | None = None,
) -> jax.Array:
    """The softmax weights of the reference path, ``[B, H, Q, K]`` float32 (for inspection)."""
    check_inputs(q, k, k, bias, mask, logit_softcap)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    p = reference_probs(q, k, bias, as_dense(mask), scale, logit_softcap)  # [B, N, G, Q, K]
    b, n, g, q_len, k_len = p.shape
    return p.reshape(b, n * g, q_len, k_len)
