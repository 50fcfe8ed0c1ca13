"""The attention API: ``dot_product_attention`` (any implementation, by name or
``implementations.py`` entry), ``attend_to_cache`` (a decoding step over the KV cache), the
input checks, the bias and mask layout the kernels share, and ``across_shards``: the one seam
through which the parallel layer computes attention over a sequence split across devices
(context parallelism) without the model knowing about devices.

Shape legend: B batch, Q query length, K key length, H query heads, N key/value heads,
G = H // N query heads per key/value head, D head dimension, S cache slots.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax import lax

from transformers_jax.nn.masks import AttentionMask, as_dense
from transformers_jax.registry import ATTENTION, Switch

Mask = AttentionMask | jax.Array | None

# ``hook(impl, q, k, v, *, bias, mask, scale, logit_softcap) -> out``: the attention of global
# q, k, v (as the model sees them) computed however the hook sees fit, typically by ``impl``
# on each device's shards (``parallel/context.py``). Unset: ``impl.attend`` directly.
AttentionHook = Callable[..., jax.Array]
_HOOK: contextvars.ContextVar[AttentionHook | None] = contextvars.ContextVar(
    "transformers_jax_attention_hook", default=None)


@dataclasses.dataclass(frozen=True)
class KeyShards:
    """How a model traced on one device's shard of the sequence (the shard_map strategy) sees
    every key: ``gather`` takes a per-key array ``[B, k]`` (positions) to ``[B, K]`` in
    sequence order, K = ``count`` x k."""

    gather: Callable[[jax.Array], jax.Array]
    count: int


_KEYS: contextvars.ContextVar[KeyShards | None] = contextvars.ContextVar(
    "transformers_jax_key_shards", default=None)


@contextlib.contextmanager
def across_shards(hook: AttentionHook | None,
                  keys: KeyShards | None = None) -> Iterator[None]:
    """While tracing inside this context, ``dot_product_attention`` hands its checked inputs to
    ``hook`` instead of calling the implementation (None: no hook), and ``every_key`` gathers
    by ``keys`` (None: the sequence is whole on every device, or global arrays). The parallel
    layer enters it with the mesh (``parallel.strategies.mesh_rules``) or inside its mapped
    step when the sequence is split over devices; nothing in ``nn/`` or ``models/`` sets it."""
    token, keys_token = _HOOK.set(hook), _KEYS.set(keys)
    try:
        yield
    finally:
        _HOOK.reset(token)
        _KEYS.reset(keys_token)


def every_key(x_BK: jax.Array) -> jax.Array:
    """A per-key array ``[B, K]`` (the key positions a bias is built from) over all the keys
    attention will see: itself, unless the model is traced on one device's shard of the
    sequence, where the parallel layer gathers the shards (``across_shards``). A bias of the
    shard's queries against ``every_key`` positions is ``[.., Q, K]`` with the keys whole, the
    layout the hook slices."""
    keys = _KEYS.get()
    return x_BK if keys is None else keys.gather(x_BK)


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask: Mask = None,
    implementation: str | Switch = "reference",
    scale: float | None = None,
    logit_softcap: float | None = None,
    chunk_size: int | None = None,
) -> jax.Array:
    """Attention of q over (k, v): ``[B, Q, H, D]``, ``[B, K, N, D]`` x 2 -> ``[B, Q, H, D]``.

    Args:
      bias: additive float scores broadcastable to ``[B, H, Q, K]``; differentiable.
      mask: None, a boolean array broadcastable to ``[B, H, Q, K]`` (True = may attend), or an
        ``AttentionMask`` (the chunked kernel then builds it one tile at a time).
      implementation: an ``ATTENTION`` entry or its name (reference, xla, chunked, cudnn,
        pallas).
      scale: multiplies q.k; None means ``1 / sqrt(D)``. A Python number.
      logit_softcap: if set, scores become ``cap * tanh(scores / cap)`` before the bias.
      chunk_size: with a name, the tile length of the chunked kernel (others ignore it).

    Returns the output in q's dtype.
    """
    impl = implementation
    if isinstance(impl, str):
        impl = ATTENTION.get(impl)()
        if chunk_size is not None and hasattr(impl, "chunk_size"):
            impl = dataclasses.replace(impl, chunk_size=chunk_size)
    keys = _KEYS.get()  # a bias covers every shard's keys (every_key)
    check_inputs(q, k, v, bias, mask, logit_softcap,
                 bias_keys=None if keys is None else keys.count * k.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    hook = _HOOK.get()
    if hook is not None:  # the sequence is split over devices (parallel/context.py)
        return hook(impl, q, k, v, bias=bias, mask=mask, scale=scale,
                    logit_softcap=logit_softcap)
    return impl.attend(q, k, v, bias=bias, mask=mask, scale=scale, logit_softcap=logit_softcap)


def attend_to_cache(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    k_new: jax.Array | None = None,
    v_new: jax.Array | None = None,
    bias: jax.Array | None = None,
    mask: Mask = None,
    scale: float | None = None,
    logit_softcap: float | None = None,
) -> jax.Array:
    """A decoding step: one query per row over a heads-first cache, ``[B, 1, H, D]`` and
    ``[B, N, S, D]`` x 2 -> ``[B, 1, H, D]``, plus optionally the step's own key and value
    ``[B, N, 1, D]`` as key number S; bias and mask broadcast to ``[B, H, 1, S (+1)]``.

    Every implementation does the same maths for a single query, and this is the one that
    reads the cache where it lies: (batch, head) lead both matmuls, so nothing is transposed
    or copied per layer and token. The same formula as the reference.
    """
    b, q_len, h, d = q.shape
    kb, n, k_len, kd = k.shape
    new_ok = (k_new is None and v_new is None) or (
        k_new is not None and v_new is not None and k_new.shape == v_new.shape == (b, n, 1, d))
    if q_len != 1 or k.shape != v.shape or (kb, kd) != (b, d) or h % n or not new_ok:
        raise ValueError(
            f"attend_to_cache wants q [B, 1, H, D], k, v [B, N, S, D] and k_new, v_new "
            f"[B, N, 1, D] or None; got q {q.shape}, k {k.shape}, v {v.shape}, k_new "
            f"{getattr(k_new, 'shape', None)}, v_new {getattr(v_new, 'shape', None)}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q = q.reshape(b, n, h // n, d)  # [B, N, G, D]
    s = jnp.einsum("bngd,bnsd->bngs", q, k, preferred_element_type=jnp.float32)
    if k_new is not None:
        s_new = jnp.einsum("bngd,bnsd->bngs", q, k_new, preferred_element_type=jnp.float32)
        s = jnp.concatenate([s, s_new], axis=-1)
    s = s * scale
    if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
    if bias is not None:
        s = s + group_heads(bias, n)[:, :, :, 0].astype(jnp.float32)  # [B|1, N|1, G|1, S|1]
    mask = as_dense(mask)
    if mask is not None:
        s = jnp.where(group_heads(mask, n)[:, :, :, 0], s, -jnp.inf)
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = (e / jnp.where(total > 0, total, 1.0)).astype(v.dtype)  # sees no key: all zero
    out = jnp.einsum("bngs,bnsd->bngd", p[..., :k_len], v, preferred_element_type=jnp.float32)
    if v_new is not None:
        out = out + jnp.einsum("bngs,bnsd->bngd", p[..., k_len:], v_new,
                               preferred_element_type=jnp.float32)
    return out.reshape(b, 1, h, d).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Input checks and the bias/mask layout shared by the implementations


def check_inputs(q, k, v, bias, mask, logit_softcap, *, bias_keys: int | None = None) -> None:
    """Raise a ValueError (a TypeError for a non-boolean mask) unless q, k, v, the bias and the
    mask are what ``dot_product_attention`` takes."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention wants q [B, Q, H, D] and k, v [B, K, N, D]; got q {q.shape}, "
            f"k {k.shape}, v {v.shape}"
        )
    b, q_len, h, d = q.shape
    kb, k_len, n, kd = k.shape
    if k.shape != v.shape or kb != b or kd != d:
        raise ValueError(
            f"k and v must both be [B, K, N, D] with q's batch and head dim; got q {q.shape}, "
            f"k {k.shape}, v {v.shape}"
        )
    if h % n:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({n})")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    target = (b, h, q_len, k_len)
    if bias is not None:
        _check_broadcastable(bias, target if bias_keys is None else target[:3] + (bias_keys,),
                             "bias")
    if isinstance(mask, AttentionMask):
        if mask.q_positions.shape[0] not in (1, b) or (mask.q_len, mask.kv_len) != (q_len, k_len):
            raise ValueError(
                f"AttentionMask covers batch {mask.q_positions.shape[0]}, {mask.q_len} queries "
                f"and {mask.kv_len} keys; attention has batch {b}, {q_len} queries, {k_len} keys"
            )
    elif mask is not None:
        if mask.dtype != jnp.bool_:
            raise TypeError(
                f"mask must be boolean (True = may attend), got {mask.dtype}; "
                "pass additive scores as bias instead"
            )
        _check_broadcastable(mask, target, "mask")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be positive or None, got {logit_softcap}")


def _check_broadcastable(x, target, name) -> None:
    shape = (1,) * (4 - x.ndim) + x.shape
    if x.ndim > 4 or any(s not in (1, t) for s, t in zip(shape, target, strict=True)):
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} does not broadcast to [B, H, Q, K] = {target}"
        )


def as_4d(x: jax.Array) -> jax.Array:
    """Prepend unit axes: ``[Q, K]`` or ``[H, Q, K]`` -> ``[1.., H|1, Q|1, K|1]``."""
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def group_heads(x: jax.Array, num_kv_heads: int) -> jax.Array:
    """A bias or mask ``[B|1, H|1, Q|1, K|1]`` -> ``[B|1, N|1, G|1, Q|1, K|1]``."""
    b, h, q_len, k_len = as_4d(x).shape
    if h == 1:
        return x.reshape(b, 1, 1, q_len, k_len)
    return x.reshape(b, num_kv_heads, h // num_kv_heads, q_len, k_len)


def refuse_softcap(implementation: str, logit_softcap) -> None:
    """A ValueError when a kernel that cannot soft-cap its logits is asked to."""
    if logit_softcap is not None:
        raise ValueError(
            f"attention implementation {implementation!r} cannot apply logit_softcap; "
            "use 'chunked' or 'reference'"
        )
