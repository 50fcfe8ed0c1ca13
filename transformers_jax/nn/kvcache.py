"""The key/value cache for decoding: an explicit pytree passed in and returned, never hidden state.

``KVCache`` (B batch, S cache slots, N kv heads, D head dim, L layers)::

    index      int32 [B]      tokens written so far per row (= the next token's position)
    positions  int32 [B, S]   position of the token held by each slot
    valid      bool  [B, S]   whether the slot holds a token at all
    layers     L x LayerKV    keys and values [B, N, S, D] of each layer's self-attention
    cross      L x LayerKV    an encoder-decoder's cross-attention keys/values [B, N, S_enc, D]
    encoder_positions, encoder_valid   [B, S_enc], with ``cross``
    prefix_len int32 [B]      with a prefix-LM mask: each row's prefix (its prompt)

Keys and values are stored heads-first, the layout a decoding step reads them in (a
``[B, S, N, D]`` cache was copied into it by every layer at every step). Keys are stored after
the position scheme's ``rotate``. Slots are a ring: token number ``p`` of a row lives in slot
``p % S``. With a sliding-window mask a cache of ``window`` slots therefore suffices (the mask
kind's ``cache_slots``); for other masks S must hold the whole sequence. Because masks and
biases are computed from the stored positions, the same code serves full caches, ring caches,
and batches of prompts with different lengths.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from transformers_jax import backends
from transformers_jax.config import ConfigError, ModelConfig
from transformers_jax.registry import MASKS


@struct.dataclass
class LayerKV:
    """One attention layer's cached keys and values, heads-first ``[B, N, S, D]``."""

    key: jax.Array
    value: jax.Array


@struct.dataclass
class KVCache:
    """Everything a decoding step reads and returns (see the module docstring)."""

    index: jax.Array
    positions: jax.Array
    valid: jax.Array
    layers: tuple[LayerKV, ...]
    cross: tuple[LayerKV, ...] | None = None
    encoder_positions: jax.Array | None = None
    encoder_valid: jax.Array | None = None
    prefix_len: jax.Array | None = None  # [B]: a prefix-LM's prefix (the prompt) per row

    @property
    def size(self) -> int:
        return self.positions.shape[1]


class CacheWrite(NamedTuple):
    """Where new tokens go: for each slot, which new token to store (``take``) and whether."""

    take: jax.Array  # int32 [B, S]: index into the T new tokens
    write: jax.Array  # bool [B, S]


class RowSlot(NamedTuple):
    """Decoding one token per row: it goes to slot ``slot[b]``, updated in place.

    Two equivalent orders, the backend's choice (``backends.decode_reads_first``):
    ``read_first=False``: write the token, then attend over the written cache (the plain
    order; XLA:CPU's for several rows);
    ``read_first=True``: attend over the cache as it was plus the new token, then write
    (XLA:CPU's for one row, where writing first made it copy the cache every step).
    """

    slot: jax.Array  # int32 [B]
    read_first: bool = False


def write_row_slot(old: jax.Array, new: jax.Array, where: RowSlot, axis: int = 1) -> jax.Array:
    """Store ``new`` (one token per row: ``[B, 1]`` bookkeeping, or ``[B, N, 1, D]`` keys or
    values) at slot ``slot[b]`` of ``old``'s ``axis``; an in-place update inside loops.

    A per-row ``dynamic_update_slice`` (vmapped): XLA updates the cache buffer in place. (An
    indexed scatter ``old.at[rows, :, slot]`` instead became a loop that copied the cache.)
    """

    def one_row(o, n, s):
        return jax.lax.dynamic_update_slice_in_dim(o, n, s, axis=axis - 1)

    return jax.vmap(one_row)(old, new.astype(old.dtype), where.slot)


def check_decoding(config: ModelConfig) -> None:
    """Refuse, before any work, a model that cannot generate with a KV cache (prefill a
    prompt, then decode token by token): its mask, positional scheme or attention kernel
    (each entry says why and what works). A single decoding step reads the cache with
    ``attend_to_cache`` whatever the kernel, so ``init_cache`` checks the positions only."""
    if not config.mask.decodes:
        decoding = [name for name, kind in MASKS.items() if kind.decodes]
        raise ConfigError(
            f"mask={config.mask.name!r} does not decode left to right; use a mask that does "
            f"({', '.join(decoding)})")
    check_cacheable(config)
    config.attention.check_decoding(config)  # the prompt's prefill runs the kernel


def check_cacheable(config: ModelConfig) -> None:
    """Refuse a cache for positions that depend on the whole sequence."""
    if not config.position.cacheable:
        raise ConfigError(
            f"position={config.position}: its positions outside training depend on the whole "
            "sequence, so decoding token by token with a KV cache cannot reproduce them; "
            "choose a setting of the scheme that evaluates on the real positions (for "
            "randomized: --model.position.evaluate=real)")


def init_cache(config: ModelConfig, batch_size: int, size: int,
               n_layers: int | None = None) -> KVCache:
    """An empty cache of ``size`` slots per row for ``n_layers`` layers (default all)."""
    check_cacheable(config)
    N, D = config.kv_heads, config.dims_per_head
    dtype = jnp.dtype(config.dtype)
    layers = config.n_layers if n_layers is None else n_layers

    def empty() -> LayerKV:
        return LayerKV(jnp.zeros((batch_size, N, size, D), dtype),
                       jnp.zeros((batch_size, N, size, D), dtype))

    return KVCache(
        index=jnp.zeros((batch_size,), jnp.int32),
        positions=jnp.zeros((batch_size, size), jnp.int32),
        valid=jnp.zeros((batch_size, size), bool),
        layers=tuple(empty() for _ in range(layers)),
    )


def plan_write(index: jax.Array, lengths: jax.Array, size: int, n_new: int) -> CacheWrite:
    """For each slot, the last of the ``lengths`` new tokens that lands in it (ring order).

    New token ``t`` of a row goes to slot ``(index + t) % size``; when several land in one slot
    (prefill longer than a ring cache) the latest wins, computed as a gather so the result is
    deterministic (scatters with repeated indices are not).
    """
    slots = jnp.arange(size, dtype=jnp.int32)[None, :]  # [1, S]
    first = (slots - index[:, None]) % size  # first new token landing in each slot
    last_real = lengths[:, None] - 1
    take = first + size * jnp.maximum((last_real - first) // size, 0)
    write = first <= last_real
    return CacheWrite(take=jnp.clip(take, 0, n_new - 1), write=write)


def write_slots(old: jax.Array, new: jax.Array, plan: CacheWrite, axis: int = 1) -> jax.Array:
    """Store ``new`` into ``old`` following ``plan``: the T new tokens and the S slots lie on
    ``axis`` (``[B, T]`` into ``[B, S]``, or ``[B, N, T, D]`` into ``[B, N, S, D]``)."""
    shape = [1] * new.ndim
    shape[0], shape[axis] = plan.take.shape
    gathered = jnp.take_along_axis(new, plan.take.reshape(shape), axis=axis)
    return jnp.where(plan.write.reshape(shape), gathered, old)


def advance(cache: KVCache, new_positions: jax.Array, lengths: jax.Array,
            plan: CacheWrite) -> dict:
    """The bookkeeping part of the cache after writing: positions, validity, index."""
    return {
        "index": cache.index + lengths,
        "positions": write_slots(cache.positions, new_positions, plan),
        "valid": cache.valid | plan.write,
    }


class CacheStep(NamedTuple):
    """What every layer of one cached forward pass shares: where the new tokens are, which
    keys they may see (``[B, K]``, cache slots and, in prefill, the new tokens), how to store
    them, and the cache bookkeeping after the step."""

    positions: jax.Array  # int32 [B, T] of the new tokens
    valid: jax.Array  # bool [B, T]: real new tokens (the rest is right padding)
    kv_positions: jax.Array  # int32 [B, K]
    kv_valid: jax.Array  # bool [B, K]
    write: CacheWrite | RowSlot
    meta: dict  # the new index, positions and valid of the KVCache


def plan_step(cache: KVCache, n_new: int, lengths: jax.Array | None) -> CacheStep:
    """Plan a cached step over ``n_new`` tokens per row (``lengths`` of them real).

    Several tokens (prefill) attend over ``[cached slots, new tokens]`` and are stored after;
    one token per row (decoding) in either order of ``RowSlot``.
    """
    B, S = cache.positions.shape
    lengths_B = jnp.full((B,), n_new, jnp.int32) if lengths is None else lengths
    positions_BT = cache.index[:, None] + jnp.arange(n_new, dtype=jnp.int32)[None, :]
    valid_BT = jnp.arange(n_new)[None, :] < lengths_B[:, None]
    if n_new == 1:
        write: CacheWrite | RowSlot = RowSlot(cache.index % S,
                                              read_first=backends.decode_reads_first(B))
        meta = {
            "index": cache.index + lengths_B,
            "positions": write_row_slot(cache.positions, positions_BT, write),
            "valid": write_row_slot(cache.valid, valid_BT, write) | cache.valid,
        }
        if not write.read_first:
            return CacheStep(positions_BT, valid_BT, meta["positions"], meta["valid"], write,
                             meta)
        # Keys are [cache as it was, the new token]; the slot about to be overwritten is hidden
        # (in a ring cache it holds the token that leaves the window).
        overwritten = jnp.arange(S)[None, :] == write.slot[:, None]
        return CacheStep(
            positions_BT,
            valid_BT,
            jnp.concatenate([cache.positions, positions_BT], axis=1),
            jnp.concatenate([cache.valid & ~overwritten, valid_BT], axis=1),
            write,
            meta,
        )
    write = plan_write(cache.index, lengths_B, S, n_new)
    return CacheStep(
        positions_BT,
        valid_BT,
        jnp.concatenate([cache.positions, positions_BT], axis=1),
        jnp.concatenate([cache.valid, valid_BT], axis=1),
        write,
        advance(cache, positions_BT, lengths_B, write),
    )
