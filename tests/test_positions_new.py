"""xpos, kerple and randomized positions against the papers' formulas (numpy, by hand), plus two
properties every registered scheme must have: deterministic forward passes and configs that
round-trip through JSON and the command line."""

import json
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import POSITIONS, init, tiny

from transformers_jax import ModelConfig, build_model
from transformers_jax.config import ConfigError, apply_overrides
from transformers_jax.nn.positions import apply_rope
from transformers_jax.nn.positions.kerple_bias import KerpleLogBias
from transformers_jax.nn.positions.randomized import sample_positions
from transformers_jax.nn.positions.xpos import XPos, xpos_zeta
from transformers_jax.registry import POSITIONS as POSITION_REGISTRY
from transformers_jax.registry import ROPE_SCALINGS


def head_config(head_dim, dtype="float32"):
    return types.SimpleNamespace(dims_per_head=head_dim, dtype=dtype)


# xPos ------------------------------------------------------------------------------------------


def test_xpos_zeta_matches_the_paper_and_torchscale():
    # (2i/R + 0.4)/1.4 for R = 8: hand values, and torchscale's (arange(0, R, 2) + 0.4R)/(1.4R)
    np.testing.assert_allclose(xpos_zeta(8, 0.4), [0.4 / 1.4, 0.65 / 1.4, 0.9 / 1.4, 1.15 / 1.4])
    np.testing.assert_allclose(xpos_zeta(64, 0.4), (np.arange(0, 64, 2) + 25.6) / 89.6)


def numpy_rope_pairs(x, pos, pairing, r, base=10000.0):
    """Independent float64 RoPE of one vector ``x [D]``: (rotated pairs [R/2, 2], pass dims)."""
    inv = 1.0 / base ** (np.arange(0, r, 2) / r)
    if pairing == "rotate_half":
        a, b = x[: r // 2], x[r // 2 : r]
    else:
        a, b = x[0:r:2], x[1:r:2]
    c, s = np.cos(pos * inv), np.sin(pos * inv)
    return np.stack([a * c - b * s, b * c + a * s], axis=-1), x[r:]


@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("n,m", [(700, 100), (3, 900), (37, 37), (0, 5000)])
def test_xpos_score_is_the_rope_score_times_the_decay_per_pair(pairing, fraction, n, m):
    """q_n . k_m = sum_i (rope dot of pair i) * zeta_i**((n - m)/512) + the unrotated dims."""
    D = 16
    xpos = XPos(pairing=pairing, fraction=fraction)
    r = int(D * fraction)
    rng = np.random.default_rng(n * 7919 + m)
    q, k = rng.normal(size=D), rng.normal(size=D)
    cfg = head_config(D)
    tq = xpos.rotate(cfg, jnp.asarray(q, jnp.float32)[None, None, None],
                     jnp.array([[n]]), "query")[0, 0, 0]
    tk = xpos.rotate(cfg, jnp.asarray(k, jnp.float32)[None, None, None],
                     jnp.array([[m]]), "key")[0, 0, 0]
    qp, q_pass = numpy_rope_pairs(q, n, pairing, r)
    kp, k_pass = numpy_rope_pairs(k, m, pairing, r)
    per_pair = (qp * kp).sum(-1) * xpos_zeta(r, 0.4) ** ((n - m) / 512.0)
    expected = per_pair.sum() + q_pass @ k_pass
    # float32 angles of ~5000 rad carry ~2e-4 rad of rounding (RoPE's, not xPos's): rtol 1e-4
    np.testing.assert_allclose(float(jnp.dot(tq, tk)), expected, rtol=1e-4, atol=1e-5)


def test_xpos_scales_queries_up_the_decay_and_keys_down_it():
    D, n = 8, 1024  # 1024/512 = 2: pair i of a query is scaled by zeta_i**2, of a key by zeta_i**-2
    x = jax.random.normal(jax.random.key(0), (1, 1, 1, D))
    pos = jnp.array([[n]])
    xpos, cfg = XPos(), head_config(D)
    rope = apply_rope(x, pos, xpos, D)
    zeta2 = np.tile(xpos_zeta(D, 0.4) ** 2, 2)  # rotate_half: pair i holds dims i and i + D/2
    np.testing.assert_allclose(xpos.rotate(cfg, x, pos, "query")[0, 0, 0], rope[0, 0, 0] * zeta2,
                               rtol=1e-5)
    np.testing.assert_allclose(xpos.rotate(cfg, x, pos, "key")[0, 0, 0], rope[0, 0, 0] / zeta2,
                               rtol=1e-5)
    with pytest.raises(ValueError, match="role"):
        xpos.rotate(cfg, x, pos, "value")


@pytest.mark.slow
def test_xpos_max_length_keeps_uncentred_scales_finite():
    # 512 * (128 - 8) * ln 2 / ln 3.5 = 33,994.9 in float32; (16 - 8) bits in float16: 2,266.3
    assert XPos().max_length(head_config(8)) == 33995
    assert XPos().max_length(head_config(8, "bfloat16")) == 33995
    assert XPos().max_length(head_config(8, "float16")) == 2267
    assert XPos(scale_base=256.0).max_length(head_config(8)) == 16998
    x = jnp.full((1, 1, 1, 8), 100.0)
    last = jnp.array([[33994]])
    for role in ("query", "key"):
        assert np.isfinite(np.asarray(XPos().rotate(head_config(8), x, last, role))).all()
    with pytest.raises(ValueError, match="longer than position=xpos"):
        model, params, _ = init(tiny(position="xpos"), T=4)
        model.apply({"params": params}, jnp.zeros((1, 33996), jnp.int32))


def test_xpos_config_checks():
    with pytest.raises(ConfigError, match="gamma"):
        tiny(position={"name": "xpos", "gamma": 0.0})
    with pytest.raises(ConfigError, match="scale_base"):
        tiny(position={"name": "xpos", "scale_base": -1.0})
    with pytest.raises(ConfigError, match="even"):  # inherited from rope: pairs of dims
        tiny(position="xpos", head_dim=7)


# KERPLE ----------------------------------------------------------------------------------------


def kerple_numpy(r1, r2, q_pos, k_pos, eps=0.01):
    r1, r2 = np.maximum(r1, eps), np.maximum(r2, eps)
    dist = np.abs(np.asarray(q_pos)[:, :, None] - np.asarray(k_pos)[:, None, :])
    return -r1[None, :, None, None] * np.log1p(r2[None, :, None, None] * dist[:, None])


def test_kerple_bias_values():
    module = KerpleLogBias(n_heads=4)
    r1 = np.array([1.0, 2.0, 0.5, -3.0], np.float32)  # the last is clamped to eps = 0.01
    r2 = np.array([1.0, 0.5, 2.0, 0.001], np.float32)  # the last is clamped to 0.01
    q_pos, k_pos = jnp.array([[0, 4, 9]]), jnp.array([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    bias = np.asarray(module.apply({"params": {"r1": r1, "r2": r2}}, q_pos, k_pos))
    assert bias.shape == (1, 4, 3, 10) and bias.dtype == np.float32
    # hand values: -1*log(1 + 1*1) = -ln 2; -2*log(1 + 0.5*4) = -2 ln 3; -0.5*log(1 + 2*9)
    np.testing.assert_allclose(bias[0, 0, 1, 3], -np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(bias[0, 1, 0, 4], -2.0 * np.log(3.0), rtol=1e-6)
    np.testing.assert_allclose(bias[0, 2, 2, 0], -0.5 * np.log(19.0), rtol=1e-6)
    np.testing.assert_allclose(bias[0, 3, 2, 0], -0.01 * np.log(1.09), rtol=1e-5)
    np.testing.assert_array_equal(bias[:, :, 0, 0], 0.0)  # distance 0: no penalty
    np.testing.assert_allclose(bias, kerple_numpy(r1, r2, q_pos, k_pos), rtol=1e-6, atol=1e-7)
    # symmetric in the distance, so one module serves both directions
    np.testing.assert_allclose(bias[0, :, 1, 2], bias[0, :, 1, 6], rtol=1e-6)


def test_kerple_initialisation_is_the_references():
    module = KerpleLogBias(n_heads=64)
    pos = jnp.arange(12)[None]
    params = module.init(jax.random.key(3), pos, pos)["params"]
    r1, r2 = np.asarray(params["r1"]), np.asarray(params["r2"])
    assert r1.shape == r2.shape == (64,)
    assert (r1 >= 0).all() and (r1 < 2).all() and (r2 >= 0).all() and (r2 < 1).all()
    assert r1.std() > 0.3 and r2.std() > 0.15  # uniform on [0, 2) and [0, 1), not constant
    again = module.init(jax.random.key(3), pos, pos)["params"]
    np.testing.assert_array_equal(again["r1"], r1)
    bias = module.apply({"params": params}, pos, pos)
    np.testing.assert_allclose(bias, kerple_numpy(r1, r2, pos, pos), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_kerple_gradients_reach_r1_and_r2_even_at_the_floor():
    cfg = tiny(position="kerple", n_layers=2)
    model, params, tokens = init(cfg)
    assert set(params["relative_bias"]) == {"r1", "r2"}  # one bias for the stack, as T5
    assert all("relative_bias" not in params[f"layer_{i}"] for i in range(2))
    params["relative_bias"]["r1"] = params["relative_bias"]["r1"].at[0].set(-1.0)  # clamped

    def loss(p):
        return (model.apply({"params": p}, tokens) ** 2).mean()

    grads = jax.grad(loss)(params)["relative_bias"]
    for name in ("r1", "r2"):
        assert np.all(np.abs(np.asarray(grads[name])) > 0), name


def test_kerple_config_checks():
    with pytest.raises(ConfigError, match="positive"):
        tiny(position={"name": "kerple", "eps": 0.0})


# Randomized positions ----------------------------------------------------------------------------


def test_sampled_positions_are_sorted_unique_in_range_and_seeded():
    positions = jnp.broadcast_to(jnp.arange(50), (3, 50))
    a = np.asarray(sample_positions(jax.random.key(0), positions, 64))
    assert a.shape == (3, 50) and a.dtype == np.int32
    assert (np.diff(a, axis=1) > 0).all()  # sorted and unique
    assert a.min() >= 0 and a.max() < 64
    assert len({tuple(row) for row in a}) == 3  # each row draws its own
    np.testing.assert_array_equal(a, sample_positions(jax.random.key(0), positions, 64))
    assert (a != np.asarray(sample_positions(jax.random.key(1), positions, 64))).any()
    full = sample_positions(jax.random.key(2), jnp.arange(64)[None], 64)
    np.testing.assert_array_equal(full, jnp.arange(64)[None])  # T = L: every position
    with pytest.raises(ValueError, match="max_position"):
        sample_positions(jax.random.key(0), positions, 40)


def test_packed_segments_each_draw_a_uniform_subset():
    """Per segment: sorted, in range, and distributed as a uniform n-subset of [0, L): the mean
    smallest is (L - n)/(n + 1), the mean largest L - 1 - (L - n)/(n + 1)."""
    L, lengths = 64, (10, 6, 4)
    row = np.concatenate([np.arange(n) for n in lengths])
    positions = jnp.broadcast_to(jnp.asarray(row), (4000, row.size))
    drawn = np.asarray(sample_positions(jax.random.key(0), positions, L))
    start = 0
    for n in lengths:
        seg = drawn[:, start : start + n]
        start += n
        assert (np.diff(seg, axis=1) > 0).all() and seg.min() >= 0 and seg.max() < L
        e_min = (L - n) / (n + 1)
        assert abs(seg[:, 0].mean() - e_min) < 0.35, (n, seg[:, 0].mean(), e_min)
        assert abs(seg[:, -1].mean() - (L - 1 - e_min)) < 0.35
    assert abs(drawn.mean() - (L - 1) / 2) < 0.3  # every position equally likely


def test_randomized_delegates_to_its_base_and_checks_it():
    base = tiny(position="learned", max_len=16)
    cfg = tiny(position={"name": "randomized", "base": "learned", "max_position": 16,
                         "evaluate": "real"}, max_len=16)
    assert cfg.position.max_length(cfg) == 16 and cfg.position.randomizes
    model, params, tokens = init(cfg)
    base_model, base_params, _ = init(base)
    jax.tree.map(np.testing.assert_array_equal, params, base_params)  # same parameter tree
    np.testing.assert_array_equal(model.apply({"params": params}, tokens),
                                  base_model.apply({"params": params}, tokens))
    wide = tiny(position={"name": "randomized", "max_position": 100})
    assert wide.position.max_length(wide) == 100
    for bad, match in [("alibi", "its own bias"), ("kerple", "its own bias"),
                       ("none", "no position embedding"), ("randomized", "randomization")]:
        with pytest.raises(ConfigError, match=match):
            tiny(position={"name": "randomized", "base": bad})
    with pytest.raises(ConfigError, match="max_len to at least max_position"):
        tiny(position={"name": "randomized", "base": "learned", "max_position": 32}, max_len=16)
    with pytest.raises(ConfigError, match="even"):  # the base's own check runs
        tiny(position={"name": "randomized", "base": "rope"}, head_dim=7)
    with pytest.raises(ConfigError, match="max_position"):
        tiny(position={"name": "randomized", "max_position": 0})


@pytest.mark.parametrize("base", ["rope", "xpos", "learned", "sinusoidal"])
def test_training_forward_uses_random_positions_and_never_leaks(base):
    cfg = tiny(position={"name": "randomized", "base": base, "max_position": 16}, max_len=16)
    model, params, tokens = init(cfg)
    variables = model.init(jax.random.key(0), tokens)

    def train(key, p=variables["perturbations"]):
        return model.apply({"params": params, "perturbations": p}, tokens, deterministic=False,
                           rngs={"dropout": key})

    a, b, c = train(jax.random.key(1)), train(jax.random.key(1)), train(jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert np.abs(np.asarray(a - c)).max() > 1e-4
    assert np.abs(np.asarray(a - model.apply({"params": params}, tokens))).max() > 1e-4
    for query in (0, 6, 11):  # the causal mask keeps the real order
        grad = jax.grad(lambda p, q=query: train(jax.random.key(1), p)[:, q].sum())(
            variables["perturbations"])["embeddings"]
        assert np.all(np.asarray(grad)[:, query + 1 :] == 0.0)
        assert np.abs(np.asarray(grad)[:, : query + 1]).sum() > 0


@pytest.mark.slow
def test_evaluation_draws_positions_as_the_paper_and_real_positions_decode_with_a_cache():
    """At test time the paper draws an ordered subset of M positions from [0, L) again (M may
    exceed the training length): ``evaluate="sample"`` does so in every deterministic forward
    pass, fixed by ``eval_seed``; ``evaluate="real"`` uses 0..T-1 and is the setting that
    decodes with a KV cache (the sampled one is refused, naming the fix)."""
    from transformers_jax.sample import SamplingConfig, generate

    sampled = tiny(position={"name": "randomized", "max_position": 40}, max_len=16)
    real_cfg = sampled.replace(position={"name": "randomized", "max_position": 40,
                                         "evaluate": "real"})
    model, params, _ = init(sampled, T=8)
    real_model = build_model(real_cfg)
    tokens = jax.random.randint(jax.random.key(5), (2, 30), 0, sampled.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(30), (2, 30))
    drawn = sample_positions(jax.random.key(0), positions, 40)  # eval_seed 0
    assert (np.diff(np.asarray(drawn), axis=1) > 0).all() and int(drawn.max()) < 40
    out = model.apply({"params": params}, tokens)
    np.testing.assert_array_equal(out, model.apply({"params": params}, tokens))  # fixed draw
    np.testing.assert_allclose(out, real_model.apply({"params": params}, tokens,
                                                     positions=drawn), atol=1e-6)
    assert np.abs(np.asarray(out - real_model.apply({"params": params}, tokens))).max() > 1e-4
    with pytest.raises(ValueError, match="position.evaluate=real"):
        generate(model, params, [[1, 2]], SamplingConfig(max_new_tokens=2))
    assert len(generate(real_model, params, [[1, 2]], SamplingConfig(max_new_tokens=2))[0]) == 2


def test_bert_training_forward_uses_random_positions():
    cfg = ModelConfig(family="bert", vocab_size=32, d_model=32, n_layers=1, n_heads=4,
                      mask="bidirectional", position={"name": "randomized", "max_position": 32})
    model, params, tokens = init(cfg)
    a, b = (model.apply({"params": params}, tokens, deterministic=False,
                        rngs={"dropout": jax.random.key(k)}) for k in (1, 2))
    assert np.abs(np.asarray(a - b)).max() > 1e-4


@pytest.mark.slow
def test_encdec_training_forward_uses_random_positions():
    cfg = ModelConfig(family="encdec", vocab_size=32, d_model=32, n_layers=1, n_heads=4,
                      position={"name": "randomized", "max_position": 32})
    model = build_model(cfg)
    src = jax.random.randint(jax.random.key(1), (2, 9), 0, 32)
    tgt = jax.random.randint(jax.random.key(2), (2, 7), 0, 32)
    params = nn.meta.unbox(model.init(jax.random.key(0), tgt, encoder_inputs=src)["params"])
    a, b = (model.apply({"params": params}, tgt, encoder_inputs=src, deterministic=False,
                        rngs={"dropout": jax.random.key(k)}) for k in (1, 2))
    assert np.abs(np.asarray(a - b)).max() > 1e-4


# Every registered scheme -------------------------------------------------------------------------


@pytest.mark.parametrize("position", POSITIONS)
def test_forward_is_bitwise_deterministic(position):
    cfg = tiny(position=position, init_std=0.1)
    model, params, tokens = init(cfg)
    first = jax.jit(model.apply)({"params": params}, tokens)
    second = jax.jit(lambda v, t: model.apply(v, t))({"params": params}, tokens)  # recompiled
    np.testing.assert_array_equal(first, second)
    _, params_again, tokens_again = init(cfg)  # a second init with the same seed
    jax.tree.map(np.testing.assert_array_equal, params_again, params)
    np.testing.assert_array_equal(jax.jit(model.apply)({"params": params_again}, tokens_again),
                                  first)


@pytest.mark.parametrize("position", POSITIONS)
def test_config_round_trips_through_json_and_the_command_line(position):
    cfg = ModelConfig(position=position)
    assert cfg.position == POSITION_REGISTRY.get(position)()
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["position"]["name"] == position
    assert ModelConfig.from_dict(data) == cfg
    from_cli = apply_overrides(ModelConfig(), {"position": position})
    assert from_cli == cfg and from_cli.position.name == position


def test_nested_settings_round_trip():
    cli = apply_overrides(ModelConfig(), {
        "position": "randomized", "position.max_position": "512", "position.base": "xpos",
        "position.base.scale_base": "256", "position.base.pairing": "interleaved"})
    assert str(cli.position) == ("randomized(max_position=512, "
                                 "base=xpos(pairing=interleaved, scale_base=256.0))")
    assert ModelConfig.from_dict(json.loads(json.dumps(cli.to_dict()))) == cli
    kerple = apply_overrides(ModelConfig(), {"position": "kerple", "position.init_r1": "1.5"})
    assert kerple.position.init_r1 == 1.5
    with pytest.raises(ConfigError, match="has no setting bogus"):
        apply_overrides(ModelConfig(), {"position": "xpos", "position.bogus": "1"})


@pytest.mark.parametrize("base", ["rope", "learned"])
def test_randomized_positions_evaluated_on_real_positions_decode_with_the_cache(base):
    from test_kvcache import cached_logits

    cfg = tiny(position={"name": "randomized", "base": base, "max_position": 16,
                         "evaluate": "real"}, n_kv_heads=2, init_std=0.1)
    model, params, tokens = init(cfg, T=12)
    full = np.asarray(model.apply({"params": params}, tokens))
    cached = cached_logits(model, params, cfg, tokens, [4, 7], cache_size=12)
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=1e-5)


def test_a_sequences_draw_does_not_depend_on_what_is_appended():
    """Padding (segment 0) or a longer row after a sequence leaves its positions as they are,
    so appended padding changes nothing at evaluation either (the BERT and encoder-decoder
    padding tests rely on it)."""
    short = sample_positions(jax.random.key(3), jnp.arange(5)[None], 64)
    positions = jnp.arange(9)[None]
    segments = jnp.array([[1, 1, 1, 1, 1, 0, 0, 0, 0]])
    padded = sample_positions(jax.random.key(3), positions, 64, segments)
    np.testing.assert_array_equal(padded[:, :5], short)
    longer = sample_positions(jax.random.key(3), jnp.arange(9)[None], 64)
    assert (np.asarray(longer[:, :5]) != np.asarray(short)).any()  # one run: all 9 are sorted


@pytest.mark.parametrize("name", POSITION_REGISTRY.names())
def test_length_settings_leave_nothing_to_warn_about(name):
    """What an experiment gives a scheme for training at L (its ``length_settings``) builds a
    valid config with no length warning at L: the two hooks state the same rule."""
    from transformers_jax import ModelConfig

    for train_len, max_eval in ((16, 256), (64, 1024), (128, 2048)):
        settings = POSITION_REGISTRY.get(name).length_settings(train_len, max_eval)
        position = {"name": name, **settings}
        cfg = ModelConfig(position=position, max_len=train_len)
        assert cfg.position.length_warnings(cfg, train_len) == [], (name, train_len)


@pytest.mark.parametrize("scaling", ROPE_SCALINGS.names())
def test_every_rope_scaling_extends_and_says_how_it_decodes(scaling):
    """``extending``/``as_decoded``: how an experiment sets any rule to extend a model x4 and
    scores it as generation would; a valid position for a model, the same rule name."""
    rule = ROPE_SCALINGS.get(scaling).extending(4.0, 16).as_decoded()
    config = ModelConfig(position={"name": "rope", "scaling": rule.to_dict()})
    assert config.position.scaling == rule and rule.name == scaling
    if rule.uses_length:  # the base follows each token's own length, as when decoding
        assert rule.length == "position"
