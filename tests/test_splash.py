"""``splash`` (JAX's Pallas TPU splash attention) run by the Pallas interpreter on the CPU:
outputs and gradients equal the reference kernel's for every mask kind the compatibility table
says it trains, with and without packed segments, for MHA, GQA and MQA, with soft-capping, key
padding and a mesh that splits rows and heads; what the table refuses is refused.

Shape legend: B batch, Q/K lengths, H query heads, N key/value heads, D head dim. Lengths are
256 with 128-wide blocks, so every mask crosses block edges (the kernel skips hidden blocks).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import tiny

from transformers_jax import compatibility
from transformers_jax.nn import masks
from transformers_jax.nn.attention import ATTENTION, dot_product_attention
from transformers_jax.registry import MASKS, POSITIONS, ConfigError

SPLASH = ATTENTION.get("splash")(block=128, interpret=True)
B, T, H, D = 2, 256, 4, 32
WINDOW = 100  # reaches into the previous 128-block, not past it
HEADS = {"MHA": 4, "GQA": 2, "MQA": 1}
TOL = {"atol": 2e-5, "rtol": 2e-5}


def _problem(seed: int, n: int, q_len: int = T, k_len: int = T):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, q_len, H, D))
    k = jax.random.normal(keys[1], (B, k_len, n, D))
    v = jax.random.normal(keys[2], (B, k_len, n, D))
    return q, k, v, jax.random.normal(keys[3], (B, q_len, H, D))


def _packed():
    """Segment ids and positions restarting in each: row 0 three documents (one spans a block
    edge), row 1 one document."""
    lengths = [[100, 60, 96], [256]]
    seg = np.concatenate([np.repeat(np.arange(1, len(r) + 1), r) for r in lengths]).reshape(B, T)
    pos = np.concatenate([np.arange(n) for r in lengths for n in r]).reshape(B, T)
    return jnp.asarray(seg, jnp.int32), jnp.asarray(pos, jnp.int32)


def _mask(kind: str, segments: bool) -> masks.AttentionMask:
    settings = {"window": WINDOW} if kind == "sliding_window" else {}
    prefix = jnp.array([40, 200], jnp.int32) if MASKS.get(kind).needs_prefix_len else None
    if not segments:
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return masks.build_mask(MASKS.get(kind)(**settings), pos, pos, prefix_len=prefix,
                                aligned=True)
    seg, pos = _packed()
    return masks.build_mask(MASKS.get(kind)(**settings), pos, pos, prefix_len=prefix,
                            q_segments=seg, kv_segments=seg)


@functools.partial(jax.jit, static_argnames=("impl", "logit_softcap"))
def _outputs_and_grads(impl, q, k, v, mask, cotangent, logit_softcap=None):
    def loss(q, k, v):
        out = dot_product_attention(q, k, v, mask=mask, implementation=impl,
                                    logit_softcap=logit_softcap)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def _assert_matches_reference(q, k, v, mask, cotangent, logit_softcap=None):
    want, want_grads = _outputs_and_grads("reference", q, k, v, mask, cotangent, logit_softcap)
    got, grads = _outputs_and_grads(SPLASH, q, k, v, mask, cotangent, logit_softcap)
    np.testing.assert_allclose(got, want, **TOL)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("segments", [False, True], ids=["whole", "packed"])
@pytest.mark.parametrize("kind", MASKS.names())
def test_masks_the_table_supports_match_the_reference_and_the_rest_are_refused(kind, segments):
    supported = compatibility.support("rope", "splash", kind).ok("train")
    q, k, v, cotangent = _problem(0, HEADS["GQA"])
    mask = _mask(kind, segments)
    if supported:
        _assert_matches_reference(q, k, v, mask, cotangent)
        return
    with pytest.raises(ConfigError, match="use attention=chunked"):
        tiny(attention="splash", mask=kind)
    with pytest.raises(ValueError, match="'splash' cannot apply a prefix-LM mask.*use chunked"):
        dot_product_attention(q, k, v, mask=mask, implementation=SPLASH)


@pytest.mark.slow
@pytest.mark.parametrize("heads", ["MHA", "MQA"])
def test_head_layouts_and_softcap_match_the_reference(heads):
    """GQA is in the mask test; MHA and MQA (its own kernel) here, soft-capped."""
    q, k, v, cotangent = _problem(1, HEADS[heads])
    _assert_matches_reference(q, k, v, _mask("causal", True), cotangent, logit_softcap=2.0)


@pytest.mark.slow
def test_key_padding_with_more_keys_than_queries():
    """Cross-attention shaped: 256 queries over 384 keys, the last keys of each row padding
    (a segment no query has); no causality, so the lengths may differ."""
    q, k, v, cotangent = _problem(2, HEADS["GQA"], k_len=384)
    valid = jnp.arange(384)[None, :] < jnp.array([[300], [129]])
    mask = masks.AttentionMask(jnp.broadcast_to(jnp.arange(T), (B, T)),
                               jnp.broadcast_to(jnp.arange(384), (B, 384)), kv_valid=valid)
    _assert_matches_reference(q, k, v, mask, cotangent)


@pytest.mark.slow
def test_rows_and_heads_split_over_a_mesh_match_the_reference():
    """Under a data=2 x tensor=2 mesh with the logical rules the jit strategy sets, the kernel
    runs per shard: two query heads with their one key/value head on each device."""
    from transformers_jax.parallel import LOGICAL_RULES, make_mesh

    q, k, v, cotangent = _problem(3, HEADS["GQA"])
    mask = _mask("sliding_window", True)
    want = _outputs_and_grads("reference", q, k, v, mask, cotangent)
    mesh = make_mesh("data=2,tensor=2", devices=jax.devices()[:4])
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):
        got = jax.jit(_outputs_and_grads.__wrapped__, static_argnames=("impl",))(
            SPLASH, q, k, v, mask, cotangent)
        assert "shard_map" in str(jax.make_jaxpr(
            lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation=SPLASH))(
                q, k, v))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_biases_are_refused_when_configured_with_the_kernels_that_take_them():
    biased = [p for p in POSITIONS.names() if POSITIONS.get(p)().adds_bias]
    assert {"alibi", "t5", "fire", "kerple"} <= set(biased)
    for position in POSITIONS.names():
        cell = compatibility.support(position, "splash", "causal")
        assert cell.ok("train") == (position not in biased), position
    with pytest.raises(ConfigError, match="no additive bias.*use attention=chunked.*pallas"):
        tiny(attention="splash", position="alibi")
    q, k, v, _ = _problem(4, HEADS["GQA"])
    with pytest.raises(ValueError, match="takes no additive bias"):
        dot_product_attention(q, k, v, bias=jnp.zeros((H, T, T)), implementation=SPLASH)


def test_what_splash_cannot_do_is_explained():
    q, k, v, _ = _problem(5, HEADS["GQA"])
    with pytest.raises(RuntimeError, match="'splash' needs a TPU .* use chunked"):
        dot_product_attention(q, k, v, implementation="splash")
    with pytest.raises(ValueError, match="not a dense boolean mask"):
        dot_product_attention(q, k, v, mask=jnp.ones((T, T), bool), implementation=SPLASH)
    with pytest.raises(ValueError, match="multiple of 128; got 200"):
        dot_product_attention(q[:, :200], k[:, :200], v[:, :200], implementation=SPLASH)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    with pytest.raises(ValueError, match="as many queries as keys.*decode with chunked"):
        dot_product_attention(q[:, :128], k, v, implementation=SPLASH,
                              mask=masks.build_mask("causal", pos[:, :128], pos))
    with pytest.raises(ConfigError, match="multiple of 128"):
        tiny(attention={"name": "splash", "block": 200})
    splash = compatibility.support("rope", "splash", "sliding_window")
    assert splash.ok("train") and splash.ok("context:ring")
    assert not splash.ok("decode") and not splash.ok("context:all_gather")


def test_a_model_with_splash_gives_the_reference_logits():
    """Through the model (rope rotation, its scale, grouped heads, soft-cap, packed documents):
    the entry's ``interpret`` setting runs the kernel here."""
    from model_helpers import init

    cfg = tiny(attention={"name": "splash", "block": 128, "interpret": True}, n_kv_heads=2,
               n_layers=1, max_len=256, attn_logit_softcap=5.0, init_std=0.3)
    seg, pos = _packed()
    inputs = {"segment_ids": seg, "positions": pos}
    model, params, tokens = init(cfg, T=T, B=B, **inputs)
    ref = init(cfg.replace(attention="reference"), T=T, B=B, **inputs)[0]
    got = model.apply({"params": params}, tokens, **inputs)
    want = ref.apply({"params": params}, tokens, **inputs)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
