"""Positional schemes against hand values, independent numpy formulas and their defining
properties (REFERENCES.md section 4)."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformers_jax.nn.positions import (
    POSITIONS,
    ROPE_SCALINGS,
    AlibiBias,
    FireBias,
    Rope,
    T5RelativeBias,
    alibi_slopes,
    apply_rope,
    rope_frequencies,
    sinusoidal_embedding,
    t5_relative_bucket,
)
from transformers_jax.registry import UnknownNameError

SCALINGS = tuple(ROPE_SCALINGS.names())


def make_rope(scaling="none", pairing="rotate_half", fraction=1.0, base=10000.0, **kw) -> Rope:
    """A small-context rope so that every scaling rule is active at test lengths."""
    if scaling != "none":
        kw.setdefault("factor", 4.0)
        kw.setdefault("original_max_len", 16)
    return Rope(scaling={"name": scaling, **kw}, pairing=pairing, fraction=fraction, base=base)


def plain_inv_freq(base, d):
    return 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)


def randn(seed, *shape):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def scores(q_BTHD, k_BTHD):
    """Unscaled attention logits [B, H, Q, K]."""
    return jnp.einsum("bqhd,bkhd->bhqk", q_BTHD, k_BTHD)


# Sinusoidal -------------------------------------------------------------------------------------


def test_sinusoidal_hand_values():
    pe = np.asarray(sinusoidal_embedding(jnp.array([[0, 1, 3]], jnp.int32), 4))
    assert pe.shape == (1, 3, 4) and pe.dtype == np.float32
    # dim 4: w_0 = 1, w_1 = 10000**(-2/4) = 0.01; interleaved (sin, cos, sin, cos).
    np.testing.assert_allclose(pe[0, 0], [0.0, 1.0, 0.0, 1.0], atol=1e-7)
    np.testing.assert_allclose(pe[0, 1], [0.841471, 0.540302, 0.0099998, 0.99995], atol=1e-6)
    np.testing.assert_allclose(pe[0, 2], [0.141120, -0.989992, 0.0299955, 0.99955], atol=1e-6)
    # dim 6: w_1 = 10000**(-1/3) = 0.0464159; PE[3, 2] = sin(0.139248), PE[3, 3] = cos(same).
    pe6 = np.asarray(sinusoidal_embedding(jnp.array([[3]], jnp.int32), 6))
    np.testing.assert_allclose(pe6[0, 0, 2:4], [0.138798, 0.990321], atol=1e-6)


def test_sinusoidal_reads_position_values_not_indices():
    pos = jnp.array([[5, 6, 0, 1]], jnp.int32)  # a packed row: a segment restarts at 0
    pe = sinusoidal_embedding(pos, 8)
    ref = sinusoidal_embedding(jnp.arange(8, dtype=jnp.int32)[None], 8)
    np.testing.assert_array_equal(pe[0], ref[0, jnp.array([5, 6, 0, 1])])


@pytest.mark.parametrize("k", [1, 3, 8, 20])
def test_sinusoidal_shift_is_block_rotation(k):
    dim = 16
    w = 10000.0 ** (-np.arange(0, dim, 2) / dim)
    cos, sin = np.cos(k * w), np.sin(k * w)
    # (sin, cos) of angle a + b = [[cos b, sin b], [-sin b, cos b]] @ (sin a, cos a)
    rot = np.zeros((dim, dim))
    for i in range(dim // 2):
        rot[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[cos[i], sin[i]], [-sin[i], cos[i]]]
    p = jnp.arange(32, dtype=jnp.int32)[None]
    pe_p = np.asarray(sinusoidal_embedding(p, dim))[0]
    pe_pk = np.asarray(sinusoidal_embedding(p + k, dim))[0]
    np.testing.assert_allclose(pe_p @ rot.T, pe_pk, atol=1e-5)
    assert np.abs(pe_p - pe_pk).max() > 0.1  # the map is not the identity


def test_sinusoidal_rejects_odd_dim():
    with pytest.raises(ValueError, match="even"):
        sinusoidal_embedding(jnp.zeros((1, 2), jnp.int32), 5)


# RoPE: properties -------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_rope_scores_depend_only_on_offset(pairing, scaling):
    """Shift every position by 37: the q.k score matrix must not change.

    Both placements sit in one batch (rows 0 and 1 hold the same q and k) because dynamic NTK
    derives its base from max(positions) over the whole batch: in one call both rows share that
    base, and only then is the rotation a pure function of position. With L0 = 16 the shared
    length 8 + 37 exceeds L0, so the dynamic base really is stretched here.
    """
    rope = make_rope(scaling, pairing, fraction=0.5)
    t, h, d = 8, 2, 16
    q = jnp.tile(randn(0, 1, t, h, d), (2, 1, 1, 1))
    k = jnp.tile(randn(1, 1, t, h, d), (2, 1, 1, 1))
    pos = jnp.arange(t, dtype=jnp.int32)[None] + jnp.array([[0], [37]], jnp.int32)
    s = scores(apply_rope(q, pos, rope), apply_rope(k, pos, rope))
    np.testing.assert_allclose(s[0], s[1], atol=1e-4)
    # Not vacuous: rotation changed the scores, and dynamic NTK left the plain frequencies.
    assert np.abs(np.asarray(s[0] - scores(q, k)[0])).max() > 1e-2
    if scaling == "dynamic_ntk":
        dyn, _ = rope_frequencies(rope, d // 2, seq_len=t + 37)
        assert np.abs(np.asarray(dyn) - plain_inv_freq(rope.base, d // 2)).max() > 1e-3


@pytest.mark.parametrize("scaling", ["none", "ntk", "yarn", "llama3"])
def test_rope_decode_offsets_queries_and_keys_separately(scaling):
    """A query at m and keys at n (as in cached decoding): scores follow m - n only."""
    rope = make_rope(scaling, "rotate_half")
    q, k = randn(2, 1, 3, 2, 8), randn(3, 1, 5, 2, 8)
    q_pos = jnp.array([[9, 4, 11]], jnp.int32)
    k_pos = jnp.array([[0, 7, 3, 12, 5]], jnp.int32)

    def s(off):
        return scores(apply_rope(q, q_pos + off, rope), apply_rope(k, k_pos + off, rope))

    np.testing.assert_allclose(s(0), s(101), atol=1e-4)


@pytest.mark.parametrize("scaling", ["none", "linear", "ntk", "dynamic_ntk", "llama3"])
@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_rope_position_zero_is_identity(pairing, scaling):
    x = randn(4, 2, 3, 2, 8)
    out = apply_rope(x, jnp.zeros((2, 3), jnp.int32), make_rope(scaling, pairing))
    np.testing.assert_allclose(out, x, atol=1e-7)


def test_rope_yarn_scales_cos_and_sin():
    rope = make_rope("yarn")
    x = randn(5, 1, 4, 2, 8)
    factor = 0.1 * math.log(4.0) + 1.0
    at_zero = apply_rope(x, jnp.zeros((1, 4), jnp.int32), rope)
    np.testing.assert_allclose(at_zero, factor * x, rtol=1e-6)
    moved = apply_rope(x, jnp.arange(4, dtype=jnp.int32)[None], rope)
    np.testing.assert_allclose(
        jnp.linalg.norm(moved, axis=-1), factor * jnp.linalg.norm(x, axis=-1), rtol=1e-5
    )


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_pairings_differ_by_a_permutation(fraction):
    d = 16
    r = int(d * fraction)
    # Interleaved pair i is dims (2i, 2i+1); rotate-half pair i is dims (i, i + r/2).
    perm = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2), np.arange(r, d)])
    x = randn(6, 2, 5, 3, d)
    pos = jnp.array([[0, 1, 2, 7, 30], [4, 5, 6, 0, 1]], jnp.int32)
    inter = apply_rope(x, pos, make_rope("none", "interleaved", fraction))
    half = apply_rope(x[..., perm], pos, make_rope("none", "rotate_half", fraction))
    np.testing.assert_allclose(half, inter[..., perm], atol=1e-6)
    assert np.abs(np.asarray(half - inter)).max() > 1e-2  # the layouts are not the same


@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_rope_equals_complex_multiplication(pairing):
    """Pair (a, b) at position p becomes (a + ib) * exp(i p w) (independent numpy reference)."""
    d = 8
    x = np.asarray(randn(7, 1, 4, 1, d), np.float64)
    pos = np.array([[0, 3, 10, 250]])
    w = plain_inv_freq(10000.0, d)
    if pairing == "rotate_half":
        a, b = x[..., : d // 2], x[..., d // 2 :]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    z = (a + 1j * b) * np.exp(1j * pos[..., None, None] * w)
    ref = (
        np.concatenate([z.real, z.imag], -1)
        if pairing == "rotate_half"
        else np.stack([z.real, z.imag], -1).reshape(x.shape)
    )
    out = apply_rope(
        jnp.asarray(x, jnp.float32), jnp.asarray(pos, jnp.int32), make_rope(pairing=pairing)
    )
    np.testing.assert_allclose(out, ref, atol=2e-5)


@pytest.mark.parametrize("scaling", ["none", "linear", "ntk", "dynamic_ntk", "llama3"])
def test_rope_preserves_norm(scaling):
    x = randn(8, 2, 6, 2, 16)
    pos = jnp.array([[0, 5, 9, 40, 41, 100], [3, 2, 1, 0, 60, 61]], jnp.int32)
    out = apply_rope(x, pos, make_rope(scaling))
    np.testing.assert_allclose(
        jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5
    )


@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_partial_rotary_leaves_trailing_dims(pairing):
    x = randn(9, 1, 5, 2, 16)
    pos = jnp.arange(1, 6, dtype=jnp.int32)[None]
    out = apply_rope(x, pos, make_rope(pairing=pairing, fraction=0.25))  # rotary_dim 4
    np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
    assert np.abs(np.asarray(out[..., :4] - x[..., :4])).max() > 1e-2
    # An explicit rotary_dim overrides the fraction.
    out6 = apply_rope(x, pos, make_rope(pairing=pairing), rotary_dim=6)
    np.testing.assert_array_equal(out6[..., 6:], x[..., 6:])


def test_rope_keeps_dtype_and_checks_rotary_dim():
    x = randn(10, 1, 3, 2, 8).astype(jnp.bfloat16)
    pos = jnp.arange(3, dtype=jnp.int32)[None]
    out = apply_rope(x, pos, make_rope())
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    ref = apply_rope(x.astype(jnp.float32), pos, make_rope())
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=2e-2)
    for bad in (3, 0, 10):
        with pytest.raises(ValueError, match="rotary_dim"):
            apply_rope(x, pos, make_rope(), rotary_dim=bad)


# RoPE: frequency check values --------------------------------------------------------------------


def test_ntk_base_check_value():
    inv, factor = rope_frequencies(make_rope("ntk", factor=4.0), 64)
    # inv[-1] = base'**(-62/64); read base' back from the most sensitive entry.
    base = float(np.asarray(inv, np.float64)[-1]) ** (-64 / 62)
    assert base == pytest.approx(41829.4, abs=0.1)
    assert factor == 1.0


def test_linear_divides_by_factor():
    inv, factor = rope_frequencies(make_rope("linear", factor=4.0), 32)
    np.testing.assert_allclose(inv, plain_inv_freq(10000.0, 32) / 4.0, rtol=1e-6)
    plain, _ = rope_frequencies(make_rope(), 32)
    np.testing.assert_allclose(plain, plain_inv_freq(10000.0, 32), rtol=1e-6)
    assert factor == 1.0


def test_yarn_check_values():
    d, base, s, l0 = 128, 10000.0, 4.0, 4096
    inv, factor = rope_frequencies(make_rope("yarn", factor=s, original_max_len=l0), d)
    inv, plain = np.asarray(inv), plain_inv_freq(base, d)

    def fcd(r):
        return d * np.log(l0 / (2 * np.pi * r)) / (2 * np.log(base))

    low, high = int(np.floor(fcd(32))), int(np.ceil(fcd(1)))
    assert (low, high) == (20, 46)  # computed by hand from the formula
    ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
    np.testing.assert_allclose(inv, plain / s * ramp + plain * (1 - ramp), rtol=1e-6)
    np.testing.assert_allclose(inv[:low], plain[:low], rtol=1e-6)  # high frequency: kept
    np.testing.assert_allclose(inv[high:], plain[high:] / s, rtol=1e-6)  # low frequency: / s
    mid = inv[low + 1 : high]
    assert np.all(mid < plain[low + 1 : high]) and np.all(mid > plain[low + 1 : high] / s)
    assert factor == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_llama3_check_values():
    d, base, s, l0 = 128, 500000.0, 8.0, 8192
    rope = make_rope(
        "llama3",
        base=base,
        factor=s,
        original_max_len=l0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    )
    inv, factor = rope_frequencies(rope, d)
    inv, plain = np.asarray(inv), plain_inv_freq(base, d)
    wavelen = 2 * np.pi / plain
    short, long = wavelen < l0 / 4.0, wavelen > l0 / 1.0
    mid = ~short & ~long
    assert short.sum() > 0 and long.sum() > 0 and mid.sum() > 0
    np.testing.assert_allclose(inv[short], plain[short], rtol=1e-6)
    np.testing.assert_allclose(inv[long], plain[long] / s, rtol=1e-6)
    smooth = (l0 / wavelen[mid] - 1.0) / (4.0 - 1.0)
    expect_mid = (1 - smooth) * plain[mid] / s + smooth * plain[mid]
    np.testing.assert_allclose(inv[mid], expect_mid, rtol=1e-6)
    assert factor == 1.0


def test_dynamic_ntk_switches_on_past_original_length():
    d, s, l0 = 32, 4.0, 64
    rope = make_rope("dynamic_ntk", factor=s, original_max_len=l0)
    plain = plain_inv_freq(10000.0, d).astype(np.float32)
    for length in (None, 1, 40, l0):
        inv, factor = rope_frequencies(rope, d, seq_len=length)
        np.testing.assert_array_equal(inv, plain)
        assert factor == 1.0
    length = 200
    base = 10000.0 * (s * length / l0 - (s - 1)) ** (d / (d - 2))
    inv, _ = rope_frequencies(rope, d, seq_len=length)
    np.testing.assert_allclose(inv, plain_inv_freq(base, d), rtol=1e-5)
    # seq_len may be traced (apply_rope derives it from positions inside jit).
    traced, _ = jax.jit(lambda n: rope_frequencies(rope, d, seq_len=n))(jnp.int32(length))
    np.testing.assert_allclose(traced, inv, rtol=1e-6)


def test_dynamic_ntk_apply_rope_uses_max_position():
    rope = make_rope("dynamic_ntk", original_max_len=16)
    x = randn(11, 1, 4, 1, 8)
    short = jnp.arange(4, dtype=jnp.int32)[None]  # L = 4 <= L0: plain rope
    np.testing.assert_array_equal(apply_rope(x, short, rope), apply_rope(x, short, make_rope()))
    far = short + 100  # L = 104 > L0: stretched base, and the same under jit
    eager = apply_rope(x, far, rope)
    np.testing.assert_allclose(
        jax.jit(apply_rope, static_argnums=2)(x, far, rope), eager, atol=1e-6
    )
    plain = apply_rope(x, far, make_rope())
    assert np.abs(np.asarray(eager - plain)).max() > 1e-2
    pinned = apply_rope(x, far, rope, seq_len=104)
    np.testing.assert_allclose(pinned, eager, atol=1e-6)


# ALiBi ------------------------------------------------------------------------------------------


def test_alibi_slopes_check_values():
    np.testing.assert_array_equal(alibi_slopes(4), [1 / 4, 1 / 16, 1 / 64, 1 / 256])
    np.testing.assert_array_equal(alibi_slopes(8), [2.0**-k for k in range(1, 9)])
    np.testing.assert_array_equal(alibi_slopes(6), [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8])
    np.testing.assert_allclose(alibi_slopes(2), [1 / 16, 1 / 256])
    # 12 heads: 8 slopes of n=8, then 4 of the odd-indexed slopes of n=16.
    np.testing.assert_allclose(alibi_slopes(12)[8:], [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5])


def test_alibi_bias_values():
    pos = jnp.arange(3, dtype=jnp.int32)[None]
    bias = AlibiBias(2).apply({}, pos, pos)
    assert bias.shape == (1, 2, 3, 3) and bias.dtype == jnp.float32
    dist = np.array([[0, 1, 2], [1, 0, 1], [2, 1, 0]])
    np.testing.assert_allclose(bias[0, 0], -dist / 16)
    np.testing.assert_allclose(bias[0, 1], -dist / 256)
    # Cached decoding: one query at position 5 against keys 0..5 sees -m * (i - j).
    q = jnp.array([[5]], jnp.int32)
    k = jnp.arange(6, dtype=jnp.int32)[None]
    np.testing.assert_allclose(AlibiBias(2).apply({}, q, k)[0, 0, 0], -(5 - np.arange(6)) / 16)


# T5 relative bias --------------------------------------------------------------------------------


def buckets(rp, bidirectional):
    return np.asarray(t5_relative_bucket(jnp.asarray(rp, jnp.int32), bidirectional, 32, 128))


def test_t5_causal_buckets():
    dist = np.arange(0, 300)
    b = buckets(-dist, bidirectional=False)  # key before query: rp = -distance
    np.testing.assert_array_equal(b[:16], np.arange(16))
    assert set(b[16:19]) == {16} and b[19] == 17
    assert set(b[99:113]) == {30} and b[98] == 29
    assert set(b[113:]) == {31}
    assert np.all(np.diff(b) >= 0)
    assert set(buckets(np.arange(1, 50), bidirectional=False)) == {0}  # future keys: distance 0


def test_t5_bidirectional_buckets():
    dist = np.arange(0, 300)
    before = buckets(-dist, bidirectional=True)
    np.testing.assert_array_equal(before[:8], np.arange(8))
    assert set(before[8:12]) == {8} and before[12] == 9
    assert set(before[91:]) == {15} and before[90] == 14
    after = buckets(dist, bidirectional=True)
    assert after[0] == 0 and after[1] == 17
    np.testing.assert_array_equal(after[1:], before[1:] + 16)


def test_t5_relative_bias_module():
    module = T5RelativeBias(n_heads=3, num_buckets=32, max_distance=128, bidirectional=True)
    pos = jnp.arange(6, dtype=jnp.int32)[None]
    params = module.init(jax.random.PRNGKey(0), pos, pos)
    table = params["params"]["rel_embedding"]
    assert table.shape == (32, 3)
    bias = module.apply(params, pos, pos)
    assert bias.shape == (1, 3, 6, 6) and bias.dtype == jnp.float32
    rp = np.arange(6)[None, :] - np.arange(6)[:, None]  # key - query
    np.testing.assert_array_equal(bias[0], np.asarray(table)[buckets(rp, True)].transpose(2, 0, 1))
    # Equal relative distance, equal bias (a Toeplitz matrix per head), also after a shift.
    for off in range(-5, 6):
        diag = np.diagonal(np.asarray(bias[0]), offset=off, axis1=1, axis2=2)
        np.testing.assert_array_equal(diag, diag[:, :1].repeat(diag.shape[1], 1))
    shifted = module.apply(params, pos + 50, pos + 50)
    np.testing.assert_array_equal(shifted, bias)
    assert np.abs(np.asarray(bias[0, :, 0, 1] - bias[0, :, 1, 0])).max() > 0  # direction matters


# FIRE --------------------------------------------------------------------------------------------


def fire_reference(params, q_pos, k_pos):
    """FIRE from its definition, in numpy float64."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params["params"])
    c, L = abs(p["c"]), abs(p["threshold"])
    i = np.asarray(q_pos)[:, :, None].astype(np.float64)
    j = np.asarray(k_pos)[:, None, :].astype(np.float64)
    x = np.log(c * np.abs(i - j) + 1) / np.log(c * np.maximum(L, i) + 1)
    h = np.maximum(x[..., None] * p["mlp_in"]["kernel"][0] + p["mlp_in"]["bias"], 0)
    return (h @ p["mlp_out"]["kernel"] + p["mlp_out"]["bias"]).transpose(0, 3, 1, 2)


def test_fire_bias_matches_definition():
    module = FireBias(n_heads=4, hidden=8)
    q = jnp.array([[0, 1, 2, 3, 40]], jnp.int32)
    k = jnp.array([[0, 1, 2, 3, 4, 40]], jnp.int32)
    params = module.init(jax.random.PRNGKey(1), q, k)
    assert float(params["params"]["c"]) == pytest.approx(0.1)
    assert float(params["params"]["threshold"]) == 512.0
    bias = module.apply(params, q, k)
    assert bias.shape == (1, 4, 5, 6) and bias.dtype == jnp.float32
    assert np.all(np.isfinite(bias))
    np.testing.assert_allclose(bias, fire_reference(params, q, k), rtol=1e-5, atol=1e-6)

    # All queries below L = 512: the bias depends on |i - j| alone.
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    b = np.asarray(module.apply(params, pos, pos))
    np.testing.assert_allclose(b[0, :, 2, 5], b[0, :, 5, 2], atol=1e-6)
    np.testing.assert_allclose(b[0, :, 1, 4], b[0, :, 6, 3], atol=1e-6)
    # With L = 2, queries past it normalise by their own position: same |i - j|, different i,
    # different bias (FIRE's progressive interpolation).
    small = jax.tree_util.tree_map(lambda a: a, params)
    small["params"]["threshold"] = jnp.float32(2.0)
    b2 = np.asarray(module.apply(small, pos, pos))
    np.testing.assert_allclose(b2, fire_reference(small, pos, pos), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b2[0, :, 1, 0], b2[0, :, 2, 1], atol=1e-6)  # i <= L: same
    assert np.abs(b2[0, :, 3, 2] - b2[0, :, 7, 6]).max() > 1e-4  # i > L: differs


def test_fire_gradients_reach_c_and_threshold():
    module = FireBias(n_heads=2, hidden=8)
    pos = jnp.arange(6, dtype=jnp.int32)[None]
    params = module.init(jax.random.PRNGKey(2), pos, pos)
    grads = jax.grad(lambda p: jnp.sum(module.apply(p, pos, pos) ** 2))(params)["params"]
    assert abs(float(grads["c"])) > 0
    assert abs(float(grads["threshold"])) > 0


# Registry ----------------------------------------------------------------------------------------


def test_registry_hooks_and_unknown_name():
    cfg = types.SimpleNamespace(n_heads=6, d_model=8, init_std=0.02, dtype="float32",
                                param_dtype="float32", max_len=16, dims_per_head=4)
    has = {name: (POSITIONS.get(name)().embedding(cfg) is not None,
                  POSITIONS.get(name)().bias(cfg, False) is not None)
           for name in ("none", "sinusoidal", "learned", "rope", "alibi", "t5", "fire")}
    assert has == {
        "none": (False, False),
        "sinusoidal": (True, False),
        "learned": (True, False),
        "rope": (False, False),
        "alibi": (False, True),
        "t5": (False, True),
        "fire": (False, True),
    }
    assert POSITIONS.get("learned")().max_length(cfg) == 16
    assert POSITIONS.get("rope")().max_length(cfg) is None
    with pytest.raises(UnknownNameError, match="alibi, fire, .*learned, none, .*rope"):
        POSITIONS.get("no-such-scheme")


def test_registry_builds_bias_modules_from_config():
    cfg = types.SimpleNamespace(n_heads=6)
    alibi = POSITIONS.get("alibi")().bias(cfg, False)
    assert isinstance(alibi, AlibiBias) and alibi.n_heads == 6
    t5 = POSITIONS.get("t5")(num_buckets=16, max_distance=64).bias(cfg, True)
    assert isinstance(t5, T5RelativeBias)
    assert (t5.n_heads, t5.num_buckets, t5.max_distance, t5.bidirectional) == (6, 16, 64, True)
    assert POSITIONS.get("t5")().bias(cfg, False).bidirectional is False
    fire = POSITIONS.get("fire")(hidden=12).bias(cfg, False)
    assert isinstance(fire, FireBias) and (fire.n_heads, fire.hidden) == (6, 12)
