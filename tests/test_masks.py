"""Mask builders: exact boolean patterns, and tiles that agree with the dense mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import mask_settings

from transformers_jax.nn.mask_kinds import SlidingWindow
from transformers_jax.nn.masks import AttentionMask, build_mask


def positions(n, batch=1):
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))


def test_causal_is_lower_triangular():
    m = build_mask("causal", positions(4), positions(4)).dense()
    assert m.shape == (1, 1, 4, 4)
    np.testing.assert_array_equal(m[0, 0], np.tril(np.ones((4, 4), bool)))


def test_bidirectional_with_padding():
    valid = jnp.array([[True, True, True, False]])
    m = build_mask("bidirectional", positions(4), positions(4), kv_valid=valid).dense()
    expected = np.ones((4, 4), bool)
    expected[:, 3] = False
    np.testing.assert_array_equal(m[0, 0], expected)


def test_prefix_lm():
    m = build_mask("prefix", positions(5), positions(5), prefix_len=jnp.array([2])).dense()
    expected = np.tril(np.ones((5, 5), bool))
    expected[:, :2] = True  # every query sees the prefix, the prefix sees itself both ways
    np.testing.assert_array_equal(m[0, 0], expected)


def test_sliding_window():
    m = build_mask(SlidingWindow(window=2), positions(5), positions(5)).dense()
    expected = np.tril(np.ones((5, 5), bool)) & ~np.tril(np.ones((5, 5), bool), -2)
    np.testing.assert_array_equal(m[0, 0], expected)


def test_packed_segments_restart_positions():
    seg = jnp.array([[1, 1, 1, 2, 2]])
    pos = jnp.array([[0, 1, 2, 0, 1]])
    m = build_mask("causal", pos, pos, q_segments=seg, kv_segments=seg).dense()
    expected = np.zeros((5, 5), bool)
    expected[:3, :3] = np.tril(np.ones((3, 3), bool))
    expected[3:, 3:] = np.tril(np.ones((2, 2), bool))
    np.testing.assert_array_equal(m[0, 0], expected)


def test_unknown_kind_lists_choices():
    with pytest.raises(ValueError, match="valid choices: bidirectional, causal, prefix"):
        build_mask("diagonal", positions(3), positions(3))


def test_blocks_tile_the_dense_mask():
    seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]])
    pos = positions(12)
    mask = AttentionMask(pos, pos, kv_valid=pos < 11, q_segments=seg, kv_segments=seg,
                         causal=True, window=5)
    dense = np.asarray(mask.dense())
    for q0 in range(0, 12, 4):
        for k0 in range(0, 12, 3):
            np.testing.assert_array_equal(
                mask.block(q0, 4, k0, 3), dense[:, :, q0 : q0 + 4, k0 : k0 + 3]
            )


def _registered_kinds():
    """Every registered mask kind, with a small window where it takes one."""
    from transformers_jax.registry import MASKS

    return [pytest.param(kind(**mask_settings(name)), id=name) for name, kind in MASKS.items()]


@pytest.mark.parametrize("kind", _registered_kinds())
def test_tile_visibility_agrees_with_the_dense_mask(kind):
    """For every registered mask kind (a new one is covered once registered), on positions the
    model made itself (aligned): a tile called "none" is all False in the dense mask, "all" all
    True, "some" mixed; a kind whose visibility depends on data (a prefix) says None. Tiles of
    every size and offset over 11 positions, including ones that reach past the end (None)."""
    n = 11
    pos = positions(n, batch=2)
    prefix_len = jnp.array([3, 6]) if kind.needs_prefix_len else None
    mask = build_mask(kind, pos, pos, prefix_len=prefix_len, aligned=True)
    dense = np.asarray(mask.dense())
    seen = set()
    for q0, k0, qs, ks in np.ndindex(n, n, 5, 5):
        q0, k0, qs, ks = int(q0), int(k0), int(qs) + 1, int(ks) + 1
        got = mask.tile_visibility(q0, qs, k0, ks)
        seen.add(got)
        if q0 + qs > n or k0 + ks > n or kind.needs_prefix_len:
            assert got is None
            continue
        tile = dense[:, :, q0:q0 + qs, k0:k0 + ks]
        want = "all" if tile.all() else "none" if not tile.any() else "some"
        assert got == want, (q0, qs, k0, ks)
    if not kind.needs_prefix_len:  # the kinds' patterns give each answer somewhere
        assert {"all", None} <= seen and (("none" in seen) == kind.causal)


def test_tile_visibility_is_unknown_unless_aligned_and_free_of_data():
    """Given positions (packed rows restart them), padding or segments, the visibility of a
    tile depends on values only known at run time: None, so kernels keep their run-time check."""
    pos = positions(8)
    assert build_mask("causal", pos, pos).tile_visibility(0, 4, 4, 4) is None
    assert build_mask("causal", pos, pos, aligned=True).tile_visibility(0, 4, 4, 4) == "none"
    for extra in ({"kv_valid": pos < 6}, {"q_segments": pos * 0, "kv_segments": pos * 0}):
        mask = build_mask("causal", pos, pos, aligned=True, **extra)
        assert mask.tile_visibility(0, 4, 4, 4) is None


@pytest.mark.parametrize("kind", _registered_kinds())
@pytest.mark.parametrize("rows", ["aligned", "packed"])
def test_may_see_any_never_hides_a_visible_tile(kind, rows):
    """What the ring asks before computing a block: for every tile (sizes 1-6, every offset)
    of 16 positions in 2 rows, False only where the dense mask has no True. On one document's
    positions it is exact for the position rules (causal, window, prefix); on packed rows
    (positions restarting, segment ids, padding at the end) it still finds hidden tiles."""
    n = 16
    pos = positions(n, batch=2)
    extra = {}
    if rows == "packed":
        cut = jnp.array([[6], [11]])
        seg = (jnp.arange(n)[None] >= cut).astype(jnp.int32)
        pos = jnp.where(seg == 0, pos, pos - cut)
        extra = {"q_segments": seg, "kv_segments": seg, "kv_valid": jnp.arange(n)[None] < 14}
    prefix_len = jnp.array([3, 9]) if kind.needs_prefix_len else None
    mask = build_mask(kind, pos, pos, prefix_len=prefix_len, **extra)
    dense = mask.dense()
    for qs, ks in [(1, 1), (4, 4), (3, 6), (6, 2)]:
        def answer(q0, k0, qs=qs, ks=ks):
            def take(arr, start, size):
                return None if arr is None else jax.lax.dynamic_slice_in_dim(arr, start, size, 1)
            tile = mask.replace(
                q_positions=take(pos, q0, qs), kv_positions=take(pos, k0, ks),
                kv_valid=take(mask.kv_valid, k0, ks), q_segments=take(mask.q_segments, q0, qs),
                kv_segments=take(mask.kv_segments, k0, ks))
            block = jax.lax.dynamic_slice(dense, (0, 0, q0, k0), (2, 1, qs, ks))
            return tile.may_see_any(), block.any()

        q0, k0 = (x.ravel() for x in jnp.meshgrid(jnp.arange(n - qs + 1), jnp.arange(n - ks + 1)))
        said, seen = (np.asarray(x) for x in jax.jit(jax.vmap(answer))(q0, k0))
        assert not (seen & ~said).any(), "a tile with a visible pair was called hidden"
        if rows == "aligned":
            np.testing.assert_array_equal(said, seen)
        if kind.causal or rows == "packed":  # something is hidden, and found so
            assert (~said).any()
        if rows == "packed" and (qs, ks) == (6, 2):  # queries of the first documents, keys
            # of the second (valid): hidden by the segment ids alone, whatever the kind
            assert not said[(np.asarray(q0) == 0) & (np.asarray(k0) == 12)].any()
