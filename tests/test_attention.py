"""Attention implementations: the golden example, parity with the reference, edge cases.

Shape legend: B batch, Q/K lengths, H query heads, N key/value heads, D head dim.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_helpers import mask_settings
from profiles import examples

from transformers_jax import ModelConfig
from transformers_jax.nn import mask_kinds, masks
from transformers_jax.nn.attention import (
    ATTENTION,
    attend_to_cache,
    attention_weights,
    dot_product_attention,
)
from transformers_jax.registry import ConfigError, UnknownNameError

# Every registered implementation that runs here, and those besides the oracle: a new kernel
# is held to the reference the moment it is registered.
CPU_IMPLEMENTATIONS = tuple(name for name, impl in ATTENTION.items() if "cpu" in impl.backends)
CANDIDATES = tuple(name for name in CPU_IMPLEMENTATIONS if not ATTENTION.get(name).oracle)
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _quick_unless_chunked(names):
    """The implementations, the chunked kernel's case left to the full run (``slow``): its
    unrolled tiles take seconds to compile; the quick tier holds it to the reference through
    the golden example and one parity case with gradients."""
    return [pytest.param(name, marks=pytest.mark.slow) if name == "chunked" else name
            for name in names]


_STATIC = ("implementation", "scale", "logit_softcap", "chunk_size")
# One jitted entry point, so calls with equal shapes and settings share a compiled program
# (the tests are dominated by compile time, not run time).
_jit_attention = jax.jit(dot_product_attention, static_argnames=_STATIC)


def _attend(impl, q, k, v, *, chunk_size=2, **kw):
    chunk_size = chunk_size if impl == "chunked" else 128  # others ignore it: share the cache
    return _jit_attention(q, k, v, implementation=impl, chunk_size=chunk_size, **kw)


def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape), dtype)


@functools.partial(jax.jit, static_argnames=("impl", "chunk_size", "logit_softcap"))
def _jit_outputs_and_grads(impl, q, k, v, bias, mask, cotangent, chunk_size, logit_softcap):
    def loss(q, k, v, bias):
        out = dot_product_attention(
            q,
            k,
            v,
            bias=bias,
            mask=mask,
            implementation=impl,
            chunk_size=chunk_size,
            logit_softcap=logit_softcap,
        )
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)
    return out, grads


def _outputs_and_grads(impl, q, k, v, bias, mask, cotangent, *, chunk_size, logit_softcap=None):
    """Output and the gradients of sum(out * cotangent) w.r.t. q, k, v and bias (or None)."""
    chunk_size = chunk_size if impl == "chunked" else 128
    return _jit_outputs_and_grads(
        impl, q, k, v, bias, mask, cotangent, chunk_size=chunk_size, logit_softcap=logit_softcap
    )


# --------------------------------------------------------------------------------------------
# Golden three-token example (REFERENCES.md section 1)

X = np.array([[1, 0], [0, 2], [1, 1]], np.float32)
W_Q = np.array([[1, 0], [1, 1]], np.float32)
W_K = np.eye(2, dtype=np.float32)
W_V = np.array([[2, 0], [0, 1]], np.float32)
A_GOLDEN = np.array([[0.4011, 0.1978, 0.4011], [0.1084, 0.4458, 0.4458], [0.2483, 0.2483, 0.5035]])
O_GOLDEN = np.array([[1.6044, 0.7967], [1.1084, 1.3374], [1.5035, 1.0000]])
A_CAUSAL = np.array([[1.0, 0.0, 0.0], [0.1956, 0.8044, 0.0], [0.2483, 0.2483, 0.5035]])
O_CAUSAL = np.array([[2.0, 0.0], [0.3912, 1.6088], [1.5035, 1.0000]])  # rows of A_CAUSAL @ V


def _golden_qkv():
    q, k, v = X @ W_Q, X @ W_K, X @ W_V  # row vectors times W reproduce the printed Q, K, V
    np.testing.assert_array_equal(q, [[1, 0], [2, 2], [2, 1]])
    np.testing.assert_array_equal(v, [[2, 0], [0, 2], [2, 1]])
    return [jnp.asarray(x)[None, :, None, :] for x in (q, k, v)]  # [B=1, T=3, H=1, D=2]


def _weights_via_identity_values(impl, q, k, **kw):
    """Recover an implementation's attention weights: with v = I_3 the output row i is A[i].

    q and k get a zero third dimension (so D = 3 = K) and the scale stays 1/sqrt(2)."""
    pad = [(0, 0), (0, 0), (0, 0), (0, 1)]
    eye = jnp.eye(3)[None, :, None, :]
    out = _attend(impl, jnp.pad(q, pad), jnp.pad(k, pad), eye, scale=1 / math.sqrt(2), **kw)
    return out[0, :, 0, :]


@pytest.mark.parametrize("impl", CPU_IMPLEMENTATIONS)
def test_golden_three_tokens(impl):
    q, k, v = _golden_qkv()
    np.testing.assert_allclose(_attend(impl, q, k, v)[0, :, 0], O_GOLDEN, atol=1e-4)
    np.testing.assert_allclose(_weights_via_identity_values(impl, q, k), A_GOLDEN, atol=1e-4)
    np.testing.assert_allclose(attention_weights(q, k)[0, 0], A_GOLDEN, atol=1e-4)


@pytest.mark.parametrize("impl", CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("as_object", [True, False], ids=["AttentionMask", "dense"])
def test_golden_three_tokens_causal(impl, as_object):
    q, k, v = _golden_qkv()
    pos = jnp.arange(3)[None]
    mask = masks.build_mask("causal", pos, pos)
    mask = mask if as_object else mask.dense()
    weights = _weights_via_identity_values(impl, q, k, mask=mask)
    np.testing.assert_allclose(weights, A_CAUSAL, atol=1e-4)
    np.testing.assert_allclose(attention_weights(q, k, mask=mask)[0, 0], A_CAUSAL, atol=1e-4)
    out = _attend(impl, q, k, v, mask=mask)[0, :, 0]
    np.testing.assert_allclose(out, O_CAUSAL, atol=1e-4)


# --------------------------------------------------------------------------------------------
# The reference itself against an independent NumPy computation


def _numpy_attention(q, k, v, bias, mask, scale, softcap=None):
    """Loop-free NumPy attention with explicitly repeated kv heads (h reads kv head h // G)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + np.asarray(bias)
    mask = np.broadcast_to(np.asarray(mask), s.shape)
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhqk,bkhd->bqhd", p, v), p


def test_reference_matches_numpy_with_gqa_bias_mask_softcap():
    rng = np.random.default_rng(0)
    q, k, v = _normal(rng, (2, 5, 4, 3)), _normal(rng, (2, 6, 2, 3)), _normal(rng, (2, 6, 2, 3))
    bias = _normal(rng, (1, 4, 5, 6))
    mask = jnp.asarray(rng.random((2, 1, 5, 6)) < 0.7).at[1, 0, 2].set(False)  # one empty row
    expected, p = _numpy_attention(q, k, v, bias, mask, scale=0.3, softcap=2.0)
    got = dot_product_attention(q, k, v, bias=bias, mask=mask, scale=0.3, logit_softcap=2.0)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    weights = attention_weights(q, k, bias=bias, mask=mask, scale=0.3, logit_softcap=2.0)
    assert weights.shape == (2, 4, 5, 6) and weights.dtype == jnp.float32
    np.testing.assert_allclose(weights, p, atol=1e-6)
    np.testing.assert_array_equal(got[1, 2], 0.0)


# --------------------------------------------------------------------------------------------
# Parity of xla and chunked with the reference: forward and gradients

B, T, CHUNK = 2, 13, 4  # 13 is not a multiple of 4: padded queries and keys are exercised
HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}  # (H, N)
BIASES = ("none", "1HQK", "BHQK")


def _self_attention_mask(kind):
    """The masks of the parity tests on B=2 sequences of length 13, as AttentionMask."""
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    # Two packed rows: segments [0]*5 [1]*4 [2]*4 and [0]*6 [1]*4 + 3 padding slots.
    seg = jnp.array([[0] * 5 + [1] * 4 + [2] * 4, [0] * 6 + [1] * 4 + [-1] * 3])
    seg_pos = jnp.array([list(range(5)) + list(range(4)) * 2, list(range(6)) + list(range(7))])
    lengths = jnp.array([[T], [8]])
    valid = jnp.arange(T)[None] < lengths
    if kind == "none":
        return None
    if kind == "causal":
        return masks.build_mask("causal", pos, pos)
    if kind == "padding":
        return masks.build_mask("bidirectional", pos, pos, kv_valid=valid)
    if kind == "prefix":
        return masks.build_mask("prefix", pos, pos, prefix_len=jnp.array([4, 7]))
    if kind == "window":
        return masks.build_mask(mask_kinds.SlidingWindow(window=3), pos, pos)
    if kind == "segments":
        return masks.build_mask("bidirectional", seg_pos, seg_pos, q_segments=seg, kv_segments=seg)
    if kind == "causal_segments_padding":
        return masks.build_mask(
            "causal", seg_pos, seg_pos, q_segments=seg, kv_segments=seg, kv_valid=seg >= 0
        )
    raise ValueError(kind)


MASK_KINDS = (
    "none",
    "causal",
    "padding",
    "prefix",
    "window",
    "segments",
    "causal_segments_padding",
)


def _parity_cases():
    """Every mask kind, as an AttentionMask and as a dense array, for every implementation
    besides the oracle, bias and head layouts cycled so that each pairing of them appears."""
    cases = []
    for impl in CANDIDATES:
        combos = [
            (kind, form)
            for kind, form in itertools.product(MASK_KINDS, ("obj", "dense"))
            if not (kind == "none" and form == "dense")
        ]
        for i, (kind, form) in enumerate(combos):
            bias, heads = BIASES[i % 3], list(HEADS)[(i + i // 3) % 3]
            case_id = f"{impl}-{kind}-{form}-{bias}-{heads}"
            # the quick tier: every kind through the cheap kernels, and the chunked kernel's
            # hardest mask (causal, packed segments and padding)
            quick = impl != "chunked" or (kind, form) == ("causal_segments_padding", "obj")
            marks = () if quick else pytest.mark.slow
            cases.append(pytest.param(impl, kind, form, bias, heads, id=case_id, marks=marks))
    return cases


def _random_problem(seed, q_len, k_len, heads, bias_kind, d=8):
    h, n = HEADS[heads]
    rng = np.random.default_rng(seed)
    q = _normal(rng, (B, q_len, h, d))
    k, v = _normal(rng, (B, k_len, n, d)), _normal(rng, (B, k_len, n, d))
    bias = {"none": None, "1HQK": (1, h, q_len, k_len), "BHQK": (B, h, q_len, k_len)}[bias_kind]
    bias = None if bias is None else _normal(rng, bias)
    cotangent = _normal(rng, (B, q_len, h, d))
    return q, k, v, bias, cotangent


def _assert_parity(impl, q, k, v, bias, mask, cotangent, tol=TOL, **kw):
    ref_out, ref_grads = _outputs_and_grads("reference", q, k, v, bias, mask, cotangent, **kw)
    out, grads = _outputs_and_grads(impl, q, k, v, bias, mask, cotangent, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(out, ref_out, **tol)
    for name, g, ref_g, x in zip("qkvb", grads, ref_grads, (q, k, v, bias), strict=True):
        if x is None:
            continue
        assert g.shape == x.shape, name
        np.testing.assert_allclose(g, ref_g, err_msg=f"d{name}", **tol)
    return ref_out, ref_grads


@pytest.mark.parametrize("impl,kind,form,bias_kind,heads", _parity_cases())
def test_parity_self_attention(impl, kind, form, bias_kind, heads):
    q, k, v, bias, cotangent = _random_problem(1, T, T, heads, bias_kind)
    mask = _self_attention_mask(kind)
    if mask is not None and form == "dense":
        # The causal mask goes in as a plain [Q, K] array to cover broadcasting over B and H.
        mask = jnp.tril(jnp.ones((T, T), bool)) if kind == "causal" else mask.dense()
    ref_out, _ = _assert_parity(impl, q, k, v, bias, mask, cotangent, chunk_size=CHUNK)
    assert np.all(np.isfinite(ref_out))


@pytest.mark.parametrize("impl", _quick_unless_chunked(CANDIDATES))
@pytest.mark.parametrize("heads", list(HEADS))
def test_parity_cross_attention(impl, heads):
    """Q != K (5 queries over 11 keys, encoder-decoder style), key padding, no causality."""
    bias_kind = {"MHA": "BHQK", "GQA": "1HQK", "MQA": "none"}[heads]
    q, k, v, bias, cotangent = _random_problem(2, 5, 11, heads, bias_kind)
    q_pos, k_pos = (
        jnp.broadcast_to(jnp.arange(5), (B, 5)),
        jnp.broadcast_to(jnp.arange(11), (B, 11)),
    )
    mask = masks.build_mask(
        "bidirectional", q_pos, k_pos, kv_valid=jnp.arange(11)[None] < jnp.array([[11], [6]])
    )
    _assert_parity(impl, q, k, v, bias, mask, cotangent, chunk_size=CHUNK)


@pytest.mark.parametrize("impl", _quick_unless_chunked(CANDIDATES))
@pytest.mark.parametrize(
    "shape", [(4, T, T), (1, 4, 1, T), (T, T), (B, 1, T, T)], ids=["HQK", "1H1K", "QK", "B1QK"]
)
def test_parity_broadcast_bias(impl, shape):
    """Biases broadcast over some axes get gradients of their own shape (summed over the rest)."""
    q, k, v, _, cotangent = _random_problem(3, T, T, "GQA", "none")
    bias = _normal(np.random.default_rng(4), shape)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    _assert_parity(
        impl, q, k, v, bias, masks.build_mask("causal", pos, pos), cotangent, chunk_size=CHUNK
    )


@pytest.mark.slow
def test_chunked_decode_step_and_odd_chunks():
    """One query over a cache (Q=1), and a chunk size larger than the sequence."""
    q, k, v, bias, cotangent = _random_problem(5, 1, 9, "GQA", "1HQK")
    valid = jnp.arange(9)[None] < jnp.array([[9], [4]])
    mask = masks.build_mask(
        "bidirectional",
        jnp.full((B, 1), 8),
        jnp.broadcast_to(jnp.arange(9), (B, 9)),
        kv_valid=valid,
    )
    _assert_parity("chunked", q, k, v, bias, mask, cotangent, chunk_size=4)
    q, k, v, bias, cotangent = _random_problem(6, 7, 7, "MQA", "BHQK")
    _assert_parity("chunked", q, k, v, bias, None, cotangent, chunk_size=128)


@pytest.mark.slow
@settings(max_examples=examples(ci=3, thorough=5), deadline=None)
@given(
    q_len=st.integers(1, 12),
    k_len=st.integers(1, 12),
    chunk=st.integers(1, 6),
    causal=st.booleans(),
)
def test_chunked_any_lengths(q_len, k_len, chunk, causal):
    q, k, v, bias, _ = _random_problem(7, q_len, k_len, "GQA", "BHQK", d=4)
    q_pos = jnp.broadcast_to(jnp.arange(q_len) + k_len - q_len, (B, q_len))  # queries last
    mask = masks.build_mask(
        "causal" if causal else "bidirectional",
        q_pos,
        jnp.broadcast_to(jnp.arange(k_len), (B, k_len)),
    )
    ref = _attend("reference", q, k, v, bias=bias, mask=mask)
    got = _attend("chunked", q, k, v, bias=bias, mask=mask, chunk_size=chunk)
    np.testing.assert_allclose(got, ref, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("unroll_tiles", [0, 16])
def test_chunked_rolled_and_unrolled_tile_loops_agree(unroll_tiles):
    """The 16 tiles of a 13-token problem in 4-wide tiles (padding in the last ones), as
    lax loops (unroll_tiles=0) and unrolled (16), against the reference: packed causal rows
    with padding, a bias, grouped heads and a soft cap, outputs and gradients."""
    impl = ATTENTION.get("chunked")(chunk_size=CHUNK, unroll_tiles=unroll_tiles)
    q, k, v, bias, cotangent = _random_problem(9, T, T, "GQA", "BHQK")
    mask = _self_attention_mask("causal_segments_padding")
    ref = _outputs_and_grads("reference", q, k, v, bias, mask, cotangent, chunk_size=CHUNK,
                             logit_softcap=3.0)
    got = _jit_outputs_and_grads(impl, q, k, v, bias, mask, cotangent, chunk_size=None,
                                 logit_softcap=3.0)
    for name, g, r in zip(["out", "dq", "dk", "dv", "dbias"], [got[0], *got[1]],
                          [ref[0], *ref[1]], strict=True):
        np.testing.assert_allclose(g, r, err_msg=name, **TOL)
    lowered = jax.jit(lambda *a: dot_product_attention(
        *a, mask=mask, implementation=impl)).lower(q, k, v).as_text()
    assert ("stablehlo.while" in lowered) == (unroll_tiles == 0)  # unrolled: no loop left
    with pytest.raises(ConfigError, match="unroll_tiles=-1: must be >= 0"):
        ModelConfig(attention={"name": "chunked", "unroll_tiles": -1})


def _aligned_masks():
    """Every registered mask kind, with a small window where it takes one."""
    from transformers_jax.registry import MASKS

    return [pytest.param(kind(**mask_settings(name, window=5)), id=name)
            for name, kind in MASKS.items()]


@pytest.mark.slow
@pytest.mark.parametrize("kind", _aligned_masks())
@pytest.mark.parametrize("length", [13, 16])
def test_chunked_tiles_decided_ahead_match_the_reference(kind, length):
    """With aligned positions the unrolled kernel drops invisible tiles and the masking of fully
    visible ones at trace time. For every registered mask kind (a new one is covered once
    registered), 16 tokens (every tile decided ahead) and 13 (the padded last tiles stay
    checked at run time): outputs and gradients equal the reference's, with a bias and grouped
    heads, and with 16 tokens no run-time tile check (``conditional``) is left unless the kind
    depends on data (a prefix)."""
    impl = ATTENTION.get("chunked")(chunk_size=CHUNK, unroll_tiles=16)
    q, k, v, bias, cotangent = _random_problem(3, length, length, "GQA", "1HQK")
    pos = jnp.broadcast_to(jnp.arange(length), (B, length))
    prefix_len = jnp.array([4, 7]) if kind.needs_prefix_len else None
    mask = masks.build_mask(kind, pos, pos, prefix_len=prefix_len, aligned=True)
    ref = _outputs_and_grads("reference", q, k, v, bias, mask, cotangent, chunk_size=CHUNK)
    got = _jit_outputs_and_grads(impl, q, k, v, bias, mask, cotangent, chunk_size=None,
                                 logit_softcap=None)
    for name, g, r in zip(["out", "dq", "dk", "dv", "dbias"], [got[0], *got[1]],
                          [ref[0], *ref[1]], strict=True):
        np.testing.assert_allclose(g, r, err_msg=name, **TOL)
    if length == 16:
        hlo = _jit_outputs_and_grads.lower(impl, q, k, v, bias, mask, cotangent, chunk_size=None,
                                           logit_softcap=None).compile().as_text()
        assert (" conditional(" in hlo) == kind.needs_prefix_len


@pytest.mark.slow
def test_chunked_decides_causal_tiles_ahead_only_when_aligned():
    """The same causal problem with the positions given (as a packed batch gives them) keeps a
    run-time check per tile; made by the model (aligned) it has none, and the 6 tiles above
    the diagonal of a 4 x 4 grid are gone from the program: fewer tile products."""
    impl = ATTENTION.get("chunked")(chunk_size=CHUNK, unroll_tiles=16)
    q, k, v, _, _ = _random_problem(5, 16, 16, "MHA", "none")
    pos = jnp.broadcast_to(jnp.arange(16), (B, 16))

    def compiled(aligned):
        mask = masks.build_mask("causal", pos, pos, aligned=aligned)
        return jax.jit(lambda *a: dot_product_attention(*a, mask=mask, implementation=impl)
                       ).lower(q, k, v).compile().as_text()

    given, aligned = compiled(False), compiled(True)
    assert given.count(" conditional(") == 16 and " conditional(" not in aligned
    # two tile products (scores, then weights x values) per computed tile: 16 -> 10 tiles
    assert given.count(" dot(") - aligned.count(" dot(") == 2 * 6


# --------------------------------------------------------------------------------------------
# Soft-capping


@pytest.mark.slow
def test_softcap_chunked_matches_reference():
    q, k, v, bias, cotangent = _random_problem(8, T, T, "GQA", "BHQK")
    q = q * 4.0  # large scores, so the cap is far from the identity
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    mask = masks.build_mask("causal", pos, pos)
    ref_out, _ = _assert_parity(
        "chunked", q, k, v, bias, mask, cotangent, chunk_size=CHUNK, logit_softcap=2.0
    )
    uncapped = dot_product_attention(q, k, v, bias=bias, mask=mask)
    assert np.abs(ref_out - uncapped).max() > 0.1  # the cap really changed the result


@pytest.mark.parametrize("impl", ["xla", "cudnn"])
def test_jax_nn_paths_refuse_softcap(impl):
    q, k, v, _, _ = _random_problem(9, 3, 3, "MHA", "none")
    with pytest.raises(ValueError, match="cannot apply logit_softcap; use 'chunked'"):
        dot_product_attention(q, k, v, implementation=impl, logit_softcap=50.0)


@pytest.mark.parametrize("window", [None, 1, 3, 8])
@pytest.mark.parametrize("heads", ["MHA", "GQA"])
def test_cudnn_masks_by_index_as_the_positions_rule(window, heads):
    """cuDNN gets a causal (or causal sliding-window) rule as is_causal/local_window_size, not
    as a dense mask; jax.nn's xla path takes the same arguments, so check them here."""
    from transformers_jax.nn.attention.jax_nn import index_rule

    q, k, v, _, _ = _random_problem(12, 8, 8, heads, "none")
    pos = jnp.broadcast_to(jnp.arange(8), (B, 8))
    kind = "causal" if window is None else mask_kinds.SlidingWindow(window=window)
    mask = masks.build_mask(kind, pos, pos, aligned=True)
    assert index_rule(mask, 8, 8) == {
        "is_causal": True, "local_window_size": None if window is None else (window - 1, 0)}
    got = jax.nn.dot_product_attention(q, k, v, implementation="xla", **index_rule(mask, 8, 8))
    ref = dot_product_attention(q, k, v, mask=mask, implementation="reference")
    np.testing.assert_allclose(got, ref, **TOL)


def test_cudnn_keeps_a_dense_mask_where_the_rule_is_not_by_index():
    from transformers_jax.nn.attention.jax_nn import index_rule

    pos = jnp.broadcast_to(jnp.arange(6), (B, 6))
    seg = jnp.ones((B, 6), jnp.int32).at[:, 3:].set(2)
    packed = masks.build_mask("causal", pos, pos, q_segments=seg, kv_segments=seg, aligned=True)
    given_positions = masks.build_mask("causal", pos, pos)
    padded = masks.build_mask("causal", pos, pos, kv_valid=pos < 4, aligned=True)
    prefix = masks.build_mask("prefix", pos, pos, prefix_len=jnp.full((B,), 2), aligned=True)
    cached = masks.build_mask("causal", pos[:, :1], pos, aligned=True)
    for mask, q_len in [(packed, 6), (given_positions, 6), (padded, 6), (prefix, 6),
                        (masks.build_mask("bidirectional", pos, pos, aligned=True), 6),
                        (cached, 1)]:
        assert index_rule(mask, q_len, 6) is None


# --------------------------------------------------------------------------------------------
# Fully masked rows: zeros, never NaN, in the output and in every gradient


@pytest.mark.parametrize("impl", _quick_unless_chunked(CPU_IMPLEMENTATIONS))
@pytest.mark.parametrize("as_object", [True, False], ids=["AttentionMask", "dense"])
def test_fully_masked_rows_are_zero(impl, as_object):
    q, k, v, bias, cotangent = _random_problem(10, 6, 6, "GQA", "BHQK")
    # Query 0 of every sequence has segment 9, which no key has; sequence 1 has no valid key.
    pos = jnp.broadcast_to(jnp.arange(6), (B, 6))
    q_seg = jnp.zeros((B, 6), jnp.int32).at[:, 0].set(9)
    mask = masks.build_mask(
        "bidirectional",
        pos,
        pos,
        q_segments=q_seg,
        kv_segments=jnp.zeros((B, 6), jnp.int32),
        kv_valid=jnp.array([[True] * 6, [False] * 6]),
    )
    mask = mask if as_object else mask.dense()
    out, grads = _outputs_and_grads(impl, q, k, v, bias, mask, cotangent, chunk_size=4)
    np.testing.assert_array_equal(out[:, 0], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    assert np.all(np.abs(out[0, 1:]) > 0)  # the other rows of sequence 0 are real outputs
    for g in grads:
        assert np.all(np.isfinite(g))
    dq, dk, dv, d_bias = grads
    np.testing.assert_array_equal(dq[:, 0], 0.0)
    np.testing.assert_array_equal(dq[1], 0.0)
    np.testing.assert_array_equal(dk[1], 0.0)
    np.testing.assert_array_equal(dv[1], 0.0)
    np.testing.assert_array_equal(d_bias[:, :, 0], 0.0)


# --------------------------------------------------------------------------------------------
# Dtypes, errors, grouping convention


@pytest.mark.parametrize("impl", _quick_unless_chunked(CPU_IMPLEMENTATIONS))
def test_bfloat16_inputs(impl):
    q, k, v, bias, cotangent = _random_problem(11, 9, 9, "GQA", "1HQK")
    pos = jnp.broadcast_to(jnp.arange(9), (B, 9))
    mask = masks.build_mask("causal", pos, pos)
    expected, expected_grads = _outputs_and_grads(
        "reference", q, k, v, bias, mask, cotangent, chunk_size=4
    )
    lo = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out, grads = _outputs_and_grads(impl, *lo, bias, mask, cotangent, chunk_size=4)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), expected, atol=3e-2, rtol=3e-2)
    for g, x, ref_g in zip(grads, (*lo, bias), expected_grads, strict=True):
        assert g.dtype == x.dtype
        np.testing.assert_allclose(g.astype(jnp.float32), ref_g, atol=6e-2, rtol=6e-2)


def test_unknown_implementation_lists_valid_names():
    q, k, v, _, _ = _random_problem(12, 3, 3, "MHA", "none")
    valid = "valid choices: chunked, cudnn, pallas, reference, splash, xla"
    with pytest.raises(UnknownNameError, match=valid):
        dot_product_attention(q, k, v, implementation="flash3000")
    assert ATTENTION.names() == ["chunked", "cudnn", "pallas", "reference", "splash", "xla"]


def test_one_oracle_that_supports_everything():
    """Benchmarks leave the oracle out of speed comparisons by its ``oracle`` flag, and the
    parity tests compare every kernel with it: it must be the reference, on every backend, with
    every feature."""
    oracles = [name for name in ATTENTION.names() if ATTENTION.get(name).oracle]
    assert oracles == ["reference"]
    oracle = ATTENTION.get("reference")
    assert oracle.softcap and oracle.dense_masks and set(oracle.backends) == {"cpu", "gpu", "tpu"}


@pytest.mark.parametrize("heads", ["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_attend_to_cache_matches_the_reference_on_a_heads_first_cache(heads, softcap):
    # A decoding step: one query per row against S cached keys stored [B, N, S, D]; per-row
    # valid slots (row 1 sees none: its output must be zeros, not NaN) and a per-head bias.
    S = 7
    q, k, v, bias, _ = _random_problem(21, 1, S, heads, "BHQK")
    valid = jnp.array([[True, False, True, True, False, True, True], [False] * S])[:B]
    mask = valid[:, None, None, :]
    expected = dot_product_attention(q, k, v, bias=bias, mask=mask, logit_softcap=softcap)
    got = attend_to_cache(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), bias=bias,
                          mask=mask, logit_softcap=softcap)
    np.testing.assert_allclose(got, expected, **TOL)
    if B > 1:
        assert float(jnp.abs(got[1]).max()) == 0.0
    # The step's own key/value passed beside the cache act as key number S (read-first order).
    k_hf, v_hf = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    split = attend_to_cache(q, k_hf[:, :, :-1], v_hf[:, :, :-1], k_new=k_hf[:, :, -1:],
                            v_new=v_hf[:, :, -1:], bias=bias, mask=mask, logit_softcap=softcap)
    np.testing.assert_allclose(split, expected, **TOL)
    with pytest.raises(ValueError, match=r"k, v \[B, N, S, D\]"):
        attend_to_cache(q, k, v)  # sequence-first keys are refused, not misread


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN is available on GPU")
def test_cudnn_needs_a_gpu():
    q, k, v, _, _ = _random_problem(13, 3, 3, "MHA", "none")
    msg = r"'cudnn' needs an NVIDIA GPU \(jax backend is 'cpu'\); use xla, chunked or reference"
    with pytest.raises(RuntimeError, match=msg):
        dot_product_attention(q, k, v, implementation="cudnn")


@pytest.mark.skipif(jax.default_backend() in ("gpu", "tpu"), reason="Pallas runs there")
def test_pallas_needs_a_tpu_or_gpu():
    q, k, v, _, _ = _random_problem(15, 3, 3, "MHA", "none")
    msg = r"'pallas' needs a TPU .* jax backend is 'cpu': use chunked"
    with pytest.raises(RuntimeError, match=msg):
        dot_product_attention(q, k, v, implementation="pallas")


def test_bad_inputs_are_explained():
    q, k, v, _, _ = _random_problem(14, 3, 3, "MHA", "none")
    with pytest.raises(TypeError, match="mask must be boolean"):
        dot_product_attention(q, k, v, mask=jnp.zeros((3, 3)))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        dot_product_attention(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="does not broadcast"):
        dot_product_attention(q, k, v, bias=jnp.zeros((3, 3, 3)))
    pos = jnp.arange(4)[None]
    with pytest.raises(ValueError, match="AttentionMask covers batch 1, 4 queries and 4 keys"):
        dot_product_attention(q, k, v, mask=masks.build_mask("causal", pos, pos))
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        dot_product_attention(q, k, v, implementation="chunked", chunk_size=0)


@pytest.mark.slow
def test_query_head_h_reads_kv_head_h_over_g():
    """GQA equals MHA with each kv head repeated for its G consecutive query heads."""
    q, k, v, _, _ = _random_problem(15, 5, 5, "GQA", "none")  # H=4, N=2: heads 0,1 -> kv 0
    out = dot_product_attention(q, k, v)
    expected = dot_product_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2))
    np.testing.assert_allclose(out, expected, **TOL)
    np.testing.assert_allclose(
        out[:, :, :2], dot_product_attention(q[:, :, :2], k[:, :, :1], v[:, :, :1]), **TOL
    )


# --------------------------------------------------------------------------------------------
# The chunked kernel: memory, jit, determinism


def _compiled_temp_bytes(impl, length):
    spec = jax.ShapeDtypeStruct((1, length, 1, 16), jnp.float32)
    pos = jax.ShapeDtypeStruct((1, length), jnp.int32)

    def loss(q, k, v, pos):
        mask = masks.build_mask("causal", pos, pos)
        out = dot_product_attention(q, k, v, mask=mask, implementation=impl, chunk_size=128)
        return jnp.sum(out**2)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec, pos).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip("this backend reports no memory analysis")
    return analysis.temp_size_in_bytes


@pytest.mark.slow
def test_chunked_memory_is_linear_in_length():
    length = 2048
    score_bytes = 4 * length * length  # one float32 [Q, K] array: 16 MiB
    # The reference does keep [Q, K] scores (this is what the check can detect) ...
    assert _compiled_temp_bytes("reference", length) >= score_bytes
    # ... the chunked forward + backward keeps tiles and O(Q + K) vectors only (~1 MiB).
    assert _compiled_temp_bytes("chunked", length) < score_bytes / 8


@pytest.mark.slow
def test_chunked_jit_and_deterministic():
    """Jitted twice: bitwise the same output and gradients (of q, k, v and a bias summed over
    the batch); eager agrees. The gradient program is the causal GQA parity case's (the same
    shapes and settings), compiled once for both."""
    q, k, v, bias, cotangent = _random_problem(16, T, T, "GQA", "1HQK")
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    mask = masks.build_mask("causal", pos, pos)

    def f(q, k, v, bias, mask):
        return dot_product_attention(
            q, k, v, bias=bias, mask=mask, implementation="chunked", chunk_size=CHUNK
        )

    def jitted(*a):
        return _attend("chunked", *a[:3], bias=a[3], mask=a[4], chunk_size=CHUNK)

    first, second = jitted(q, k, v, bias, mask), jitted(q, k, v, bias, mask)
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, f(q, k, v, bias, mask), **TOL)  # eager agrees

    def grad():
        return _outputs_and_grads("chunked", q, k, v, bias, mask, cotangent, chunk_size=CHUNK)

    (out1, grads1), (out2, grads2) = grad(), grad()
    np.testing.assert_array_equal(out1, out2)
    for g1, g2 in zip(grads1, grads2, strict=True):
        np.testing.assert_array_equal(g1, g2)


@pytest.mark.slow
def test_chunked_gradient_inside_shard_map_matches_one_device():
    """Under shard_map (check_vma) a skipped tile's zeros must vary like a computed tile's
    values: the chunked kernel's cond and scans once failed to trace there."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from transformers_jax.nn.masks import AttentionMask

    def loss(q):
        pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
        mask = AttentionMask(q_positions=pos, kv_positions=pos, causal=True)
        out = dot_product_attention(q, q, q, mask=mask, implementation="chunked", chunk_size=16)
        return (out * out).sum()

    q = jax.random.normal(jax.random.key(0), (4, 64, 2, 8))
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:4])
    sharded = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    one_device = jax.jit(jax.grad(loss))(q)  # 4x cheaper than eager
    np.testing.assert_allclose(jax.jit(sharded)(q), one_device,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", [
    *(pytest.param(spec, marks=pytest.mark.slow) for spec in [
        "bngqd,bnkd->bngqk", "bngqk,bnkd->bngqd", "bnkd,bngqd->bnkgq", "bnkgq,bngqd->bnkd",
        "bndk,bnkgq->bndgq", "jbngqd,jbngqd->jbngq"]),
    "bqd,bkd->bkq",  # an output order that needs a transpose after the product
])
def test_the_tile_contraction_is_einsum(spec):
    """The chunked kernel's ``contract`` (one ``dot_general``, planned once per spec) gives
    ``jnp.einsum``'s numbers and dtype, with and without a float32 accumulation type and for
    mixed input dtypes."""
    from transformers_jax.nn.attention.chunked import contract

    sizes = dict(zip("bngqkdj", (2, 3, 2, 5, 4, 3, 2), strict=True))
    left, right = spec.split("->")[0].split(",")
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, [sizes[c] for c in left])
    b = jax.random.normal(kb, [sizes[c] for c in right])
    for a_, b_, accumulate in [(a, b, None), (a, b.astype(jnp.bfloat16), jnp.float32),
                               (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), None)]:
        got = contract(spec, a_, b_, preferred_element_type=accumulate)
        want = jnp.einsum(spec, a_, b_, preferred_element_type=accumulate)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="two-operand einsums"):
        contract("ii,ij->j", jnp.ones((2, 2)), jnp.ones((2, 3)))


def test_chunked_run_op_by_op_decides_data_dependent_tiles_without_compiling(caplog):
    """Run outside jit (a notebook's op-by-op call), a tile whose visibility is known only
    from the data is decided there and then: the reference's outputs, the invisible tiles
    skipped, and a second call compiles nothing (a ``lax.cond`` built afresh each call was a
    new program each time: 458 compiles in one test file)."""
    import logging

    impl = ATTENTION.get("chunked")(chunk_size=CHUNK, unroll_tiles=16)
    q, k, v, _, _ = _random_problem(6, 16, 16, "GQA", "none")
    pos = jnp.broadcast_to(jnp.arange(16), (B, 16))
    mask = masks.build_mask("causal", pos, pos, aligned=False)  # every tile checked at run time
    want = dot_product_attention(q, k, v, mask=mask, implementation="reference")
    np.testing.assert_allclose(dot_product_attention(q, k, v, mask=mask, implementation=impl),
                               want, **TOL)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        again = dot_product_attention(q, k, v, mask=mask, implementation=impl)
    assert not [r for r in caplog.records if r.getMessage().startswith("Compiling")]
    np.testing.assert_allclose(again, want, **TOL)
