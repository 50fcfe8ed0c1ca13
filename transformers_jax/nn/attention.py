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
- ``pallas``: the Pallas flash-attention kernels shipped with JAX, TPU (and NVIDIA GPU via
  Triton) only; causal/segment masks; a clear error on other backends.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from transformers_jax.config import ConfigError
from transformers_jax.nn.masks import AttentionMask, as_dense
from transformers_jax.registry import ATTENTION, Switch

Mask = AttentionMask | jax.Array | None


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask: Mask = None,
    implementation: str | AttentionImpl = "reference",
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
    _check_inputs(q, k, v, bias, mask, logit_softcap)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
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
        s = s + _group_heads(bias, n)[:, :, :, 0].astype(jnp.float32)  # [B|1, N|1, G|1, S|1]
    mask = as_dense(mask)
    if mask is not None:
        s = jnp.where(_group_heads(mask, n)[:, :, :, 0], s, -jnp.inf)
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = (e / jnp.where(total > 0, total, 1.0)).astype(v.dtype)  # sees no key: all zero
    out = jnp.einsum("bngs,bnsd->bngd", p[..., :k_len], v, preferred_element_type=jnp.float32)
    if v_new is not None:
        out = out + jnp.einsum("bngs,bnsd->bngd", p[..., k_len:], v_new,
                               preferred_element_type=jnp.float32)
    return out.reshape(b, 1, h, d).astype(q.dtype)


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


@functools.cache
def _contraction(spec: str):
    """``spec``'s ``lax.dot_general`` dimension numbers and the permutation that puts its
    output (batch, then the left operand's free axes, then the right's) in the spec's order."""
    inputs, out = spec.split("->")
    left, right = inputs.split(",")
    batch = [c for c in left if c in right and c in out]
    summed = [c for c in left if c in right and c not in out]
    order = batch + [c for c in left if c not in right] + [c for c in right if c not in left]
    if sorted(order) != sorted(out) or len(set(left)) != len(left) or len(set(right)) != len(
            right):
        raise ValueError(f"_contract handles two-operand einsums without traces or repeated "
                         f"axes, got {spec!r}")
    dims = ((tuple(left.index(c) for c in summed), tuple(right.index(c) for c in summed)),
            (tuple(left.index(c) for c in batch), tuple(right.index(c) for c in batch)))
    return dims, tuple(order.index(c) for c in out)


def _contract(spec: str, a: jax.Array, b: jax.Array, preferred_element_type=None) -> jax.Array:
    """``jnp.einsum(spec, a, b, preferred_element_type=...)`` for two operands without
    size-1 broadcasting, as one ``lax.dot_general``: the same numbers. The tile loops call
    it hundreds of times per step, and each ``jnp.einsum`` re-plans its contraction and enters
    a nested ``jit`` while tracing (about a sixth of config a's tracing time)."""
    dims, perm = _contraction(spec)
    out = lax.dot_general(a, b, dims, preferred_element_type=preferred_element_type)
    return out if perm == tuple(range(len(perm))) else lax.transpose(out, perm)


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


def reference_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=None):
    """Plain einsum + softmax; materialises the ``[B, H, Q, K]`` scores. The oracle."""
    del chunk_size  # only the chunked kernel tiles
    b, q_len, h, d = q.shape
    p = _reference_probs(q, k, bias, as_dense(mask), scale, logit_softcap)  # [B, N, G, Q, K]
    out = jnp.einsum("bngqk,bknd->bqngd", p, v.astype(jnp.float32))  # [B, Q, N, G, D]
    return out.reshape(b, q_len, h, d).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# xla and cudnn: jax.nn.dot_product_attention


def target_platform() -> str:
    """The platform this computation is being traced for: that of the mesh in context (set by
    ``jax.set_mesh`` or a ``shard_map``), so an ahead-of-time compile for a TPU topology from a
    CPU host picks the TPU path; else ``jax.default_backend()``. ``cuda``/``rocm`` read ``gpu``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = jax.default_backend() if device is None else device.platform
    return "gpu" if platform in ("cuda", "rocm") else platform


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


def cudnn_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=None):
    """cuDNN's fused flash attention through ``jax.nn``; NVIDIA GPUs, bf16/fp16 inputs."""
    del chunk_size
    _refuse_softcap("cudnn", logit_softcap)
    backend = target_platform()
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
# pallas: the Pallas flash-attention kernels that ship with JAX (TPU; NVIDIA GPU via Triton)


def _pallas_mask_parts(mask, q_len: int, k_len: int, implementation: str):
    """(causal, segment ids or None) for a Pallas kernel, or a ValueError naming what it cannot
    express. The kernels take causality by array index and masks by segment-id equality."""
    if mask is None:
        return False, None
    if not isinstance(mask, AttentionMask):
        raise ValueError(
            f"attention implementation {implementation!r} takes an AttentionMask (causal and/or "
            "segments), not a dense boolean mask; use chunked, xla or reference"
        )
    if mask.window is not None or mask.prefix_len is not None:
        raise ValueError(
            f"attention implementation {implementation!r} supports causal and segment masks "
            "only (no sliding window, no prefix-LM); use chunked"
        )
    if mask.causal and q_len != k_len:
        raise ValueError(
            f"attention implementation {implementation!r} applies causality by index, which "
            f"needs as many queries as keys (got {q_len} and {k_len}: a KV cache); decode "
            "with chunked or xla"
        )
    q_seg, kv_seg = mask.q_segments, mask.kv_segments
    if mask.kv_valid is not None:  # padding: give padded keys a segment no query has
        q_seg = jnp.zeros(mask.q_positions.shape, jnp.int32) if q_seg is None else q_seg
        kv_seg = jnp.zeros(mask.kv_positions.shape, jnp.int32) if kv_seg is None else kv_seg
        kv_seg = jnp.where(mask.kv_valid, kv_seg, -1)
    if q_seg is None:
        return mask.causal, None
    b = max(q_seg.shape[0], kv_seg.shape[0])
    return mask.causal, (jnp.broadcast_to(q_seg, (b, q_len)).astype(jnp.int32),
                         jnp.broadcast_to(kv_seg, (b, k_len)).astype(jnp.int32))


def pallas_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=128):
    """Pallas flash attention: ``jax.experimental.pallas.ops.tpu.flash_attention`` on TPU, the
    Triton kernel ``jax.experimental.pallas.ops.gpu.attention.mha`` on NVIDIA GPUs.

    Causal and packed-segment masks (and key padding, as a segment) only, causality by index
    (queries and keys aligned, no KV cache); bias on TPU only; grouped k/v heads are repeated to
    the query heads. The path follows the devices compiled for (``target_platform``), and the
    kernel runs per shard inside ``shard_map`` over the batch and head mesh axes of the logical
    rules in context (XLA cannot partition a Mosaic/Triton call itself), so it works under
    the single and jit strategies with any data/FSDP/tensor mesh, and under pmap. Inside a
    ``shard_map`` the kernel runs on the local shard as it is, but only with
    ``check_vma=False``: JAX's kernels give their outputs no varying-axis types (a clear error
    says so); the shard_map strategy turns the check off for it (``typed_under_shard_map``).
    ``tjax plan`` compiles it for TPU; CI has no TPU or GPU to run it on (BENCHMARKS.md says
    how to check it).
    """
    del chunk_size
    _refuse_softcap("pallas", logit_softcap)
    backend = target_platform()
    if backend not in ("tpu", "gpu"):
        raise RuntimeError(
            f"attention implementation 'pallas' needs a TPU (Pallas flash attention) or an "
            f"NVIDIA GPU (Pallas Triton flash attention); jax backend is {backend!r}: use "
            "chunked (the same blockwise algorithm in plain JAX, any backend), xla or reference"
        )
    b, q_len, h, d = q.shape
    n = k.shape[2]
    if n != h:  # the kernels want one k/v head per query head
        k, v = jnp.repeat(k, h // n, axis=2), jnp.repeat(v, h // n, axis=2)
    k_len = k.shape[1]
    causal, segments = _pallas_mask_parts(mask, q_len, k_len, "pallas")
    for name, length in (("query", q_len), ("key", k_len)):  # the kernels' 128-wide blocks
        if length % min(128, length) or (backend == "tpu" and length % 128):
            raise ValueError(
                f"attention implementation 'pallas' needs {name} lengths that are a multiple "
                f"of 128{' (or below 128 on GPU)' if backend == 'gpu' else ''}; got {length}: "
                "pad the sequence or use chunked"
            )
    if backend == "tpu":
        from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

        ab = None
        if bias is not None:
            ab = jnp.broadcast_to(_as_4d(bias), (b, h, q_len, k_len)).astype(jnp.float32)

        def kernel(q, k, v, ab, segments):  # [B, T, H, D] in and out, per shard
            out = tpu_flash.flash_attention(
                q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                ab=ab, segment_ids=None if segments is None else tpu_flash.SegmentIds(*segments),
                causal=causal, sm_scale=scale,
            )
            return out.transpose(0, 2, 1, 3)

        return _per_shard(kernel, q, k, v, ab, segments).astype(q.dtype)
    if bias is not None:
        raise ValueError(
            "attention implementation 'pallas' takes no bias on GPU (the Triton kernel has "
            "none); use cudnn, chunked or xla for ALiBi/T5/FIRE"
        )
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    if segments is not None and (mask.kv_valid is not None or mask.q_segments is not
                                 mask.kv_segments):
        raise ValueError(
            "the Pallas GPU kernel takes one segment-id array for queries and keys (packed "
            "self-attention); key padding or distinct key segments need cudnn or chunked"
        )

    def gpu_kernel(q, k, v, ab, segments):
        del ab
        return gpu_attention.mha(q, k, v, segment_ids=None if segments is None else segments[0],
                                 sm_scale=scale, causal=causal)

    return _per_shard(gpu_kernel, q, k, v, None, segments).astype(q.dtype)


def _per_shard(kernel, q, k, v, ab, segments):
    """``kernel(q, k, v, ab, segments)`` on each device's rows and heads: inside ``shard_map``
    over the mesh axes that the logical rules in context give ``batch`` and ``heads`` (flax's
    ``nn.logical_axis_rules``, set by the jit and single strategies). With no mesh or no rules
    (pmap, or already inside the shard_map strategy), or where nothing is split, it is called
    directly. An axis that does not divide its dimension (a small eval batch) is left whole."""
    if _vma(q, k, v, ab, segments):
        raise ValueError(
            "attention implementation 'pallas' cannot run inside shard_map(check_vma=True): "
            "JAX's Pallas kernels declare their outputs without the varying-axis types the "
            "check needs; pass check_vma=False to your shard_map (train.strategy=shard_map "
            "does), use train.strategy=jit, or attention=chunked")
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh.empty or not rules:
        return kernel(q, k, v, ab, segments)
    free = {name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if kind != jax.sharding.AxisType.Manual}

    def axes(logical: str, size: int):
        names = nn.logical_to_mesh_axes((logical,), rules)[0]
        names = () if names is None else ((names,) if isinstance(names, str) else tuple(names))
        names = tuple(a for a in names if a in free and mesh.shape[a] > 1)
        ways = math.prod(mesh.shape[a] for a in names)
        return names if names and size % ways == 0 else None

    batch, heads = axes("batch", q.shape[0]), axes("heads", q.shape[2])
    if batch is None and heads is None:
        return kernel(q, k, v, ab, segments)
    qkv = P(batch, None, heads, None)
    specs = (qkv, qkv, qkv, None if ab is None else P(batch, heads, None, None),
             None if segments is None else (P(batch, None), P(batch, None)))
    return jax.shard_map(kernel, in_specs=specs, out_specs=qkv, check_vma=False)(
        q, k, v, ab, segments)


# --------------------------------------------------------------------------------------------
# chunked: flash attention in pure JAX
#
# Queries and keys are cut into tiles of q_chunk x k_chunk. The forward pass visits, for each
# query block, every key block in turn, keeping a running row maximum m, a running softmax
# denominator l and an unnormalised output; it stores only the output and the per-row
# logsumexp. The backward pass recomputes each tile's probabilities from that logsumexp, so no
# [Q, K] array ever exists: memory is O(Q + K) plus one tile.
#
# Two things make it fast on CPU (BENCHMARKS.md has the measurements):
# - Block-major, head-major layout. q is laid out as [nq, B, N, G, cq, D] and k, v as
#   [nk, B, N, ck, D]: a tile's block is one contiguous slab, and every tile product is a
#   batched matmul whose batch axes (B, N) lead and whose rows are contiguous (the
#   [B, Q, N, G, D] layout made XLA copy each tile transposed).
# - Key-major tiles in the backward pass ([B, N, ck, G, cq]): each product then contracts a
#   minor axis of its left operand, as the CPU matmul library wants; query-major tiles made XLA
#   copy every tile's p and ds transposed (for dv and dk).
# - Tile skipping. A tile in which the mask hides every key is skipped at run time (for a causal
#   mask about half of them). It is decided from the tile's mask values themselves, so it is
#   exact for any mask (packed segments, a ring-buffer KV cache, padding). A third run-time
#   branch for fully visible tiles (no masking work) measured no faster and compiles slower.
# - Tiles decided ahead. When the loops are unrolled and the model made the positions itself
#   (``AttentionMask.aligned``: no packing, no cache), a tile's visibility follows from its
#   offsets: invisible tiles leave the program, fully visible ones lose their masking, and no
#   tile keeps a run-time branch (fewer ops and no conditionals to compile).


def chunked_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=128,
                      unroll_tiles=16):
    """Blockwise online-softmax attention; any lengths (padded to whole tiles internally).

    With at most ``unroll_tiles`` tiles (query blocks x key blocks) the tile loops are unrolled:
    every tile's offsets are constants, so the loops' dynamic slices, updates and bookkeeping
    go, at the price of a compile that grows with the tile count (BENCHMARKS.md, section 2e).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    b, q_len, h, d = q.shape
    k_len, n = k.shape[1], k.shape[2]
    q_chunk, k_chunk = min(chunk_size, q_len), min(chunk_size, k_len)
    q_pad, k_pad = -q_len % q_chunk, -k_len % k_chunk

    g, num_q, num_k = h // n, (q_len + q_pad) // q_chunk, (k_len + k_pad) // k_chunk
    # Block-major: tile i of q is q[i], one contiguous slab (a slice costs no copy).
    q = _pad_axis(q.reshape(b, q_len, n, g, d), 1, q_pad).reshape(b, num_q, q_chunk, n, g, d)
    q = q.transpose(1, 0, 3, 4, 2, 5)  # [nq, B, N, G, cq, D]
    k = _pad_axis(k, 1, k_pad).reshape(b, num_k, k_chunk, n, d).transpose(1, 0, 3, 2, 4)
    v = _pad_axis(v, 1, k_pad).reshape(b, num_k, k_chunk, n, d).transpose(1, 0, 3, 2, 4)
    if bias is not None:
        bias = _pad_scores(_group_heads(bias, n), q_pad, k_pad)  # [B|1, N|1, G|1, Qp|1, Kp|1]
    if isinstance(mask, AttentionMask):
        mask = _pad_attention_mask(mask, q_pad, k_pad)
    elif mask is not None:
        mask = _pad_scores(_group_heads(mask, n), q_pad, k_pad)

    tiling = _Tiling(scale, logit_softcap, q_chunk, k_chunk, q_len, k_len,
                     num_q * num_k <= unroll_tiles)
    out = _flash(tiling, q, k, v, bias, mask)  # [nq, B, N, G, cq, D]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, num_q * q_chunk, h, d)
    return out[:, :q_len]  # padded queries dropped


class _Tiling(NamedTuple):
    """The static settings of one chunked call (hashable: a custom_vjp non-diff argument)."""

    scale: float
    softcap: float | None
    q_chunk: int
    k_chunk: int
    q_len: int  # the true query length: queries at or past it are padding
    k_len: int  # the true key length: keys at or past it are padding
    unroll: bool  # the tile loops unrolled (Python loops, static offsets) or kept as loops


def _fold(body, init, length: int, unroll: bool):
    """``lax.scan(body, init, arange(length))``; unrolled, a Python loop that hands ``body``
    plain ints, so tile offsets are static and ``_tile_plan`` can decide tiles at trace time."""
    if not unroll:
        return lax.scan(body, init, jnp.arange(length))
    carry, ys = init, []
    for i in range(length):
        carry, y = body(carry, i)
        ys.append(y)
    return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys) if ys[0] is not None else None


def _blocks_init(shape: tuple, count: int, unroll: bool):
    """Zeroed float32 accumulators for ``count`` blocks of ``shape``: one array per block when
    unrolled (each sum stays its own buffer: updating a stacked one in place made XLA copy all
    of it before every update), else one stacked array that a loop updates in place."""
    if unroll:
        return tuple(jnp.zeros(shape, jnp.float32) for _ in range(count))
    return jnp.zeros((count, *shape), jnp.float32)


def _blocks_add(blocks, index, x: jax.Array):
    """Add ``x`` into block ``index`` of ``_blocks_init``'s accumulators."""
    if isinstance(blocks, tuple):
        return (*blocks[:index], blocks[index] + x, *blocks[index + 1:])
    return lax.dynamic_update_index_in_dim(blocks, _take(blocks, index) + x, index, 0)


def _blocks_stack(blocks) -> jax.Array:
    return jnp.stack(blocks) if isinstance(blocks, tuple) else blocks


def _tile_plan(t: _Tiling, mask, qi, kj) -> str:
    """How tile (qi, kj) is computed: ``"skip"`` (no key visible: not at all), ``"full"``
    (every key visible: no masking), ``"masked"`` (some keys visible: masked element by
    element) or ``"unknown"`` (masked, and skipped at run time when no key is visible). Only
    static offsets of tiles without padding are decided ahead."""
    if not isinstance(qi, int):
        return "unknown"
    q_start, k_start = qi * t.q_chunk, kj * t.k_chunk
    if q_start + t.q_chunk > t.q_len or k_start + t.k_chunk > t.k_len:
        return "unknown"
    if mask is None:
        return "full"
    if not isinstance(mask, AttentionMask):
        return "unknown"
    seen = mask.tile_visibility(q_start, t.q_chunk, k_start, t.k_chunk)
    return {"none": "skip", "all": "full", "some": "masked"}.get(seen, "unknown")


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


def _tile_keep(t: _Tiling, mask, qi, kj) -> jax.Array | None:
    """The boolean ``keep`` of tile (qi, kj), broadcastable to ``[B, N, G, cq, ck]``; None
    when every key counts (no mask and no key padding)."""
    q_start, k_start = qi * t.q_chunk, kj * t.k_chunk
    keep = None
    if isinstance(mask, AttentionMask):
        keep = mask.block(q_start, t.q_chunk, k_start, t.k_chunk)[:, :, None]  # [B,1,1,cq,ck]
    elif mask is not None:
        keep = _tile(mask, t, qi, kj)
    if t.k_len % t.k_chunk:  # the last key block holds padding
        real = k_start + jnp.arange(t.k_chunk) < t.k_len  # [ck]
        keep = real if keep is None else keep & real
    return keep


def _tile(x: jax.Array | None, t: _Tiling, qi, kj) -> jax.Array | None:
    """Tile (qi, kj) ``[.., cq, ck]`` of a 5-D bias or mask (None stays None); size-1 axes
    stay size 1."""
    if x is None:
        return None
    q_bcast, k_bcast = x.shape[3] == 1, x.shape[4] == 1
    starts = (0, 0, 0, 0 if q_bcast else qi * t.q_chunk, 0 if k_bcast else kj * t.k_chunk)
    sizes = (*x.shape[:3], 1 if q_bcast else t.q_chunk, 1 if k_bcast else t.k_chunk)
    return lax.dynamic_slice(x, starts, sizes)


def _scores(t: _Tiling, s, bias_tile):
    """Raw tile products -> the scores (scaled, soft-capped, biased; float32), and with a
    softcap the slope ``d capped / d raw`` that the backward pass needs (else None)."""
    s = s * t.scale
    slope = None
    if t.softcap is not None:
        s = t.softcap * jnp.tanh(s / t.softcap)
        slope = 1.0 - jnp.square(s / t.softcap)
    if bias_tile is not None:
        s = s + bias_tile.astype(jnp.float32)
    return s, slope


def _vma(*trees) -> frozenset:
    """The mesh axes any leaf of ``trees`` varies over (inside ``shard_map``; else none)."""
    def axes(x) -> frozenset:  # ShapedArray.vma in older JAX, .mat.varying since 0.9
        aval = jax.typeof(x)
        return frozenset(getattr(getattr(aval, "mat", None), "varying", None)
                         or getattr(aval, "vma", None) or ())

    return frozenset().union(*(axes(x) for x in jax.tree.leaves(trees)))


def _vary(tree, vma: frozenset):
    """Mark every leaf as varying over ``vma``: inside ``shard_map`` the branches of a cond
    and the carries of a scan must agree, and fresh zeros vary over nothing."""
    def cast(x):
        missing = tuple(sorted(vma - _vma(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree) if vma else tree


def _visit_tile(t: _Tiling, mask, qi, kj, plan: str, compute, skipped, vma: frozenset):
    """``compute(keep)`` for tile (qi, kj) of a ``plan`` other than "skip": no ``keep`` when
    every key is visible; when the plan is unknown, ``skipped()`` instead if no key of the
    tile is visible (decided at run time), both varying over ``vma``."""
    keep = None if plan == "full" else _tile_keep(t, mask, qi, kj)
    if plan != "unknown" or keep is None:
        return compute(keep)
    return lax.cond(jnp.any(keep), lambda: _vary(compute(keep), vma),
                    lambda: _vary(skipped(), vma))


def _take(blocks: jax.Array, index) -> jax.Array:
    """Block ``index`` of a block-major array (its leading axis): contiguous, so no copy."""
    return lax.dynamic_index_in_dim(blocks, index, 0, keepdims=False)


def _key_major(x: jax.Array | None) -> jax.Array | None:
    """A tile's mask or bias ``[.., cq, ck]`` (or a key mask ``[ck]``) laid out like the
    backward pass's key-major scores ``[B, N, ck, G, cq]``."""
    if x is None:
        return None
    return x[:, None, None] if x.ndim == 1 else jnp.moveaxis(x, 4, 2)


def _flash_forward(t: _Tiling, q, k, v, bias, mask):
    """q ``[nq, B, N, G, cq, D]``, k, v ``[nk, B, N, ck, D]`` (block-major) -> output like q
    and the logsumexp per row ``[nq, B, N, G, cq]`` float32."""
    num_q, b, n, g, _, d = q.shape
    num_k = k.shape[0]
    vma = _vma(q, k, v, bias, mask)

    def one_query_block(qi):
        q_blk = _take(q, qi)  # [B, N, G, cq, D]

        def visit_key_block(carry, kj):
            m, l, acc = carry  # [B, N, G, cq] x 2, [B, N, G, cq, D]
            plan = _tile_plan(t, mask, qi, kj)
            if plan == "skip":
                return carry, None
            k_blk, v_blk = _take(k, kj), _take(v, kj)

            def compute(keep):
                s = _contract("bngqd,bnkd->bngqk", q_blk, k_blk,
                              preferred_element_type=jnp.float32)
                s, _ = _scores(t, s, _tile(bias, t, qi, kj))
                if keep is not None:
                    s = jnp.where(keep, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=-1))
                # While a row has seen no visible key its max is -inf; shift by 0 instead so
                # the exponentials below are exp(-inf) = 0 and not NaN.
                shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - shift[..., None])  # [B, N, G, cq, ck]
                rescale = jnp.exp(m - shift)  # earlier blocks were summed relative to the old max
                pv = _contract(
                    "bngqk,bnkd->bngqd", p.astype(v.dtype), v_blk,
                    preferred_element_type=jnp.float32,
                )
                return m_new, l * rescale + p.sum(axis=-1), acc * rescale[..., None] + pv

            return _visit_tile(t, mask, qi, kj, plan, compute, lambda: carry, vma), None

        init = _vary((
            jnp.full((b, n, g, t.q_chunk), -jnp.inf, jnp.float32),
            jnp.zeros((b, n, g, t.q_chunk), jnp.float32),
            jnp.zeros((b, n, g, t.q_chunk, d), jnp.float32),
        ), vma)
        (m, l, acc), _ = _fold(visit_key_block, init, num_k, t.unroll)
        seen = l > 0  # False for rows that no key was visible to: output 0
        safe_l = jnp.where(seen, l, 1.0)
        out = (acc / safe_l[..., None]).astype(q.dtype)  # [B, N, G, cq, D]
        lse = jnp.where(seen, m + jnp.log(safe_l), 0.0)  # [B, N, G, cq]
        return out, lse

    _, (out, lse) = _fold(lambda c, qi: (c, one_query_block(qi)), None, num_q, t.unroll)
    return out, lse  # [nq, B, N, G, cq, D], [nq, B, N, G, cq]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(t: _Tiling, q, k, v, bias, mask):
    return _flash_forward(t, q, k, v, bias, mask)[0]


def _flash_fwd(t: _Tiling, q, k, v, bias, mask):
    out, lse = _flash_forward(t, q, k, v, bias, mask)
    return out, (q, k, v, bias, mask, out, lse)  # O(Q + K) residuals, plus the bias if given


def _flash_bwd(t: _Tiling, residuals, d_out):
    """FlashAttention-2 style: for each key block, sweep the query blocks, accumulating dk, dv
    for that block and adding into dq (and the bias gradient) tile by tile.

    Tiles are key-major here, ``[B, N, ck, G, cq]``: every product then contracts a minor axis
    of its left operand, which the CPU matmul library takes as it is. Query-major tiles made
    XLA copy each tile's p and ds transposed (for dv and dk); now only k is transposed, once
    per key block (for dq, accumulated as dq^T and transposed once)."""
    q, k, v, bias, mask, out, lse = residuals
    vma = _vma(q, k, v, bias, mask, out, lse, d_out)
    num_q, b, n, g, cq, d = q.shape
    num_k, dq_t_shape = k.shape[0], (b, n, d, g, cq)  # dq^T blocks
    # delta_i = sum_j p_ij dp_ij = do_i . o_i, the softmax-backward row term; [nq, B, N, G, cq]
    delta = _contract("jbngqd,jbngqd->jbngq", d_out, out, preferred_element_type=jnp.float32)

    def one_key_block(carry, kj):
        dq_t, d_bias = carry  # nq blocks of dq^T [B, N, D, G, cq]
        k_blk, v_blk = _take(k, kj), _take(v, kj)  # [B, N, ck, D]
        k_t = jnp.swapaxes(k_blk, 2, 3)  # [B, N, D, ck]
        if target_platform() == "cpu":  # materialised: else XLA folds the transpose back into
            k_t = lax.optimization_barrier(k_t)  # dq's product, which its own emitter then runs

        def visit_query_block(carry, qi):
            dk, dv, dq_t, d_bias = carry
            plan = _tile_plan(t, mask, qi, kj)
            if plan == "skip":
                return carry, None
            q_blk, do_blk = _take(q, qi), _take(d_out, qi)  # [B, N, G, cq, D]
            lse_blk = _take(lse, qi)[:, :, None]  # [B, N, 1, G, cq]
            delta_blk = _take(delta, qi)[:, :, None]

            def compute(keep):
                s = _contract("bnkd,bngqd->bnkgq", k_blk, q_blk,
                              preferred_element_type=jnp.float32)
                s, slope = _scores(t, s, _key_major(_tile(bias, t, qi, kj)))
                p = jnp.exp(s - lse_blk)  # [B, N, ck, G, cq], exact softmax weights
                if keep is not None:
                    p = jnp.where(_key_major(keep), p, 0.0)
                dv_blk = _contract(
                    "bnkgq,bngqd->bnkd", p.astype(do_blk.dtype), do_blk,
                    preferred_element_type=jnp.float32,
                )
                dp = _contract(
                    "bnkd,bngqd->bnkgq", v_blk, do_blk, preferred_element_type=jnp.float32
                )
                ds_biased = p * (dp - delta_blk)  # gradient of the biased scores
                ds = ds_biased if slope is None else ds_biased * slope  # back through the cap
                ds = (ds * t.scale).astype(q_blk.dtype)
                dk_blk = _contract(
                    "bnkgq,bngqd->bnkd", ds, q_blk, preferred_element_type=jnp.float32
                )
                dq_t_blk = _contract(
                    "bndk,bnkgq->bndgq", k_t, ds, preferred_element_type=jnp.float32
                )
                ds_tile = None if d_bias is None else jnp.moveaxis(ds_biased, 2, 4)
                return dk_blk, dv_blk, dq_t_blk, ds_tile

            def skipped():
                zeros_kv = jnp.zeros(k_blk.shape, jnp.float32)
                zeros_ds = None
                if d_bias is not None:
                    zeros_ds = jnp.zeros((*q_blk.shape[:-1], t.k_chunk), jnp.float32)
                return zeros_kv, zeros_kv, jnp.zeros(dq_t_shape, jnp.float32), zeros_ds

            dk_blk, dv_blk, dq_t_blk, ds = _visit_tile(t, mask, qi, kj, plan, compute, skipped,
                                                       vma)
            dq_t = _blocks_add(dq_t, qi, dq_t_blk)
            if d_bias is not None:
                d_bias = _add_tile(d_bias, ds, qi * t.q_chunk, kj * t.k_chunk)
            return (dk + dk_blk, dv + dv_blk, dq_t, d_bias), None

        zeros_kv = _vary(jnp.zeros(k_blk.shape, jnp.float32), vma)
        (dk, dv, dq_t, d_bias), _ = _fold(
            visit_query_block, (zeros_kv, zeros_kv, dq_t, d_bias), num_q, t.unroll
        )
        return (dq_t, d_bias), (dk, dv)

    init = _vary((
        _blocks_init(dq_t_shape, num_q, t.unroll),
        None if bias is None else jnp.zeros(bias.shape, jnp.float32),
    ), vma)
    (dq_t, d_bias), (dk, dv) = _fold(one_key_block, init, num_k, t.unroll)
    dq = jnp.moveaxis(_blocks_stack(dq_t), 3, 5)  # [nq, B, N, G, cq, D]
    d_bias = None if bias is None else d_bias.astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_bias, None


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


# --------------------------------------------------------------------------------------------
# The attention switch of the config: each entry says what it supports and how it attends.


@dataclasses.dataclass(frozen=True)
class AttentionImpl(Switch):
    """Base of every ``registry.ATTENTION`` entry: its ``kernel`` (one of the functions above)
    and what it supports. ``softcap``: can apply ``attn_logit_softcap``. ``dense_masks``:
    takes any boolean mask (otherwise only causal and segment masks: no window, no prefix-LM).
    ``backends``: the JAX platforms it runs on. ``typed_under_shard_map``: its outputs carry
    the varying-axis types ``shard_map(check_vma=True)`` needs (the shard_map strategy turns
    the check off for a kernel without them). ``oracle``: the plain definition the others are
    checked against (every score materialised, every feature): for tests, never a candidate in
    a speed comparison. Settings of the kernel are dataclass fields (passed on by
    ``kernel_options``)."""

    kernel: ClassVar[Any] = None
    oracle: ClassVar[bool] = False
    softcap: ClassVar[bool] = True
    dense_masks: ClassVar[bool] = True
    backends: ClassVar[tuple[str, ...]] = ("cpu", "gpu", "tpu")
    typed_under_shard_map: ClassVar[bool] = True

    def kernel_options(self) -> dict:
        return {}

    def attend(self, q, k, v, *, bias, mask, scale, logit_softcap) -> jax.Array:
        return type(self).kernel(q, k, v, bias=bias, mask=mask, scale=scale,
                                 logit_softcap=logit_softcap, **self.kernel_options())

    def check(self, config: Any) -> None:
        if config.attn_logit_softcap is not None and not self.softcap:
            raise ConfigError(
                f"attention={self.name!r}: the {self.name} kernel cannot soft-cap attention "
                "logits; use attention=reference or attention=chunked with attn_logit_softcap")
        window = getattr(config.mask, "window", None)
        if not self.dense_masks and (window is not None or config.mask.needs_prefix_len):
            raise ConfigError(
                f"attention={self.name!r}: supports causal and segment masks only, not "
                f"mask={config.mask.name}; use attention=chunked")


@ATTENTION.register("reference")
@dataclasses.dataclass(frozen=True)
class Reference(AttentionImpl):
    kernel = staticmethod(reference_attention)
    oracle: ClassVar[bool] = True


@ATTENTION.register("xla")
@dataclasses.dataclass(frozen=True)
class Xla(AttentionImpl):
    kernel = staticmethod(xla_attention)
    softcap: ClassVar[bool] = False


@ATTENTION.register("cudnn")
@dataclasses.dataclass(frozen=True)
class Cudnn(AttentionImpl):
    kernel = staticmethod(cudnn_attention)
    softcap: ClassVar[bool] = False
    backends: ClassVar[tuple[str, ...]] = ("gpu",)


@ATTENTION.register("pallas")
@dataclasses.dataclass(frozen=True)
class Pallas(AttentionImpl):
    kernel = staticmethod(pallas_attention)
    softcap: ClassVar[bool] = False
    dense_masks: ClassVar[bool] = False
    backends: ClassVar[tuple[str, ...]] = ("gpu", "tpu")
    typed_under_shard_map: ClassVar[bool] = False  # pallas_call outputs have no vma


@ATTENTION.register("chunked")
@dataclasses.dataclass(frozen=True)
class Chunked(AttentionImpl):
    """``chunk_size``: the tile length (queries and keys). ``unroll_tiles``: unroll the tile
    loops of a call with at most this many tiles (faster steps, longer compiles; 0: never)."""

    kernel = staticmethod(chunked_attention)
    chunk_size: int = 128
    unroll_tiles: int = 16

    def kernel_options(self) -> dict:
        return {"chunk_size": self.chunk_size, "unroll_tiles": self.unroll_tiles}

    def check(self, config: Any) -> None:
        super().check(config)
        if self.chunk_size <= 0:
            raise ConfigError(f"attention.chunk_size={self.chunk_size!r}: must be positive")
        if self.unroll_tiles < 0:
            raise ConfigError(f"attention.unroll_tiles={self.unroll_tiles!r}: must be >= 0 "
                              "(0 keeps the tile loops rolled)")
