"""Attention masks as data: small boolean builders composed with ``&``.

Shape legend: B batch, Q query length, K key length. Every builder returns a boolean array
broadcastable to ``[B, 1, Q, K]`` where True means "this query may attend to this key".

Masks are defined on *positions* rather than on array indices, so the same rule serves a full
forward pass, a packed batch (positions restart in each segment) and a KV cache (a cache slot
remembers the position of the token it holds).

``AttentionMask`` bundles the inputs of those builders without materialising the dense
``[B, 1, Q, K]`` array: implementations that work block by block (``chunked``) ask it for one
tile at a time and so keep memory linear in the sequence length. ``build_mask`` makes one for
a kind of the config's mask switch (``mask_kinds.py``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from transformers_jax.registry import MASKS

if TYPE_CHECKING:
    from transformers_jax.nn.mask_kinds import MaskKind


def causal_mask(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """Queries see keys at the same or earlier positions. q_pos [B, Q], k_pos [B, K]."""
    return k_pos[:, None, None, :] <= q_pos[:, None, :, None]


def prefix_lm_mask(q_pos: jax.Array, k_pos: jax.Array, prefix_len: jax.Array) -> jax.Array:
    """Causal, except that every query sees the whole prefix (keys at position < prefix_len)."""
    in_prefix = k_pos[:, None, None, :] < prefix_len[:, None, None, None]
    return causal_mask(q_pos, k_pos) | in_prefix


def sliding_window_mask(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """Queries see only the ``window`` most recent positions (their own included)."""
    return (q_pos[:, None, :, None] - k_pos[:, None, None, :]) < window


def padding_mask(kv_valid: jax.Array) -> jax.Array:
    """Keys marked False (padding, empty cache slots) are never attended. kv_valid [B, K]."""
    return kv_valid[:, None, None, :]


def segment_mask(q_segments: jax.Array, kv_segments: jax.Array) -> jax.Array:
    """Packed sequences: a query sees only keys of its own segment. ids [B, Q] and [B, K]."""
    return q_segments[:, None, :, None] == kv_segments[:, None, None, :]


@struct.dataclass
class AttentionMask:
    """The inputs of a composed mask; ``dense()`` builds it, ``block()`` builds one tile.

    Positions are int32 ``[B, Q]`` / ``[B, K]``; the optional parts are None when unused.
    ``causal`` and ``window`` are static (part of the compiled program, not traced values), and
    so is ``aligned``: the model sets it when it made the positions itself, 0..Q-1 and 0..K-1
    in every row, so that a tile's visibility follows from its offsets (``tile_visibility``).
    """

    q_positions: jax.Array
    kv_positions: jax.Array
    kv_valid: jax.Array | None = None
    q_segments: jax.Array | None = None
    kv_segments: jax.Array | None = None
    prefix_len: jax.Array | None = None  # [B]; only for prefix-LM
    causal: bool = struct.field(pytree_node=False, default=False)
    window: int | None = struct.field(pytree_node=False, default=None)
    aligned: bool = struct.field(pytree_node=False, default=False)

    @property
    def q_len(self) -> int:
        return self.q_positions.shape[1]

    @property
    def kv_len(self) -> int:
        return self.kv_positions.shape[1]

    def _compose(self, q_pos, k_pos, kv_valid, q_seg, k_seg) -> jax.Array:
        batch = q_pos.shape[0]
        mask = jnp.ones((batch, 1, q_pos.shape[1], k_pos.shape[1]), dtype=bool)
        if self.causal:
            if self.prefix_len is not None:
                mask &= prefix_lm_mask(q_pos, k_pos, self.prefix_len)
            else:
                mask &= causal_mask(q_pos, k_pos)
        if self.window is not None:
            mask &= sliding_window_mask(q_pos, k_pos, self.window)
        if kv_valid is not None:
            mask &= padding_mask(kv_valid)
        if q_seg is not None:
            mask &= segment_mask(q_seg, k_seg)
        return mask

    def dense(self) -> jax.Array:
        """The full boolean mask, ``[B, 1, Q, K]``."""
        return self._compose(
            self.q_positions, self.kv_positions, self.kv_valid, self.q_segments, self.kv_segments
        )

    def block(self, q_start, q_size: int, k_start, k_size: int) -> jax.Array:
        """The tile ``[B, 1, q_size, k_size]`` at (q_start, k_start); starts may be traced."""

        def take(x, start, size):
            return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)

        return self._compose(
            take(self.q_positions, q_start, q_size),
            take(self.kv_positions, k_start, k_size),
            take(self.kv_valid, k_start, k_size),
            take(self.q_segments, q_start, q_size),
            take(self.kv_segments, k_start, k_size),
        )

    def may_see_any(self) -> jax.Array:
        """A scalar boolean, False only when no query here sees any key here: what a blockwise
        kernel asks before computing a block it received (traced, from the positions and ids
        the mask carries, never from array indices).

        Each rule gives a necessary condition on the ranges of the row's values: causal needs
        the earliest (valid) key at or before the latest query, or, with a prefix, inside the
        prefix; a window needs the latest key less than ``window`` before the earliest query;
        segments need the id ranges of queries and keys to overlap. True whenever any pair is
        visible (it may also be True when none is: positions that restart in packed documents
        hide little from ranges), exact for the contiguous, increasing positions of one
        document. Costs a min/max over the block's positions, no ``[Q, K]`` work."""
        big = jnp.iinfo(jnp.int32).max

        def span(x, valid=None):
            """Per row [B|1]: (min, max) of ``x [B|1, L]`` over the entries marked valid."""
            if valid is None:
                return x.min(axis=1), x.max(axis=1)
            return jnp.where(valid, x, big).min(axis=1), jnp.where(valid, x, -big).max(axis=1)

        q_lo, q_hi = span(self.q_positions)
        k_lo, k_hi = span(self.kv_positions, self.kv_valid)
        ok = k_lo <= k_hi  # some key is not padding
        if self.causal:
            seen = k_lo <= q_hi
            if self.prefix_len is not None:
                seen |= k_lo < self.prefix_len
            ok &= seen
        if self.window is not None:
            ok &= q_lo - k_hi < self.window
        if self.q_segments is not None:
            qs_lo, qs_hi = span(self.q_segments)
            ks_lo, ks_hi = span(self.kv_segments, self.kv_valid)
            ok &= jnp.maximum(qs_lo, ks_lo) <= jnp.minimum(qs_hi, ks_hi)
        return jnp.any(ok)

    def tile_visibility(self, q_start: int, q_size: int, k_start: int, k_size: int):
        """``"none"`` when no query of the tile at (q_start, k_start) sees any of its keys,
        ``"all"`` when every query sees every key, ``"some"`` between the two, None when that
        depends on the data (positions not ``aligned``, padding, segments, a prefix). Static
        offsets only: lets a tiled kernel drop invisible tiles, and the masking of fully
        visible ones, from the compiled program."""
        data = (self.kv_valid, self.q_segments, self.kv_segments, self.prefix_len)
        if not self.aligned or any(x is not None for x in data):
            return None
        if q_start + q_size > self.q_len or k_start + k_size > self.kv_len:
            return None  # the tile reaches past the positions given
        # The rules depend on q - k only: visible for lo <= q - k <= hi (causal: lo = 0;
        # a window w: hi = w - 1).
        lo = 0 if self.causal else -math.inf
        hi = self.window - 1 if self.window is not None else math.inf
        d_min, d_max = q_start - (k_start + k_size - 1), q_start + q_size - 1 - k_start
        if d_max < lo or d_min > hi:
            return "none"
        if lo <= d_min and d_max <= hi:
            return "all"
        return "some"


def as_dense(mask: AttentionMask | jax.Array | None) -> jax.Array | None:
    """A boolean array (or None) whatever form the mask was given in."""
    if isinstance(mask, AttentionMask):
        return mask.dense()
    return mask


def build_mask(
    kind: MaskKind,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    *,
    prefix_len: jax.Array | None = None,
    kv_valid: jax.Array | None = None,
    q_segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
    aligned: bool = False,
) -> AttentionMask:
    """The mask of a ``MASKS`` entry (or its name), plus padding and segments. ``aligned``:
    the positions are 0..Q-1 and 0..K-1 in every row (made by the model, not given)."""
    if isinstance(kind, str):
        kind = MASKS.get(kind)()
    return AttentionMask(
        q_positions,
        kv_positions,
        kv_valid=kv_valid,
        q_segments=q_segments,
        kv_segments=kv_segments,
        aligned=aligned,
        **kind.parts(prefix_len),
    )
