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
  time; the block maths is this module's (the configured kernel is not used); or
- ``ring_zigzag``: the ring, with the queries in zigzag order (below).

Under the ``shard_map`` strategy the step itself is mapped over the mesh, and the model is
traced on each device's shard ``[b, T/c]`` of the batch. The trainer gives the shard its
global positions (``shard_batch``), so every position hook and the mask see what one device
sees; ``local_attention_hook`` runs the same body as the jit hook's ``shard_map``
(``attend_shards``: ring or all-gather) directly on the local q, k, v; and a bias scheme
builds its bias against every key's positions, gathered by ``gather_keys`` when the model asks
``nn.attention.every_key``, so a device's bias is ``[.., q, K]`` as under jit. What a shard
cannot compute is refused by ``check_context`` (``shard_refusal``): a scheme whose positions
depend on the whole sequence (``PositionScheme.shard_refusal``: randomized draws, a RoPE
scaling of the window's length), a recurrent or an encoder-decoder family.

The mask is rebuilt on each device from positions (an ``AttentionMask``'s causal, window and
prefix rules, padding, segments), never from array indices, so what a query sees does not
depend on where its keys live. A dense boolean mask and the bias, ``[.., q, K]`` per device,
are split along queries and sliced along keys.

Skipping hidden work. Before each (query tile, key tile) pair of a ring step the device asks
the mask whether any query may see any key there (``AttentionMask.may_see_any``: a min/max of
the tile's positions and segment ids, traced; a dense mask: any True in the tile) and computes
the pair under ``lax.cond`` only if so. A causal mask hides the blocks in every query's future,
a window also those beyond it in the past, segment ids the blocks of other documents; a
prefix or a bidirectional mask hides little, and the bound never hides a visible pair, so
packed rows (positions restarting) stay exact and merely skip less. The hops still run on
every step: the skip saves compute, not communication.

Zigzag order. With contiguous shards and a causal mask, device i has i + 1 blocks of work (the
last c), and at step s only devices s..c-1 compute: as each hop waits for the device before,
the ring still takes about c block-times. ``ring_zigzag`` cuts the sequence into 2c chunks and
gives device i chunks i and 2c-1-i of the queries and of the keys; each ring step splits into
2x2 tiles of a chunk, and every device computes 3 tiles on the first step and 2 on every other
(half a block: keys from a device before it are seen, their first chunk, by both query chunks;
keys from a device after it, both chunks, by the second query chunk only), 2c+1 in all. Balance
in total alone is not enough: zigzag queries over contiguous keys give every device 2c+1 tiles
too, but 4 on some steps. The model outside sees global arrays in their order, so the
permutation happens inside this seam, on each device's shard: q, k, v, their positions, padding
and segment ids, the rows of a bias or dense mask go to zigzag order by two ``ppermute``s of
half a shard each (the even chunks, then the odd ones: each a permutation of the devices), and
the output comes back by two more; a bias's or dense mask's key columns stay whole and are
sliced where each key chunk sits. Measured on a 1-layer GPT's training step
(``benchmarks/context_ring.py``, data=2,context=4, 4x64 tokens): 33 collective-permutes instead
of 15, 49.7 kB instead of 25.0 kB sent per device (forward: q, k, v, the positions and the
output; backward: their gradients; the ring itself sends K, V and their positions c-1 times
forward and dK, dV c-1 times back). Permuting the batch once at the input would save these hops
in every layer, but every token-wise layer, the positions the model makes, the loss and the
data pipeline would then have to agree on the order; this design keeps that knowledge in one
function and exact by construction.

Backward. Each ring step is ``jax.checkpoint``-ed: the forward keeps, per step, the
online-softmax carry (``[b, h, q, D]`` and two ``[b, h, q]``) and the key/value block it
received, and the backward recomputes that step's scores; nothing of size ``q x K`` is kept
(``tests/test_parallel_context.py`` measures the residuals; ``docs/scaling.md`` the numbers).

Not yet: a flash-style backward that passes dK/dV round the ring instead of keeping every
hop's key/value block (those are O(K) per device, as with ``all_gather``); skipping the hops
themselves when a whole step is hidden on every device (a window shorter than a shard); per
tile biases computed from positions (a bias scheme materialises ``[h, q, K]`` per device);
sharding the KV cache for decoding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from transformers_jax.backends.generic import varying_axes
from transformers_jax.config import CONTEXT_ATTENTION, ConfigError
from transformers_jax.models import family_of
from transformers_jax.nn.attention.api import AttentionHook, KeyShards, as_4d, group_heads
from transformers_jax.nn.masks import AttentionMask
from transformers_jax.parallel.mesh import CONTEXT_AXIS
from transformers_jax.parallel.rules import (
    LOGICAL_RULES,
    LogicalRules,
    context_parallel_size,
    length_axes,
)

__all__ = ["CONTEXT_ATTENTION", "METHODS", "attend_shards", "attention_hook", "check_context",
           "gather_keys", "local_attention_hook", "method_refusal", "shard_batch", "shard_refusal"]


@dataclasses.dataclass(frozen=True)
class Method:
    """A ``train.context_attention`` value: ``ring`` passes key/value blocks round the axis
    (else every device gathers them all); ``zigzag`` reorders the queries so that causal work
    is the same on every device (its sequences split into 2c chunks)."""

    ring: bool
    zigzag: bool = False


METHODS = {"all_gather": Method(ring=False), "ring": Method(ring=True),
           "ring_zigzag": Method(ring=True, zigzag=True)}
assert tuple(METHODS) == CONTEXT_ATTENTION, "config.CONTEXT_ATTENTION lists METHODS' names"


def check_context(strategy: str, mesh: Mesh, rules: LogicalRules, example_batch: Mapping,
                  config: Any, method: str) -> None:
    """Refuse, with the reason and the fix, what context parallelism cannot run: a strategy
    other than ``jit`` or ``shard_map``, a sequence that does not split evenly, a kernel the
    gathered keys would misuse, a model (``config``) that ``shard_map`` cannot run on a shard
    of its sequence. Nothing to check on a mesh without a context axis."""
    if method not in CONTEXT_ATTENTION:
        raise ConfigError(f"train.context_attention={method!r}: valid choices: "
                          f"{', '.join(CONTEXT_ATTENTION)}")
    ways = context_parallel_size(mesh, rules)
    if ways == 1:
        return
    if strategy not in ("jit", "shard_map"):
        raise ConfigError(
            f"train.strategy={strategy!r} cannot split sequences: context parallelism "
            f"(context={ways} in the mesh) runs under train.strategy=jit or shard_map; use "
            "one of them, or a mesh with context=1")
    for key, value in example_batch.items():
        shape = jnp.shape(value)
        if len(shape) >= 2 and shape[1] % ways:
            raise ConfigError(
                f"mesh context={ways}: the batch's {key!r} has length {shape[1]}, which does "
                f"not split into {ways} equal shards; use a sequence length that is a multiple "
                f"of {ways} (train.seq_len), or a context size that divides {shape[1]}")
        if METHODS[method].zigzag and len(shape) >= 2 and shape[1] % (2 * ways):
            raise ConfigError(
                f"train.context_attention={method!r} with context={ways}: the batch's {key!r} "
                f"has length {shape[1]}, which does not split into {2 * ways} zigzag chunks; "
                f"use a sequence length that is a multiple of {2 * ways} (train.seq_len), or "
                "train.context_attention=ring")
    refusal = method_refusal(config.attention, method)
    if refusal:
        raise ConfigError(refusal)
    refusal = shard_refusal(config) if strategy == "shard_map" else None
    if refusal:
        raise ConfigError(f"train.strategy='shard_map' with context={ways}: {refusal}; use "
                          "train.strategy=jit (global arrays: it computes this as one device "
                          "does), or a mesh with context=1")


def shard_refusal(config: Any) -> str | None:
    """Why the ``shard_map`` strategy cannot run the model of ``config`` on one device's shard
    of each sequence (None when it can): the model sees only its shard, so a family that
    reads the sequence otherwise than by attention, or a position scheme that needs the whole
    sequence (``PositionScheme.shard_refusal``), is refused."""
    family = family_of(config)
    if family.recurrent:
        return (f"family={config.family} reads the sequence through a recurrent state, which "
                "one shard cannot start from")
    if family.cross_attention:
        return (f"family={config.family} attends across two sequences (source and target), "
                "and this splits one")
    return config.position.shard_refusal(config)


def method_refusal(attention: Any, method: str) -> str | None:
    """Why ``method`` cannot split attention computed by the kernel ``attention`` over the
    sequence (None when it can). The ring computes its blocks itself; the all-gather hands
    each device's queries every key, which a kernel that masks by array index cannot do."""
    if not METHODS[method].ring and not attention.dense_masks:
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


def local_attention_hook(method: str, ways: int, axis: str = CONTEXT_AXIS) -> AttentionHook:
    """The ``nn.attention.across_shards`` hook of a step already mapped over ``axis`` (the
    ``shard_map`` strategy): q, k, v, the mask and its positions are this device's shard of
    the sequence, a bias this shard's queries against every key (the model builds it from
    ``every_key`` positions, which ``gather_keys`` gathers), and ``attend_shards`` computes
    the queries against every device's keys."""

    def hook(impl, q, k, v, *, bias, mask, scale, logit_softcap):
        k_len = k.shape[1] * ways
        if bias is not None and as_4d(bias).shape[3] not in (1, k_len):
            raise ValueError(f"a bias of {as_4d(bias).shape[3]} keys across {ways} sequence "
                             f"shards of {k.shape[1]}: build it against every key's positions "
                             "(nn.attention.every_key)")
        if mask is not None and not isinstance(mask, AttentionMask):
            raise ValueError("a dense mask across sequence shards under shard_map: build an "
                             "AttentionMask from positions (nn.masks.build_mask), or use "
                             "train.strategy=jit")
        return attend_shards(impl, method, q, k, v, None if bias is None else as_4d(bias), mask,
                             axis=axis, ways=ways, scale=scale, logit_softcap=logit_softcap)

    return hook


def gather_keys(ways: int, axis: str = CONTEXT_AXIS) -> KeyShards:
    """How ``every_key`` answers in a step mapped over ``axis``: a per-key array ``[b, k]`` of
    every shard, ``[b, K]`` in sequence order."""
    return KeyShards(lambda x_bk: lax.all_gather(x_bk, axis, axis=1, tiled=True), ways)


def shard_batch(batch: Mapping, ways: int, axis: str = CONTEXT_AXIS) -> dict:
    """Inside a map over ``axis``: this device's shard ``[b, T/c]`` of a batch, with the
    global positions of its tokens. A batch that carries positions (packed rows restarting
    them) keeps them; otherwise the shard's tokens are numbered from where it starts,
    ``axis_index * T/c``, so that position schemes and masks see what one device sees (the
    model numbers from 0 only when given no positions)."""
    if ways == 1 or "positions" in batch:
        return dict(batch)
    b, t = jnp.shape(batch["inputs"])[:2]
    start = lax.axis_index(axis) * t
    positions_bt = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    return {**batch, "positions": positions_bt}


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
        return attend_shards(impl, method, q, k, v, bias, mask, axis=axis, ways=ways,
                             scale=scale, logit_softcap=logit_softcap)

    return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, bias_spec, mask_spec),
                         out_specs=q_spec, check_vma=impl.typed_under_shard_map)(
        q, k, v, bias, mask)


def attend_shards(impl, method: str, q, k, v, bias, mask, *, axis, ways: int, scale: float,
                  logit_softcap=None):
    """Inside a map over ``axis`` (c = ``ways`` devices): one device's queries ``[b, q, h, D]``
    against the keys/values of every device ``[b, k, n, D]`` by ``method``, the body both
    strategies run (``jit``: in the ``shard_map`` of ``attention_hook``; ``shard_map``: in
    the step itself, ``local_attention_hook``). A bias or dense mask has this device's query
    rows and every key ``[.., q, K]``; an ``AttentionMask`` this device's positions."""
    how = METHODS[method]
    if how.ring:
        # zigzag needs 2 query chunks and 2 key tiles per shard; another length (an evaluation
        # at a length that splits c ways only) takes the contiguous ring: the same numbers
        zigzag = how.zigzag and q.shape[1] % 2 == 0 and k.shape[1] % 2 == 0
        return ring_attention(q, k, v, bias, mask, axis=axis, ways=ways, zigzag=zigzag,
                              scale=scale, logit_softcap=logit_softcap)[0]
    k, v = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
    if isinstance(mask, AttentionMask):
        mask = _with_keys(mask, *(None if x is None else
                                  lax.all_gather(x, axis, axis=1, tiled=True)
                                  for x in _key_side(mask)))
    return impl.attend(q, k, v, bias=bias, mask=mask, scale=scale, logit_softcap=logit_softcap)


def ring_attention(q, k, v, bias, mask, *, axis, ways: int, zigzag: bool, scale: float,
                   logit_softcap=None, recompute: bool = True):
    """Inside ``shard_map``: one device's queries ``[b, q, h, D]`` (contiguous shard) against
    the keys/values of every device ``[b, k, n, D]`` by the ring, with queries and keys in
    zigzag order when ``zigzag`` (q and k even); the output in the queries' own order, and
    the number of (query tile, key tile) pairs this device computed at each ring step, int32
    ``[c]``."""
    if not zigzag:
        return _ring(q, k, v, bias, mask, axis=axis, ways=ways, scale=scale,
                     logit_softcap=logit_softcap, recompute=recompute)
    order = functools.partial(_to_zigzag, axis=axis, ways=ways)
    q, k, v, bias = order(q, 1), order(k, 1), order(v, 1), order(bias, 2)
    if isinstance(mask, AttentionMask):
        mask = _with_keys(mask.replace(q_positions=order(mask.q_positions, 1),
                                       q_segments=order(mask.q_segments, 1)),
                          *(order(x, 1) for x in _key_side(mask)))
    else:
        mask = order(mask, 2)
    out, count = _ring(q, k, v, bias, mask, axis=axis, ways=ways, scale=scale,
                       logit_softcap=logit_softcap, zigzag=True, recompute=recompute)
    return _from_zigzag(out, 1, axis=axis, ways=ways), count


def _zigzag_owner(chunk: int, ways: int) -> int:
    """The device that holds chunk ``chunk`` (of 2c) in zigzag order: device i has i and
    2c-1-i."""
    return chunk if chunk < ways else 2 * ways - 1 - chunk


def _to_zigzag(x, dim: int, *, axis, ways: int):
    """One device's share of ``x`` along ``dim`` in contiguous order (chunks 2i, 2i+1 of 2c)
    -> zigzag order (chunks i, 2c-1-i). Two ``ppermute``s of half a shard: the even chunks
    travel together, and so do the odd ones (each is a permutation of the devices: of the
    chunks i and 2c-1-i, one is even). None, or an axis of 1 (broadcast), is returned as is."""
    if x is None or x.shape[dim] == 1:
        return x
    lo, hi = jnp.split(x, 2, axis=dim)  # chunk 2i (even), chunk 2i+1 (odd)
    even = lax.ppermute(lo, axis, [(i, _zigzag_owner(2 * i, ways)) for i in range(ways)])
    odd = lax.ppermute(hi, axis, [(i, _zigzag_owner(2 * i + 1, ways)) for i in range(ways)])
    first_even = lax.axis_index(axis) % 2 == 0  # device i's first chunk, i, is even
    return jnp.where(first_even, jnp.concatenate([even, odd], dim),
                     jnp.concatenate([odd, even], dim))


def _from_zigzag(x, dim: int, *, axis, ways: int):
    """The inverse of ``_to_zigzag``: chunks i, 2c-1-i back to 2i, 2i+1."""
    first, second = jnp.split(x, 2, axis=dim)
    first_even = lax.axis_index(axis) % 2 == 0
    even = jnp.where(first_even, first, second)
    odd = jnp.where(first_even, second, first)
    even_chunk = [i if i % 2 == 0 else 2 * ways - 1 - i for i in range(ways)]  # on device i
    odd_chunk = [2 * ways - 1 - i if i % 2 == 0 else i for i in range(ways)]
    lo = lax.ppermute(even, axis, [(i, even_chunk[i] // 2) for i in range(ways)])
    hi = lax.ppermute(odd, axis, [(i, odd_chunk[i] // 2) for i in range(ways)])
    return jnp.concatenate([lo, hi], dim)


def _vary_like(x, like):
    """``x`` marked as varying over every mesh axis ``like`` varies over. A bias the same on
    several devices (made from positions alone) meets the scores inside ``lax.cond``, where
    the transpose of the implicit cast, a psum, would run only on the devices whose tile is
    visible, and the others would never join it; cast here, the psum runs on all."""
    if x is None:
        return x
    missing = tuple(sorted(varying_axes(like) - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _key_side(mask: AttentionMask) -> tuple:
    """The parts of a mask that follow the keys: positions, padding, segment ids."""
    return mask.kv_positions, mask.kv_valid, mask.kv_segments


def _with_keys(mask: AttentionMask, kv_positions, kv_valid, kv_segments) -> AttentionMask:
    """``mask`` over other keys; no longer ``aligned`` (the keys are not 0..K-1 here)."""
    return mask.replace(kv_positions=kv_positions, kv_valid=kv_valid, kv_segments=kv_segments,
                        aligned=False)


def _ring(q, k, v, bias, mask, *, axis, ways: int, scale: float, logit_softcap,
          zigzag: bool = False, recompute: bool = True):
    """Ring attention on one device: its queries ``[b, q, h, D]`` against every device's
    keys/values ``[b, k, n, D]``, which travel one hop per step; float32 online softmax.

    ``zigzag``: queries and keys are in zigzag order (device i holds chunks i and 2c-1-i of
    2c), and each step splits into 2 x 2 tiles of a chunk; else one tile, the whole block. A
    tile is computed only when the mask lets some query see some key of it
    (``AttentionMask.may_see_any``; a dense mask: any True in the tile), under ``lax.cond``.
    ``recompute``: each step is ``jax.checkpoint``-ed, so the backward pass keeps the
    online-softmax carry and the step's block, and recomputes the scores.

    Returns the output ``[b, q, h, D]`` and how many tiles this device computed at each step
    (int32 ``[c]``)."""
    # Kept whole: one traced program whose nested steps (a tile's online softmax, a block's
    # tiles, a hop) are short closures over this device's query tiles, mask tiles and place
    # in the ring; as module functions each would take all of them as arguments.
    b, q_len, h, d = q.shape
    k_len, n = k.shape[1], k.shape[2]
    parts = 2 if zigzag else 1
    bias = _vary_like(bias, q)
    qp, kp = q_len // parts, k_len // parts
    me = lax.axis_index(axis)
    hop = [(i, (i + 1) % ways) for i in range(ways)]

    def query_rows(x, i, dim):
        """Query tile ``i`` of ``x`` along ``dim`` (itself when that axis is broadcast)."""
        if x is None or x.shape[dim] == 1:
            return x
        return lax.slice_in_dim(x, i * qp, (i + 1) * qp, axis=dim)

    q_tiles = [query_rows(q, i, 1).reshape(b, qp, n, h // n, d) for i in range(parts)]
    bias_tiles = [query_rows(bias, i, 2) for i in range(parts)]
    if isinstance(mask, AttentionMask):
        mask_tiles = [mask.replace(q_positions=query_rows(mask.q_positions, i, 1),
                                   q_segments=query_rows(mask.q_segments, i, 1))
                      for i in range(parts)]
    else:
        mask_tiles = [query_rows(mask, i, 2) for i in range(parts)]

    def keys_of(x, start, size, dim):
        """Keys ``start:start + size`` of a bias or dense mask (itself when broadcast)."""
        return x if x is None or x.shape[dim] == 1 else lax.dynamic_slice_in_dim(
            x, start, size, axis=dim)

    def visible(i, keys_t, start):
        """The ``[b|1, 1|h, qp, kp]`` mask of query tile i over a key tile, or None."""
        if isinstance(mask, AttentionMask):
            return _with_keys(mask_tiles[i], *keys_t).dense()
        return keys_of(mask_tiles[i], start, kp, 3)

    def may_see(i, keys_t, start):
        if isinstance(mask, AttentionMask):
            return _with_keys(mask_tiles[i], *keys_t).may_see_any()
        return jnp.any(visible(i, keys_t, start))

    def tile(carry, i, k_t, v_t, keys_t, start):
        """The online-softmax carry of query tile i after one key tile."""
        m_old, l_old, acc_old = carry
        s = jnp.einsum("bqngd,bknd->bngqk", q_tiles[i], k_t,
                       preferred_element_type=jnp.float32) * scale
        if logit_softcap is not None:
            s = logit_softcap * jnp.tanh(s / logit_softcap)
        if bias is not None:
            s = s + group_heads(keys_of(bias_tiles[i], start, kp, 3), n).astype(jnp.float32)
        if mask is not None:
            s = jnp.where(group_heads(visible(i, keys_t, start), n), s, -jnp.inf)
        m = jnp.maximum(m_old, lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
        shift = jnp.where(jnp.isfinite(m), m, 0.0)  # nothing visible yet: exp(-inf) = 0
        p = jnp.exp(s - shift)
        rescale = jnp.exp(m_old - shift)
        l_sum = l_old * rescale + jnp.sum(p, axis=-1, keepdims=True)
        acc = acc_old * rescale + jnp.einsum("bngqk,bknd->bngqd", p, v_t.astype(jnp.float32))
        return m, l_sum, acc

    def process(state, step, k_blk, v_blk, keys):
        """Every (query tile, key tile) pair of the block that started on ``me - step``."""
        carries, count = list(state[0]), state[1]
        for r in range(parts):
            k_t, v_t = (lax.slice_in_dim(x, r * kp, (r + 1) * kp, axis=1) for x in (k_blk, v_blk))
            keys_t = tuple(None if x is None else lax.slice_in_dim(x, r * kp, (r + 1) * kp, axis=1)
                           for x in keys)
            owner = (me - step) % ways  # the device the block started on
            chunk = (2 * ways - 1 - owner if r else owner) if zigzag else owner * parts + r
            start = chunk * kp  # where the tile's keys sit among all K
            for i in range(parts):
                if mask is None:  # every tile is seen
                    carries[i] = tile(carries[i], i, k_t, v_t, keys_t, start)
                    count = count.at[step].add(1)
                    continue
                carries[i], count = lax.cond(
                    may_see(i, keys_t, start),
                    lambda c, t, i=i, k_t=k_t, v_t=v_t, keys_t=keys_t, start=start: (
                        tile(c, i, k_t, v_t, keys_t, start), t.at[step].add(1)),
                    lambda c, t: (c, t),
                    carries[i], count)
        return tuple(carries), count

    if recompute:  # keep each step's inputs (carry, block); recompute its scores in backward
        process = jax.checkpoint(process, prevent_cse=False)

    # zeros_like(q): the carry varies over the mesh axes as q does (shard_map's type checks)
    empty = (jnp.full_like(q, -jnp.inf, shape=(b, n, h // n, qp, 1), dtype=jnp.float32),
             jnp.zeros_like(q, shape=(b, n, h // n, qp, 1), dtype=jnp.float32),
             jnp.zeros_like(q, shape=(b, n, h // n, qp, d), dtype=jnp.float32))
    keys = _key_side(mask) if isinstance(mask, AttentionMask) else (None, None, None)
    state = process(((empty,) * parts, jnp.zeros_like(q, shape=(ways,), dtype=jnp.int32)), 0,
                    k, v, keys)

    def step(carry, i):
        state, k_blk, v_blk, keys = carry
        k_blk, v_blk, keys = jax.tree.map(lambda x: lax.ppermute(x, axis, hop),
                                          (k_blk, v_blk, keys))
        return (process(state, i, k_blk, v_blk, keys), k_blk, v_blk, keys), None

    ((carries, count), *_), _ = lax.scan(step, (state, k, v, keys), jnp.arange(1, ways))
    outs = [acc / jnp.where(l_sum > 0, l_sum, 1.0) for _, l_sum, acc in carries]  # sees none: 0
    out = jnp.concatenate(outs, axis=3)  # [b, n, G, q, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, q_len, h, d).astype(q.dtype), count
