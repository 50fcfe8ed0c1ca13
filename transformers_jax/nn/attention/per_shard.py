"""Running a Pallas kernel (``pallas``, ``splash``) on each device's shard: XLA cannot partition
a Mosaic or Triton call itself, so the kernel is mapped with ``shard_map`` over the mesh axes
the logical rules in context give ``batch`` and ``heads``."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from transformers_jax.nn.attention.platform import varying_axes


def per_shard(kernel, name: str, q, k, v, ab, segments):
    """``kernel(q, k, v, ab, segments)`` on each device's rows and heads (q ``[B, Q, H, D]``,
    k and v ``[B, K, N, D]``, ab ``[B, H, Q, K]`` or None, segments a pair ``[B, Q]``,
    ``[B, K]`` or None): inside ``shard_map`` over the mesh axes that the logical rules in
    context give ``batch`` and ``heads`` (flax's ``nn.logical_axis_rules``, set by the jit and
    single strategies). With no mesh or no rules (pmap, or already inside the shard_map
    strategy), or where nothing is split, it is called directly. An axis that does not divide
    its dimension (a small eval batch) is left whole. Query heads are split only where key/value
    heads split the same way (each shard keeps its groups whole), or where there is one
    key/value head (MQA), which every shard then holds."""
    if varying_axes(q, k, v, ab, segments):
        raise ValueError(
            f"attention implementation {name!r} cannot run inside shard_map(check_vma=True): "
            "JAX's Pallas kernels declare their outputs without the varying-axis types the "
            "check needs; pass check_vma=False to your shard_map (train.strategy=shard_map "
            "does), use train.strategy=jit, or attention=chunked")
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh.empty or not rules:
        return kernel(q, k, v, ab, segments)
    free = {axis for axis, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if kind != jax.sharding.AxisType.Manual}

    def axes(logical: str, *sizes: int):
        names = nn.logical_to_mesh_axes((logical,), rules)[0]
        names = () if names is None else ((names,) if isinstance(names, str) else tuple(names))
        names = tuple(a for a in names if a in free and mesh.shape[a] > 1)
        ways = math.prod(mesh.shape[a] for a in names)
        return names if names and all(size % ways == 0 for size in sizes) else None

    n = k.shape[2]
    batch = axes("batch", q.shape[0])
    heads = axes("heads", q.shape[2]) if n == 1 else axes("heads", q.shape[2], n)
    if batch is None and heads is None:
        return kernel(q, k, v, ab, segments)
    q_spec = P(batch, None, heads, None)
    kv_spec = P(batch, None, None if n == 1 else heads, None)
    specs = (q_spec, kv_spec, kv_spec, None if ab is None else P(batch, heads, None, None),
             None if segments is None else (P(batch, None), P(batch, None)))
    return jax.shard_map(kernel, in_specs=specs, out_specs=q_spec, check_vma=False)(
        q, k, v, ab, segments)


def kernel_segments(mask, q_len: int, k_len: int):
    """The ``(q [B, Q], kv [B, K])`` int32 segment ids a Pallas kernel masks by, from the
    mask's packed segments and key padding (padded keys get segment -1, which no query has);
    None when the mask has neither."""
    q_seg, kv_seg = mask.q_segments, mask.kv_segments
    if mask.kv_valid is not None:
        q_seg = jnp.zeros(mask.q_positions.shape, jnp.int32) if q_seg is None else q_seg
        kv_seg = jnp.zeros(mask.kv_positions.shape, jnp.int32) if kv_seg is None else kv_seg
        kv_seg = jnp.where(mask.kv_valid, kv_seg, -1)
    if q_seg is None:
        return None
    b = max(q_seg.shape[0], kv_seg.shape[0])
    return (jnp.broadcast_to(q_seg, (b, q_len)).astype(jnp.int32),
            jnp.broadcast_to(kv_seg, (b, k_len)).astype(jnp.int32))
