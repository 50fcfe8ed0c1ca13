"""Mask builders: exact boolean patterns, and tiles that agree with the dense mask."""

import jax.numpy as jnp
import numpy as np
import pytest

from transformers_jax.nn.masks import AttentionMask, SlidingWindow, build_mask


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
