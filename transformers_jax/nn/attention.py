"""Scaled dot-product attention, several ways, all agreeing with one plain reference.

Shape legend: B batch, Q query length, K key length, H query heads, N key/value heads,
G = H // N query heads per key/value head, D head dimension.

q is ``[B, Q, H, D]``, k and v are ``[B, K, N, D]``; query head h reads key/value head
``h // G`` (the usual contiguous grouping: MHA when N == H, GQA when 1 < N < H, MQA when N == 1).
Grouped heads are handled by reshaping q to ``[B, Q, N, G, D]``, never by repeating k and v.

For every implementation the scores are, in this order::

    s = scale * q.k                      # scale defaults to 1/sqrt(D)
    s = cap * tanh(s / cap)              # only with logit_softcap (Gemma 2)
    s = s + bias                         # additive: ALiBi, T5, FIRE
    p = softmax(s) over visible keys     # float32, whatever the input dtype
    out = p @ v

A query that sees no key at all (a padded query, an empty segment) gets an output of exactly
zero, and zero gradients, rather than NaN or an average of masked values.

Implementations (the ``ATTENTION`` registry):
- ``reference``: einsum + softmax over the whole ``[Q, K]`` score matrix; the oracle.
- ``xla``: ``jax.nn.dot_product_attention(implementation="xla")``.
- ``chunked``: blockwise online softmax (flash attention) in pure JAX with its own backward
  pass; memory linear in the sequence length, runs on any backend.
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, NVIDIA GPUs only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from transformers_jax.nn.masks import AttentionMask, as_dense
from transformers_jax.registry import Registry

Mask = AttentionMask | jax.Array | None
AttentionFn = Callable[..., jax.Array]

ATTENTION: Registry[AttentionFn] = Registry("attention implementation")


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask: Mask = None,
    implementation: str = "reference",
    scale: float | None = None,
    logit_softcap: float | None = None,
    chunk_size: int = 128,
) -> jax.Array:
    """Attention of q over (k, v): ``[B, Q, H, D]``, ``[B, K, N, D]`` x 2 -> ``[B, Q, H, D]``.

    Args:
      bias: additive float scores broadcastable to ``[B, H, Q, K]``; differentiable.
      mask: None, a boolean array broadcastable to ``[B, H, Q, K]`` (True = may attend), or an
        ``AttentionMask`` (the chunked kernel then builds it one tile at a time).
      implementation: a name in ``ATTENTION`` (reference, xla, chunked, cudnn).
      scale: multiplies q.k; None means ``1 / sqrt(D)``. A Python number.
      logit_softcap: if set, scores become ``cap * tanh(scores / cap)`` before the bias.
      chunk_size: tile length of the chunked kernel (ignored by the others).

    Returns the output in q's dtype.
    """
    attend = ATTENTION.get(implementation)
    _check_inputs(q, k, v, bias, mask, logit_softcap)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return attend(
        q,
        k,
        v,
        bias=bias,
        mask=mask,
        scale=scale,
        logit_softcap=logit_softcap,
        chunk_size=chunk_size,
    )


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
    _check_inputs(q, k, k, bias, mask, logit_softcap)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    p = _reference_probs(q, k, bias, as_dense(mask), scale, logit_softcap)  # [B, N, G, Q, K]
    b, n, g, q_len, k_len = p.shape
    return p.reshape(b, n * g, q_len, k_len)


# --------------------------------------------------------------------------------------------
# Input checks and the bias/mask layout shared by the implementations


def _check_inputs(q, k, v, bias, mask, logit_softcap) -> None:
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
        _check_broadcastable(bias, target, "bias")
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


def _as_4d(x: jax.Array) -> jax.Array:
    """Prepend unit axes: ``[Q, K]`` or ``[H, Q, K]`` -> ``[1.., H|1, Q|1, K|1]``."""
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _group_heads(x: jax.Array, num_kv_heads: int) -> jax.Array:
    """A bias or mask ``[B|1, H|1, Q|1, K|1]`` -> ``[B|1, N|1, G|1, Q|1, K|1]``."""
    b, h, q_len, k_len = _as_4d(x).shape
    if h == 1:
        return x.reshape(b, 1, 1, q_len, k_len)
    return x.reshape(b, num_kv_heads, h // num_kv_heads, q_len, k_len)


# --------------------------------------------------------------------------------------------
# reference: the whole score matrix at once


def _reference_probs(q, k, bias, mask, scale, logit_softcap) -> jax.Array:
    """Softmax weights ``[B, N, G, Q, K]`` in float32; rows with no visible key are all zero."""
    b, q_len, h, d = q.shape
    n = k.shape[2]
    q = q.reshape(b, q_len, n, h // n, d)  # [B, Q, N, G, D]
    s = jnp.einsum("bqngd,bknd->bngqk", q, k, preferred_element_type=jnp.float32) * scale
    if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
    if bias is not None:
        s = s + _group_heads(bias, n).astype(jnp.float32)
    if mask is not None:
        s = jnp.where(_group_heads(mask, n), s, -jnp.inf)
    # Subtract the row maximum for stability; a row with nothing visible has max -inf, use 0
    # there so exp(-inf - 0) = 0 and the row sums to 0 rather than NaN.
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))  # [B, N, G, Q, K]
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


@ATTENTION.register("reference")
def reference_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=None):
    """Plain einsum + softmax; materialises the ``[B, H, Q, K]`` scores. The oracle."""
    del chunk_size  # only the chunked kernel tiles
    b, q_len, h, d = q.shape
    p = _reference_probs(q, k, bias, as_dense(mask), scale, logit_softcap)  # [B, N, G, Q, K]
    out = jnp.einsum("bngqk,bknd->bqngd", p, v.astype(jnp.float32))  # [B, Q, N, G, D]
    return out.reshape(b, q_len, h, d).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# xla and cudnn: jax.nn.dot_product_attention


def _refuse_softcap(implementation: str, logit_softcap) -> None:
    if logit_softcap is not None:
        raise ValueError(
            f"attention implementation {implementation!r} cannot apply logit_softcap; "
            "use 'chunked' or 'reference'"
        )


def _jax_nn_attention(q, k, v, *, bias, mask, scale, logit_softcap, implementation):
    _refuse_softcap(implementation, logit_softcap)
    mask = as_dense(mask)
    mask = None if mask is None else _as_4d(mask)
    bias = None if bias is None else _as_4d(bias)
    out = jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=mask, scale=scale, implementation=implementation
    )
    if mask is not None:
        # jax.nn fills masked scores with a large negative number, so a query that sees no
        # key gets the average of v; make it zero like the other implementations.
        seen = jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]  # [B|1, Q, H|1, 1]
        out = jnp.where(seen, out, jnp.zeros_like(out))
    return out


@ATTENTION.register("xla")
def xla_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=None):
    """``jax.nn.dot_product_attention`` with XLA's fused-by-compiler einsum/softmax."""
    del chunk_size
    return _jax_nn_attention(
        q,
        k,
        v,
        bias=bias,
        mask=mask,
        scale=scale,
        logit_softcap=logit_softcap,
        implementation="xla",
    )


@ATTENTION.register("cudnn")
def cudnn_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=None):
    """cuDNN's fused flash attention through ``jax.nn``; NVIDIA GPUs, bf16/fp16 inputs."""
    del chunk_size
    _refuse_softcap("cudnn", logit_softcap)
    backend = jax.default_backend()
    if backend != "gpu":
        raise RuntimeError(
            f"attention implementation 'cudnn' needs an NVIDIA GPU (jax backend is "
            f"{backend!r}); use xla, chunked or reference"
        )
    return _jax_nn_attention(
        q,
        k,
        v,
        bias=bias,
        mask=mask,
        scale=scale,
        logit_softcap=logit_softcap,
        implementation="cudnn",
    )


# --------------------------------------------------------------------------------------------
# chunked: flash attention in pure JAX
#
# Queries and keys are cut into tiles of q_chunk x k_chunk. The forward pass visits, for each
# query block, every key block in turn, keeping a running row maximum m, a running softmax
# denominator l and an unnormalised output; it stores only the output and the per-row
# logsumexp. The backward pass recomputes each tile's probabilities from that logsumexp, so no
# [Q, K] array ever exists: memory is O(Q + K) plus one tile.


@ATTENTION.register("chunked")
def chunked_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=128):
    """Blockwise online-softmax attention; any lengths (padded to whole tiles internally)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    b, q_len, h, d = q.shape
    k_len, n = k.shape[1], k.shape[2]
    q_chunk, k_chunk = min(chunk_size, q_len), min(chunk_size, k_len)
    q_pad, k_pad = -q_len % q_chunk, -k_len % k_chunk

    q = _pad_axis(q.reshape(b, q_len, n, h // n, d), 1, q_pad)  # [B, Qp, N, G, D]
    k, v = _pad_axis(k, 1, k_pad), _pad_axis(v, 1, k_pad)  # [B, Kp, N, D]
    if bias is not None:
        bias = _pad_scores(_group_heads(bias, n), q_pad, k_pad)  # [B|1, N|1, G|1, Qp|1, Kp|1]
    if isinstance(mask, AttentionMask):
        mask = _pad_attention_mask(mask, q_pad, k_pad)
    elif mask is not None:
        mask = _pad_scores(_group_heads(mask, n), q_pad, k_pad)

    tiling = _Tiling(scale, logit_softcap, q_chunk, k_chunk, k_len)
    out = _flash(tiling, q, k, v, bias, mask)  # [B, Qp, N, G, D]; padded queries dropped next
    return out[:, :q_len].reshape(b, q_len, h, d)


class _Tiling(NamedTuple):
    """The static settings of one chunked call (hashable: a custom_vjp non-diff argument)."""

    scale: float
    softcap: float | None
    q_chunk: int
    k_chunk: int
    k_len: int  # the true key length: keys at or past it are padding


def _pad_axis(x: jax.Array, axis: int, amount: int, value=0) -> jax.Array:
    if amount == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, amount)
    return jnp.pad(x, widths, constant_values=value)


def _pad_scores(x: jax.Array, q_pad: int, k_pad: int) -> jax.Array:
    """Pad the Q and K axes of a 5-D bias or mask, leaving broadcast (size 1) axes alone."""
    if x.shape[3] > 1:
        x = _pad_axis(x, 3, q_pad)
    if x.shape[4] > 1:
        x = _pad_axis(x, 4, k_pad)
    return x  # padding values (0 or False) never matter: padded keys are masked separately


def _pad_attention_mask(mask: AttentionMask, q_pad: int, k_pad: int) -> AttentionMask:
    """Extend positions and ids to the padded lengths, so ``block`` never reads past the end
    (``dynamic_slice`` would silently clamp the last tile back into range)."""

    def pad(x, amount):
        if x is None or amount == 0:
            return x
        return jnp.pad(x, [(0, 0), (0, amount)], mode="edge")

    return mask.replace(
        q_positions=pad(mask.q_positions, q_pad),
        q_segments=pad(mask.q_segments, q_pad),
        kv_positions=pad(mask.kv_positions, k_pad),
        kv_segments=pad(mask.kv_segments, k_pad),
        kv_valid=None if mask.kv_valid is None else _pad_axis(mask.kv_valid, 1, k_pad, False),
    )


def _tile(x: jax.Array, q_start, q_size: int, k_start, k_size: int) -> jax.Array:
    """The ``[.., q_size, k_size]`` tile of a 5-D bias or mask; size-1 axes stay size 1."""
    q_bcast, k_bcast = x.shape[3] == 1, x.shape[4] == 1
    starts = (0, 0, 0, 0 if q_bcast else q_start, 0 if k_bcast else k_start)
    sizes = (*x.shape[:3], 1 if q_bcast else q_size, 1 if k_bcast else k_size)
    return lax.dynamic_slice(x, starts, sizes)


def _tile_scores(t: _Tiling, q_blk, k_blk, bias, mask, qi, kj):
    """Scores of one tile.

    q_blk ``[B, cq, N, G, D]``, k_blk ``[B, ck, N, D]`` -> s ``[B, N, G, cq, ck]`` float32, the
    boolean ``keep`` (broadcastable to s; None when every key counts) and, with a softcap, the
    slope ``d capped / d raw`` that the backward pass needs.
    """
    q_start, k_start = qi * t.q_chunk, kj * t.k_chunk
    s = jnp.einsum("bqngd,bknd->bngqk", q_blk, k_blk, preferred_element_type=jnp.float32)
    s = s * t.scale
    slope = None
    if t.softcap is not None:
        s = t.softcap * jnp.tanh(s / t.softcap)
        slope = 1.0 - jnp.square(s / t.softcap)
    if bias is not None:
        s = s + _tile(bias, q_start, t.q_chunk, k_start, t.k_chunk).astype(jnp.float32)

    keep = None
    if isinstance(mask, AttentionMask):
        keep = mask.block(q_start, t.q_chunk, k_start, t.k_chunk)[:, :, None]  # [B,1,1,cq,ck]
    elif mask is not None:
        keep = _tile(mask, q_start, t.q_chunk, k_start, t.k_chunk)
    if t.k_len % t.k_chunk:  # the last key block holds padding
        real = k_start + jnp.arange(t.k_chunk) < t.k_len  # [ck]
        keep = real if keep is None else keep & real
    return s, keep, slope


def _blocks(x: jax.Array, size: int) -> jax.Array:
    """``[B, L, ...]`` -> ``[L // size, B, size, ...]``: blocks first, for lax.scan."""
    b, length = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, length // size, size, *x.shape[2:]), 1, 0)


def _unblock(x: jax.Array) -> jax.Array:
    """Inverse of ``_blocks``."""
    num, b, size = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(b, num * size, *x.shape[3:])


def _flash_forward(t: _Tiling, q, k, v, bias, mask):
    """Output ``[B, Qp, N, G, D]`` and logsumexp per row, ``[nq, B, N, G, cq]`` float32."""
    q_blocks = _blocks(q, t.q_chunk)  # [nq, B, cq, N, G, D]
    k_blocks, v_blocks = _blocks(k, t.k_chunk), _blocks(v, t.k_chunk)  # [nk, B, ck, N, D]
    num_q, num_k = q_blocks.shape[0], k_blocks.shape[0]
    b, _, n, g, d = q.shape

    def one_query_block(args):
        qi, q_blk = args

        def visit_key_block(carry, args):
            m, l, acc = carry  # [B, N, G, cq] x 2, [B, N, G, cq, D]
            kj, k_blk, v_blk = args
            s, keep, _ = _tile_scores(t, q_blk, k_blk, bias, mask, qi, kj)
            if keep is not None:
                s = jnp.where(keep, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            # While a row has seen no visible key its max is -inf; shift by 0 instead so
            # the exponentials below are exp(-inf) = 0 and not NaN.
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])  # [B, N, G, cq, ck]
            rescale = jnp.exp(m - shift)  # earlier blocks were summed relative to the old max
            l = l * rescale + p.sum(axis=-1)
            pv = jnp.einsum(
                "bngqk,bknd->bngqd", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32
            )
            return (m_new, l, acc * rescale[..., None] + pv), None

        init = (
            jnp.full((b, n, g, t.q_chunk), -jnp.inf, jnp.float32),
            jnp.zeros((b, n, g, t.q_chunk), jnp.float32),
            jnp.zeros((b, n, g, t.q_chunk, d), jnp.float32),
        )
        (m, l, acc), _ = lax.scan(visit_key_block, init, (jnp.arange(num_k), k_blocks, v_blocks))
        seen = l > 0  # False for rows that no key was visible to: output 0
        safe_l = jnp.where(seen, l, 1.0)
        out = acc / safe_l[..., None]  # [B, N, G, cq, D]
        lse = jnp.where(seen, m + jnp.log(safe_l), 0.0)  # [B, N, G, cq]
        return jnp.moveaxis(out, 3, 1).astype(q.dtype), lse

    out_blocks, lse = lax.map(one_query_block, (jnp.arange(num_q), q_blocks))
    return _unblock(out_blocks), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(t: _Tiling, q, k, v, bias, mask):
    return _flash_forward(t, q, k, v, bias, mask)[0]


def _flash_fwd(t: _Tiling, q, k, v, bias, mask):
    out, lse = _flash_forward(t, q, k, v, bias, mask)
    return out, (q, k, v, bias, mask, out, lse)  # O(Q + K) residuals, plus the bias if given


def _flash_bwd(t: _Tiling, residuals, d_out):
    """FlashAttention-2 style: for each key block, sweep the query blocks, accumulating dk, dv
    for that block and adding into dq (and the bias gradient) tile by tile."""
    q, k, v, bias, mask, out, lse = residuals
    q_blocks, do_blocks = _blocks(q, t.q_chunk), _blocks(d_out, t.q_chunk)  # [nq, B, cq, N, G, D]
    k_blocks, v_blocks = _blocks(k, t.k_chunk), _blocks(v, t.k_chunk)  # [nk, B, ck, N, D]
    # delta_i = sum_j p_ij dp_ij = do_i . o_i, the softmax-backward row term; [nq, B, N, G, cq]
    delta = jnp.einsum(
        "xbqngd,xbqngd->xbngq",
        do_blocks,
        _blocks(out, t.q_chunk),
        preferred_element_type=jnp.float32,
    )
    num_q, num_k = q_blocks.shape[0], k_blocks.shape[0]

    def one_key_block(carry, args):
        kj, k_blk, v_blk = args

        def visit_query_block(carry, args):
            dk, dv, dq, d_bias = carry
            qi, q_blk, do_blk, lse_blk, delta_blk = args
            s, keep, slope = _tile_scores(t, q_blk, k_blk, bias, mask, qi, kj)
            p = jnp.exp(s - lse_blk[..., None])  # [B, N, G, cq, ck], exact softmax weights
            if keep is not None:
                p = jnp.where(keep, p, 0.0)
            dv += jnp.einsum(
                "bngqk,bqngd->bknd",
                p.astype(do_blk.dtype),
                do_blk,
                preferred_element_type=jnp.float32,
            )
            dp = jnp.einsum("bqngd,bknd->bngqk", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_blk[..., None])  # gradient of the biased scores
            if d_bias is not None:
                d_bias = _add_tile(d_bias, ds, qi * t.q_chunk, kj * t.k_chunk)
            if slope is not None:
                ds = ds * slope  # back through cap * tanh(s / cap)
            ds = (ds * t.scale).astype(q_blk.dtype)
            dq_blk = jnp.einsum("bngqk,bknd->bqngd", ds, k_blk, preferred_element_type=jnp.float32)
            dq = lax.dynamic_update_index_in_dim(dq, dq[qi] + dq_blk, qi, 0)
            dk += jnp.einsum("bngqk,bqngd->bknd", ds, q_blk, preferred_element_type=jnp.float32)
            return (dk, dv, dq, d_bias), None

        dq, d_bias = carry
        zeros_kv = jnp.zeros(k_blk.shape, jnp.float32)
        xs = (jnp.arange(num_q), q_blocks, do_blocks, lse, delta)
        (dk, dv, dq, d_bias), _ = lax.scan(visit_query_block, (zeros_kv, zeros_kv, dq, d_bias), xs)
        return (dq, d_bias), (dk, dv)

    init = (
        jnp.zeros(q_blocks.shape, jnp.float32),
        None if bias is None else jnp.zeros(bias.shape, jnp.float32),
    )
    (dq, d_bias), (dk, dv) = lax.scan(one_key_block, init, (jnp.arange(num_k), k_blocks, v_blocks))
    dq = _unblock(dq).astype(q.dtype)
    dk, dv = _unblock(dk).astype(k.dtype), _unblock(dv).astype(v.dtype)
    d_bias = None if bias is None else d_bias.astype(bias.dtype)
    return dq, dk, dv, d_bias, None  # the mask gets no gradient


def _add_tile(d_bias, ds, q_start, k_start):
    """Add a tile's score gradient ``[B, N, G, cq, ck]`` into the bias gradient, first summing
    over the axes along which the bias was broadcast."""
    q_bcast, k_bcast = d_bias.shape[3] == 1, d_bias.shape[4] == 1
    axes = tuple(i for i in range(5) if d_bias.shape[i] == 1 and ds.shape[i] != 1)
    ds = ds.sum(axis=axes, keepdims=True)
    starts = (0, 0, 0, 0 if q_bcast else q_start, 0 if k_bcast else k_start)
    return lax.dynamic_update_slice(
        d_bias, lax.dynamic_slice(d_bias, starts, ds.shape) + ds, starts
    )


_flash.defvjp(_flash_fwd, _flash_bwd)
