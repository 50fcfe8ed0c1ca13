"""The GPT model: every switch combination runs, and the properties in REFERENCES.md hold."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import POSITIONS, attention, init, tiny

from transformers_jax import ModelConfig, Rope
from transformers_jax.config import ConfigError
from transformers_jax.nn.layers import Attention
from transformers_jax.registry import NORM_PLACEMENTS


@functools.cache
def scheme(position: str):
    """``init(tiny(position=position))``, built once for the per-scheme tests below."""
    return init(tiny(position=position))


@pytest.mark.parametrize("position", POSITIONS)
def test_forward_shape_finite_deterministic(position):
    model, params, tokens = scheme(position)
    logits = model.apply({"params": params}, tokens)
    assert logits.shape == (2, 12, 32) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_array_equal(logits, model.apply({"params": params}, tokens))


# one residual branch, x + f(norm(x)) or norm(x + f(x)), worked by hand for x = (3, -1),
# f(h) = 2h and norm(h) = h / max|h|
RESIDUAL_BY_HAND = {"pre": [5.0, -5.0 / 3.0], "post": [1.0, -1.0 / 3.0]}


@pytest.mark.parametrize("placement", NORM_PLACEMENTS.names())
def test_norm_placement_hooks(placement):
    entry = NORM_PLACEMENTS.get(placement)()
    x = jnp.array([3.0, -1.0])
    out = entry.residual(x, lambda h: 2 * h, lambda h: h / jnp.abs(h).max(), lambda h: h)
    if placement in RESIDUAL_BY_HAND:
        np.testing.assert_allclose(out, RESIDUAL_BY_HAND[placement], rtol=1e-6)
    model, params, tokens = init(tiny(norm_position=placement))
    names = {"/".join(str(getattr(k, "key", k)) for k in path)
             for path, _ in jax.tree_util.tree_leaves_with_path(params)}
    assert any("final_norm" in n for n in names) == entry.final_norm
    assert np.isfinite(np.asarray(model.apply({"params": params}, tokens))).all()


def embedding_jacobians(model, params, tokens, queries):
    """For each position in ``queries``: d(sum of its logits) / d(embedded input),
    ``[B, T, C]``. One forward pass, a backward pass per query."""
    perturbations = model.init(jax.random.key(0), tokens)["perturbations"]

    def out(perturbations):
        return model.apply({"params": params, "perturbations": perturbations}, tokens)

    logits, pullback = jax.vjp(out, perturbations)
    for query in queries:
        yield pullback(jnp.zeros_like(logits).at[:, query].set(1.0))[0]["embeddings"]


def embedding_jacobian(model, params, tokens, query: int):
    """d(sum of logits at position ``query``) / d(embedded input), ``[B, T, C]``."""
    return next(embedding_jacobians(model, params, tokens, (query,)))


@pytest.mark.parametrize("position", POSITIONS)
def test_causal_no_leak_by_gradient(position):
    model, params, tokens = scheme(position)
    queries = (0, 5, 11)
    for query, grad in zip(queries, embedding_jacobians(model, params, tokens, queries),
                           strict=True):
        grad = np.asarray(grad)
        assert np.all(grad[:, query + 1 :] == 0.0), "a future token reached the output"
        assert np.abs(grad[:, : query + 1]).sum() > 0, "the past should matter"


def test_sliding_window_no_leak_from_far_past():
    model, params, tokens = init(tiny(mask={"name": "sliding_window", "window": 3}, n_layers=1))
    grad = np.asarray(embedding_jacobian(model, params, tokens, 8))
    assert np.all(grad[:, :6] == 0.0) and np.all(grad[:, 9:] == 0.0)
    assert np.all(np.abs(grad[:, 6:9]).sum(-1) > 0)


def test_prefix_lm_sees_whole_prefix():
    model, params, tokens = init(tiny(mask="prefix"), prefix_len=jnp.array([4, 4]))
    variables = model.init(jax.random.key(0), tokens, prefix_len=jnp.array([4, 4]))

    def out(p):
        logits = model.apply(
            {"params": params, "perturbations": p}, tokens, prefix_len=jnp.array([4, 4])
        )
        return logits[:, 1].sum()

    grad = np.asarray(jax.grad(out)(variables["perturbations"])["embeddings"])
    assert np.all(np.abs(grad[:, :4]).sum(-1) > 0)  # bidirectional inside the prefix
    assert np.all(grad[:, 4:] == 0.0)  # causal after it


def test_permutation_equivariance_without_positions():
    model, params, tokens = init(tiny(position="none", mask="bidirectional", init_std=0.2))
    perm = np.random.default_rng(0).permutation(tokens.shape[1])
    logits = model.apply({"params": params}, tokens)
    permuted = model.apply({"params": params}, tokens[:, perm])
    np.testing.assert_allclose(permuted, logits[:, perm], atol=1e-5)
    # ...and a position scheme breaks it, so the test can tell the difference.
    model, params, tokens = init(tiny(position="rope", mask="bidirectional", init_std=0.2))
    logits = model.apply({"params": params}, tokens)
    permuted = model.apply({"params": params}, tokens[:, perm])
    assert np.abs(np.asarray(permuted) - np.asarray(logits[:, perm])).max() > 1e-2


# t5 in the quick tier: its learned bias's gradient is the extra path the kernels must get
# right; every scheme in the full run
@pytest.mark.parametrize("position", [p if p == "t5" else pytest.param(p, marks=pytest.mark.slow)
                                      for p in POSITIONS])
def test_every_attention_implementation_gives_the_same_model(position):
    results = {}
    for impl in ("reference", "xla", "chunked"):
        cfg = tiny(position=position, attention=attention(impl), n_kv_heads=2)
        model, params, tokens = init(cfg)

        def loss(p, model=model, tokens=tokens):
            return (model.apply({"params": p}, tokens) ** 2).mean()

        results[impl] = (model.apply({"params": params}, tokens), jax.grad(loss)(params))
    ref_logits, ref_grads = results["reference"]
    for impl in ("xla", "chunked"):
        logits, grads = results[impl]
        np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4),
                     grads, ref_grads)


def test_attention_layer_reproduces_the_three_token_example():
    """REFERENCES.md section 1 with the weights loaded into the real layer."""
    cfg = ModelConfig(vocab_size=4, d_model=2, n_heads=1, n_layers=1, position="none",
                      mask="bidirectional", use_bias=False, attention="reference")
    X = jnp.array([[[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]])
    W_Q = jnp.array([[1.0, 0.0], [1.0, 1.0]])
    W_V = jnp.array([[2.0, 0.0], [0.0, 1.0]])
    params = {
        "query": {"kernel": W_Q[:, None, :]},
        "key": {"kernel": jnp.eye(2)[:, None, :]},
        "value": {"kernel": W_V[:, None, :]},
        "out": {"kernel": jnp.eye(2)[None, :, :]},
    }
    pos = jnp.arange(3)[None]
    out, _ = Attention(cfg).apply({"params": params}, X, positions=pos, mask=None)
    O = np.array([[1.6044, 0.7967], [1.1084, 1.3374], [1.5035, 1.0000]])
    np.testing.assert_allclose(out[0], O, atol=1e-4)
    causal = jnp.tril(jnp.ones((3, 3), bool))[None, None]
    out, _ = Attention(cfg).apply({"params": params}, X, positions=pos, mask=causal)
    np.testing.assert_allclose(out[0, 0], [2.0, 0.0], atol=1e-4)  # row 1 sees only itself
    a = np.array([0.1956, 0.8044])
    np.testing.assert_allclose(out[0, 1], a @ np.array([[2.0, 0.0], [0.0, 2.0]]), atol=1e-3)


@pytest.mark.slow
def test_learned_table_rejects_longer_input():
    model, params, _ = init(tiny(position="learned", max_len=8), T=8)
    with pytest.raises(ValueError, match="longer than position=learned allows"):
        model.apply({"params": params}, jnp.zeros((1, 9), jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [
        dict(n_kv_heads=1),
        dict(n_kv_heads=2, mlp="swiglu", norm="rmsnorm", use_bias=False, tie_embeddings=False),
        dict(norm_position="post", mlp="relu"),
        dict(qk_norm=True, attention="chunked", attn_logit_softcap=5.0, final_logit_softcap=3.0),
        dict(position=Rope(pairing="interleaved", fraction=0.5, scaling={
            "name": "yarn", "factor": 4.0, "original_max_len": 8})),
        dict(head_dim=16),
        dict(dtype="bfloat16"),
    ],
)
def test_block_options(changes):
    cfg = tiny(**changes)
    model, params, tokens = init(cfg)
    logits = model.apply({"params": params}, tokens)
    assert np.isfinite(np.asarray(logits)).all()
    if cfg.final_logit_softcap:
        assert np.abs(np.asarray(logits)).max() <= cfg.final_logit_softcap
    if cfg.n_kv_heads:
        assert params["layer_0"]["attention"]["key"]["kernel"].shape == (
            32, cfg.n_kv_heads, cfg.dims_per_head)


def test_dropout_only_when_not_deterministic():
    model, params, tokens = init(tiny(dropout=0.5))
    a = model.apply({"params": params}, tokens)
    b = model.apply({"params": params}, tokens, deterministic=False,
                    rngs={"dropout": jax.random.key(1)})
    c = model.apply({"params": params}, tokens, deterministic=False,
                    rngs={"dropout": jax.random.key(1)})
    assert np.abs(np.asarray(a - b)).max() > 1e-3
    np.testing.assert_array_equal(b, c)


def test_t5_bias_is_shared_across_layers():
    _, params, _ = init(tiny(position="t5", n_layers=3))
    assert "relative_bias" in params
    assert all("relative_bias" not in params[f"layer_{i}"] for i in range(3))


def _sinusoidal_parts(position):
    """(token embedding as the table stores it, the embedder's output) for a sinusoidal config."""
    from transformers_jax.models.gpt import Embedder

    cfg = tiny(position=position, d_model=64, init_std=0.05, max_len=512)
    embedder = Embedder(cfg)
    tokens = jax.random.randint(jax.random.key(1), (1, 512), 0, cfg.vocab_size)
    positions = jnp.arange(512, dtype=jnp.int32)[None]
    variables = embedder.init(jax.random.key(0), tokens, positions)
    token_part = embedder.apply(variables, tokens, method=lambda m, t: m.tokens(t))
    return token_part, embedder.apply(variables, tokens, positions), positions


def test_sinusoidal_rms_form_matches_the_token_embedding_scale():
    # form="rms": each component of the added table has RMS init_std, like the token
    # embeddings, and the tokens are not scaled
    token_part, out, _ = _sinusoidal_parts({"name": "sinusoidal", "form": "rms"})
    table = out - token_part
    rms = float(jnp.sqrt(jnp.mean(table**2)))
    assert abs(rms - 0.05) < 0.005, rms
    np.testing.assert_allclose(table[0, 0, 1::2], 0.05 * np.sqrt(2), rtol=1e-5)  # cos(0)


def test_sinusoidal_default_is_the_original_transformers_form():
    # Vaswani et al. 3.4: embeddings times sqrt(d_model), plus the table at amplitude 1
    from transformers_jax.nn.positions import sinusoidal_embedding

    token_part, out, positions = _sinusoidal_parts("sinusoidal")
    want = 8.0 * token_part + sinusoidal_embedding(positions, 64)  # sqrt(64) = 8
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose((out - 8.0 * token_part)[0, 0, 1::2], 1.0, rtol=1e-5)  # cos(0)
    with pytest.raises(ConfigError, match="position.form"):
        tiny(position={"name": "sinusoidal", "form": "bert"})
