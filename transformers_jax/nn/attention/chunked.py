"""``chunked``: flash attention in pure JAX, any backend.

Queries and keys are cut into tiles of q_chunk x k_chunk. The forward pass visits, for each
query block, every key block in turn, keeping a running row maximum m, a running softmax
denominator l and an unnormalised output; it stores only the output and the per-row logsumexp.
The backward pass recomputes each tile's probabilities from that logsumexp, so no ``[Q, K]``
array ever exists: memory is O(Q + K) plus one tile.

What makes it fast on CPU (the layouts cost nothing elsewhere):

- Block-major, head-major layout. q is laid out as ``[nq, B, N, G, cq, D]`` and k, v as
  ``[nk, B, N, ck, D]``: a tile's block is one contiguous slab, and every tile product is a
  batched matmul whose batch axes (B, N) lead and whose rows are contiguous (the
  ``[B, Q, N, G, D]`` layout made XLA copy each tile transposed).
- Key-major tiles in the backward pass (``[B, N, ck, G, cq]``): each product then contracts a
  minor axis of its left operand, as the CPU matmul library wants; query-major tiles made XLA
  copy every tile's p and ds transposed (for dv and dk).
- Tile skipping. A tile in which the mask hides every key is skipped at run time (for a causal
  mask about half of them). It is decided from the tile's mask values themselves, so it is
  exact for any mask (packed segments, a ring-buffer KV cache, padding). A third run-time
  branch for fully visible tiles (no masking work) measured no faster and compiles slower.
- Tiles decided ahead. When the loops are unrolled and the model made the positions itself
  (``AttentionMask.aligned``: no packing, no cache), a tile's visibility follows from its
  offsets: invisible tiles leave the program, fully visible ones lose their masking, and no
  tile keeps a run-time branch (fewer ops and no conditionals to compile).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from transformers_jax import backends
from transformers_jax.nn.attention.api import group_heads
from transformers_jax.nn.attention.platform import vary, varying_axes
from transformers_jax.nn.masks import AttentionMask


def chunked_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=128,
                      unroll_tiles=16):
    """Blockwise online-softmax attention; any lengths (padded to whole tiles internally).

    With at most ``unroll_tiles`` tiles (query blocks x key blocks) the tile loops are unrolled:
    every tile's offsets are constants, so the loops' dynamic slices, updates and bookkeeping
    go, at the price of a compile that grows with the tile count (256 tokens in 64-wide tiles,
    16 per call: a training step 1.25x faster, its compile about 1.5 s longer).
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
        bias = _pad_scores(group_heads(bias, n), q_pad, k_pad)  # [B|1, N|1, G|1, Qp|1, Kp|1]
    if isinstance(mask, AttentionMask):
        mask = _pad_attention_mask(mask, q_pad, k_pad)
    elif mask is not None:
        mask = _pad_scores(group_heads(mask, n), q_pad, k_pad)

    tiling = _Tiling(scale, logit_softcap, q_chunk, k_chunk, q_len, k_len,
                     num_q * num_k <= unroll_tiles)
    out = _flash(tiling, q, k, v, bias, mask)  # [nq, B, N, G, cq, D]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, num_q * q_chunk, h, d)
    return out[:, :q_len]  # padded queries dropped


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
        raise ValueError(f"contract handles two-operand einsums without traces or repeated "
                         f"axes, got {spec!r}")
    dims = ((tuple(left.index(c) for c in summed), tuple(right.index(c) for c in summed)),
            (tuple(left.index(c) for c in batch), tuple(right.index(c) for c in batch)))
    return dims, tuple(order.index(c) for c in out)


def contract(spec: str, a: jax.Array, b: jax.Array, preferred_element_type=None) -> jax.Array:
    """``jnp.einsum(spec, a, b, preferred_element_type=...)`` for two operands without
    size-1 broadcasting, as one ``lax.dot_general``: the same numbers. The tile loops call
    it hundreds of times per step, and each ``jnp.einsum`` re-plans its contraction and enters
    a nested ``jit`` while tracing (about a sixth of a small model's tracing time)."""
    dims, perm = _contraction(spec)
    out = lax.dot_general(a, b, dims, preferred_element_type=preferred_element_type)
    return out if perm == tuple(range(len(perm))) else lax.transpose(out, perm)


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



def _visit_tile(t: _Tiling, mask, qi, kj, plan: str, compute, skipped, vma: frozenset):
    """``compute(keep)`` for tile (qi, kj) of a ``plan`` other than "skip": no ``keep`` when
    every key is visible; when the plan is unknown, ``skipped()`` instead if no key of the
    tile is visible (decided at run time), both varying over ``vma``."""
    keep = None if plan == "full" else _tile_keep(t, mask, qi, kj)
    if plan != "unknown" or keep is None:
        return compute(keep)
    seen = jnp.any(keep)
    if not isinstance(seen, jax.core.Tracer):  # run op by op: decided here, no program built
        return compute(keep) if seen else skipped()
    return lax.cond(seen, lambda: vary(compute(keep), vma),
                    lambda: vary(skipped(), vma))


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
    vma = varying_axes(q, k, v, bias, mask)

    def one_query_block(qi):
        q_blk = _take(q, qi)  # [B, N, G, cq, D]

        def visit_key_block(carry, kj):
            m, l, acc = carry  # [B, N, G, cq] x 2, [B, N, G, cq, D]
            plan = _tile_plan(t, mask, qi, kj)
            if plan == "skip":
                return carry, None
            k_blk, v_blk = _take(k, kj), _take(v, kj)

            def compute(keep):
                s = contract("bngqd,bnkd->bngqk", q_blk, k_blk,
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
                pv = contract(
                    "bngqk,bnkd->bngqd", p.astype(v.dtype), v_blk,
                    preferred_element_type=jnp.float32,
                )
                return m_new, l * rescale + p.sum(axis=-1), acc * rescale[..., None] + pv

            return _visit_tile(t, mask, qi, kj, plan, compute, lambda: carry, vma), None

        init = vary((
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
    per key block (for dq, accumulated as dq^T and transposed once), and handed to the backend
    as an operand it may keep as a copy (``backends.materialised``)."""
    q, k, v, bias, mask, out, lse = residuals
    vma = varying_axes(q, k, v, bias, mask, out, lse, d_out)
    num_q, b, n, g, cq, d = q.shape
    num_k, dq_t_shape = k.shape[0], (b, n, d, g, cq)  # dq^T blocks
    # delta_i = sum_j p_ij dp_ij = do_i . o_i, the softmax-backward row term; [nq, B, N, G, cq]
    delta = contract("jbngqd,jbngqd->jbngq", d_out, out, preferred_element_type=jnp.float32)

    def one_key_block(carry, kj):
        dq_t, d_bias = carry  # nq blocks of dq^T [B, N, D, G, cq]
        k_blk, v_blk = _take(k, kj), _take(v, kj)  # [B, N, ck, D]
        k_t = backends.materialised(jnp.swapaxes(k_blk, 2, 3))  # [B, N, D, ck]

        def visit_query_block(carry, qi):
            dk, dv, dq_t, d_bias = carry
            plan = _tile_plan(t, mask, qi, kj)
            if plan == "skip":
                return carry, None
            q_blk, do_blk = _take(q, qi), _take(d_out, qi)  # [B, N, G, cq, D]
            lse_blk = _take(lse, qi)[:, :, None]  # [B, N, 1, G, cq]
            delta_blk = _take(delta, qi)[:, :, None]

            def compute(keep):
                s = contract("bnkd,bngqd->bnkgq", k_blk, q_blk,
                              preferred_element_type=jnp.float32)
                s, slope = _scores(t, s, _key_major(_tile(bias, t, qi, kj)))
                p = jnp.exp(s - lse_blk)  # [B, N, ck, G, cq], exact softmax weights
                if keep is not None:
                    p = jnp.where(_key_major(keep), p, 0.0)
                dv_blk = contract(
                    "bnkgq,bngqd->bnkd", p.astype(do_blk.dtype), do_blk,
                    preferred_element_type=jnp.float32,
                )
                dp = contract(
                    "bnkd,bngqd->bnkgq", v_blk, do_blk, preferred_element_type=jnp.float32
                )
                ds_biased = p * (dp - delta_blk)  # gradient of the biased scores
                ds = ds_biased if slope is None else ds_biased * slope  # back through the cap
                ds = (ds * t.scale).astype(q_blk.dtype)
                dk_blk = contract(
                    "bnkgq,bngqd->bnkd", ds, q_blk, preferred_element_type=jnp.float32
                )
                dq_t_blk = contract(
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

        zeros_kv = vary(jnp.zeros(k_blk.shape, jnp.float32), vma)
        (dk, dv, dq_t, d_bias), _ = _fold(
            visit_query_block, (zeros_kv, zeros_kv, dq_t, d_bias), num_q, t.unroll
        )
        return (dq_t, d_bias), (dk, dv)

    init = vary((
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
