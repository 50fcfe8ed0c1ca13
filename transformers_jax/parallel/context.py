"""Context parallelism: the sequence of every activation split over the ``context`` mesh axis,
and attention computed across the shards.

Shape legend: B batch, Q query length, K key length, H query heads, N key/value heads,
G = H // N, D head dim, c context shards; lower case (b, q, k, h, n) is one device's share,
q = Q / c and k = K / c.

Under the ``jit`` strategy the model is traced on global arrays. The rules table maps the
activations' ``length`` to ``context``, so GSPMD splits the token-wise work (embeddings, norms,
MLP, the LM head, the loss) by sequence with no communication. Positions are global arrays
too: each shard's tokens keep their global positions, and RoPE/xPos rotations, learned and
sinusoidal tables, randomized draws, the ALiBi/T5/FIRE/KERPLE biases and the mask are computed
as on one device. Only attention mixes positions. ``strategies.mesh_rules`` enters
``nn.attention.across_shards`` with ``attention_hook(...)``, so the model's
``dot_product_attention`` hands its q, k, v, bias and mask here; one ``shard_map`` over the mesh
gives each device its queries ``[b, q, h, D]`` and keys/values ``[b, k, n, D]``, and either

- ``all_gather``: gathers the keys and values (and their positions, padding and segment ids)
  over ``context`` and runs the configured kernel on its queries against every key; or
- ``ring``: passes key/value blocks round the ``context`` axis with ``lax.ppermute`` (c - 1
  hops) and accumulates an online softmax in float32, so a device holds one remote block at a
  time; the block maths is this module's (the configured kernel is not used).

The mask is rebuilt on each device from positions (an ``AttentionMask``'s causal, window and
prefix rules, padding, segments), never from array indices, so what a query sees does not
depend on where its keys live. A dense boolean mask and the bias, ``[.., q, K]`` per device,
are split along queries and sliced along keys. Not yet: skipping the blocks a causal mask
hides (each ring step computes every block) and balancing that work (zigzag order); a backward
pass that recomputes blocks instead of keeping each step's scores; sharding the KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from transformers_jax.config import CONTEXT_ATTENTION, ConfigError
from transformers_jax.nn.attention.api import AttentionHook, as_4d, group_heads
from transformers_jax.nn.masks import AttentionMask
from transformers_jax.parallel.rules import (
    LOGICAL_RULES,
    LogicalRules,
    context_parallel_size,
    length_axes,
)

__all__ = ["CONTEXT_ATTENTION", "attention_hook", "check_context", "method_refusal"]


def check_context(strategy: str, mesh: Mesh, rules: LogicalRules, example_batch: Mapping,
                  attention: Any, method: str) -> None:
    """Refuse, with the reason and the fix, what context parallelism cannot run: a strategy
    other than ``jit``, a sequence that does not split evenly, a kernel the gathered keys
    would misuse. Nothing to check on a mesh without a context axis."""
    if method not in CONTEXT_ATTENTION:
        raise ConfigError(f"train.context_attention={method!r}: valid choices: "
                          f"{', '.join(CONTEXT_ATTENTION)}")
    ways = context_parallel_size(mesh, rules)
    if ways == 1:
        return
    if strategy != "jit":
        raise ConfigError(
            f"train.strategy={strategy!r} cannot split sequences: context parallelism "
            f"(context={ways} in the mesh) runs under train.strategy=jit; use it, or a mesh "
            "with context=1")
    for key, value in example_batch.items():
        shape = jnp.shape(value)
        if len(shape) >= 2 and shape[1] % ways:
            raise ConfigError(
                f"mesh context={ways}: the batch's {key!r} has length {shape[1]}, which does "
                f"not split into {ways} equal shards; use a sequence length that is a multiple "
                f"of {ways} (train.seq_len), or a context size that divides {shape[1]}")
    refusal = method_refusal(attention, method)
    if refusal:
        raise ConfigError(refusal)


def method_refusal(attention: Any, method: str) -> str | None:
    """Why ``method`` cannot split attention computed by the kernel ``attention`` over the
    sequence (None when it can). The ring computes its blocks itself; the all-gather hands
    each device's queries every key, which a kernel that masks by array index cannot do."""
    if method == "all_gather" and not attention.dense_masks:
        return (f"attention={attention.name!r} with context parallelism: the all_gather method "
                "gives each device's queries all keys, which this kernel (causality by array "
                "index) cannot mask; use train.context_attention=ring, or attention=chunked, "
                "xla or reference")
    return None


def attention_hook(mesh: Mesh, rules: LogicalRules = LOGICAL_RULES,
                   method: str = "all_gather") -> AttentionHook | None:
    """The ``nn.attention.across_shards`` hook for ``mesh`` (None when the sequence is whole):
    attention of the global q, k, v computed on each device's sequence shard by ``method``."""
    ways = context_parallel_size(mesh, rules)
    if ways == 1:
        return None
    axes = length_axes(rules)
    axis = axes[0] if len(axes) == 1 else axes

    def hook(impl, q, k, v, *, bias, mask, scale, logit_softcap):
        return _attention(impl, method, mesh, rules, axis, ways, q, k, v, bias=bias, mask=mask,
                          scale=scale, logit_softcap=logit_softcap)

    return hook


def _split(logical: str, size: int, mesh: Mesh, rules: LogicalRules):
    """The mesh axes ``logical`` maps to, or None when they do not divide ``size``."""
    axes = nn.logical_to_mesh_axes((logical,), rules)[0]
    names = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    ways = math.prod(mesh.shape.get(a, 1) for a in names)
    return axes if ways > 1 and size % ways == 0 else None


def _attention(impl, method, mesh, rules, axis, ways, q, k, v, *, bias, mask, scale,
               logit_softcap):
    b, q_len, h, _ = q.shape
    k_len, n = k.shape[1], k.shape[2]
    if q_len % ways or k_len % ways:
        # a decoding step, or a prompt that does not split: the kernel on the global arrays
        # (GSPMD gathers what it needs), the same numbers
        return impl.attend(q, k, v, bias=bias, mask=mask, scale=scale,
                           logit_softcap=logit_softcap)
    rows = _split("batch", b, mesh, rules)
    heads = _split("heads", h, mesh, rules)
    kv_heads = _split("kv_heads", n, mesh, rules)
    if heads is None or kv_heads is None or heads != kv_heads:  # keep each group together
        heads = kv_heads = None

    def along(x):
        """The spec of a mask's ``[B|1, Q|K]`` positions, padding or segment ids (rows split
        when whole, length over context), or of its prefix lengths ``[B|1]``."""
        lead = rows if x.shape[0] == b else None
        return P(lead) if x.ndim == 1 else P(lead, axis)

    def scores_side(x):
        """Bias or dense mask ``[B|1, H|1, Q|1, K|1]``: rows, heads, queries split; keys whole
        (each device slices the keys it is looking at)."""
        x = as_4d(x)
        return x, P(rows if x.shape[0] == b else None, heads if x.shape[1] == h else None,
                    axis if x.shape[2] == q_len else None, None)

    q_spec = P(rows, axis, heads, None)
    kv_spec = P(rows, axis, kv_heads, None)
    bias_spec = None
    if bias is not None:
        bias, bias_spec = scores_side(bias)
    if isinstance(mask, AttentionMask):
        mask_spec = jax.tree.map(along, mask)
    elif mask is not None:
        mask, mask_spec = scores_side(mask)
    else:
        mask_spec = None

    def local(q, k, v, bias, mask):
        if method == "ring":
            return _ring(q, k, v, bias, mask, axis=axis, ways=ways, k_total=k_len, scale=scale,
                         logit_softcap=logit_softcap)
        k, v = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
        if isinstance(mask, AttentionMask):
            mask = _with_keys(mask, *(None if x is None else
                                      lax.all_gather(x, axis, axis=1, tiled=True)
                                      for x in _key_side(mask)))
        return impl.attend(q, k, v, bias=bias, mask=mask, scale=scale,
                           logit_softcap=logit_softcap)

    return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, bias_spec, mask_spec),
                         out_specs=q_spec, check_vma=impl.typed_under_shard_map)(
        q, k, v, bias, mask)


def _key_side(mask: AttentionMask) -> tuple:
    """The parts of a mask that follow the keys: positions, padding, segment ids."""
    return mask.kv_positions, mask.kv_valid, mask.kv_segments


def _with_keys(mask: AttentionMask, kv_positions, kv_valid, kv_segments) -> AttentionMask:
    """``mask`` over other keys; no longer ``aligned`` (the keys are not 0..K-1 here)."""
    return mask.replace(kv_positions=kv_positions, kv_valid=kv_valid, kv_segments=kv_segments,
                        aligned=False)


def _ring(q, k, v, bias, mask, *, axis, ways: int, k_total: int, scale: float, logit_softcap):
    """Ring attention on one device: its queries ``[b, q, h, D]`` against every device's
    keys/values ``[b, k, n, D]``, which travel one hop per step; float32 online softmax."""
    b, q_len, h, d = q.shape
    k_len, n = k.shape[1], k.shape[2]
    q_BQNGD = q.reshape(b, q_len, n, h // n, d)
    me = lax.axis_index(axis)
    hop = [(i, (i + 1) % ways) for i in range(ways)]

    def scores(step, k_blk, keys):
        """Scores ``[b, n, G, q, k]`` float32 of the block that started on device
        ``me - step``, masked (-inf) where a query may not see a key."""
        start = ((me - step) % ways) * k_len  # where the block's keys sit among all K
        s = jnp.einsum("bqngd,bknd->bngqk", q_BQNGD, k_blk,
                       preferred_element_type=jnp.float32) * scale
        if logit_softcap is not None:
            s = logit_softcap * jnp.tanh(s / logit_softcap)
        if bias is not None:
            blk = bias if bias.shape[-1] == 1 else lax.dynamic_slice_in_dim(bias, start, k_len,
                                                                              axis=3)
            s = s + group_heads(blk, n).astype(jnp.float32)
        if isinstance(mask, AttentionMask):
            visible = _with_keys(mask, *keys).dense()
        elif mask is not None:
            visible = mask if mask.shape[-1] == 1 else lax.dynamic_slice_in_dim(
                mask, start, k_len, axis=3)
        else:
            return s
        return jnp.where(group_heads(visible, n), s, -jnp.inf)

    def update(carry, step, k_blk, v_blk, keys):
        s = scores(step, k_blk, keys)
        m_blk = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        if carry is None:
            m = m_blk
        else:
            m_old, l_old, acc_old = carry
            m = jnp.maximum(m_old, m_blk)
        shift = jnp.where(jnp.isfinite(m), m, 0.0)  # nothing visible yet: exp(-inf) = 0
        p = jnp.exp(s - shift)
        l_sum = jnp.sum(p, axis=-1, keepdims=True)
        acc = jnp.einsum("bngqk,bknd->bngqd", p, v_blk.astype(jnp.float32))
        if carry is not None:
            rescale = jnp.exp(m_old - shift)
            l_sum = l_old * rescale + l_sum
            acc = acc_old * rescale + acc
        return m, l_sum, acc

    keys = _key_side(mask) if isinstance(mask, AttentionMask) else (None, None, None)
    carry = update(None, 0, k, v, keys)

    def step(state, i):
        carry, k_blk, v_blk, keys = state
        k_blk, v_blk, keys = jax.tree.map(lambda x: lax.ppermute(x, axis, hop),
                                          (k_blk, v_blk, keys))
        return (update(carry, i, k_blk, v_blk, keys), k_blk, v_blk, keys), None

    (carry, *_), _ = lax.scan(step, (carry, k, v, keys), jnp.arange(1, ways))
    _, l_sum, acc = carry
    out = acc / jnp.where(l_sum > 0, l_sum, 1.0)  # [b, n, G, q, D]; sees no key: zero
    return out.transpose(0, 3, 1, 2, 4).reshape(b, q_len, h, d).astype(q.dtype)
