"""Remat by policy name and the scanned layer stack compute exactly what the plain loop does,
keep fewer activations for the backward pass, and shard like any other parameters."""

import dataclasses
import functools
import io
from contextlib import redirect_stdout

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from transformers_jax import ConfigError, ModelConfig, TrainConfig, build_model
from transformers_jax.learning.optim import decay_mask, make_optimizer
from transformers_jax.learning.step import init_state, make_train_step
from transformers_jax.models import family_of
from transformers_jax.nn.stack import (
    REMAT_POLICIES,
    remat_policy,
    stack_layer_params,
    unstack_layer_params,
)
from transformers_jax.parallel import make_trainer
from transformers_jax.registry import FAMILIES

# One layer where a layer's remat is the point (its loss, gradients and saved residuals: remat
# wraps each layer on its own, so a second one is the same wrapping again, at twice the compile);
# two (``SCAN_LAYERS``) where the layers are stacked and scanned, or restacked.
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_len=32, dropout=0.1)
SCAN_LAYERS = 2


def StackLM(config: ModelConfig, remat: str = "none", scan: bool = False):  # noqa: N802
    """The GPT with the given remat policy and layer layout."""
    return build_model(config.replace(remat=remat, scan_layers=scan))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)


def unboxed_init(model):
    tokens, inputs = family_of(model.config).example_inputs(model.config, TOKENS.shape[1])
    tokens = jnp.broadcast_to(tokens, TOKENS.shape)
    inputs = {k: jnp.broadcast_to(v, (TOKENS.shape[0], *v.shape[1:])) for k, v in inputs.items()}
    return nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), tokens, **inputs)["params"])


def param_shapes(model):
    return jax.eval_shape(lambda: unboxed_init(model))


def loss_fn(model, deterministic=False):
    inputs = family_of(model.config).inputs_for(model.config, TOKENS)

    def loss(params):
        logits = model.apply({"params": params}, TOKENS, deterministic=deterministic,
                             rngs={"dropout": jax.random.key(1)}, **inputs)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    return loss


def max_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def saved_residual_count(fn, *args) -> int:
    """How many arrays the backward pass keeps (one line each in JAX's report)."""
    out = io.StringIO()
    with redirect_stdout(out):
        print_saved_residuals(fn, *args)
    return len([line for line in out.getvalue().splitlines() if line.strip()])


@functools.cache
def plain_run(cfg: ModelConfig):
    """The plain loop model of ``cfg`` (no remat, no scan): its initial parameters, loss,
    gradients and saved-residual count, computed once for the tests below."""
    plain = build_model(cfg.replace(remat="none", scan_layers=False))
    params = unboxed_init(plain)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn(plain)))(params)
    return params, loss, grads, saved_residual_count(loss_fn(plain), params)


@functools.cache
def remat_run(cfg: ModelConfig, remat: str):
    """The unscanned model of ``cfg`` with ``remat``, at ``plain_run``'s parameters: loss,
    gradients and saved-residual count."""
    params = plain_run(cfg)[0]
    model = build_model(cfg.replace(remat=remat, scan_layers=False))
    loss, grads = jax.jit(jax.value_and_grad(loss_fn(model)))(params)
    return loss, grads, saved_residual_count(loss_fn(model), params)


def test_policy_names():
    assert remat_policy("none") is None
    assert remat_policy("dots_saveable") is jax.checkpoint_policies.dots_saveable
    assert remat_policy("full") is jax.checkpoint_policies.nothing_saveable
    with pytest.raises(ConfigError, match="remat='some'.*valid choices: none, full"):
        remat_policy("some")
    assert {"none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"} <= set(
        REMAT_POLICIES
    )


def test_decay_mask_sees_through_the_stacked_layer_axis():
    params = {"layer_0": {"w": jnp.ones((3, 4)), "scale": jnp.ones(4)}, "head": jnp.ones((4, 2))}
    stacked = stack_layer_params({**params, "layer_1": params["layer_0"]}, 2)
    assert decay_mask(params) == {"layer_0": {"w": True, "scale": False}, "head": True}
    assert decay_mask(stacked) == {"layers": {"w": True, "scale": False}, "head": True}


@pytest.mark.slow
def test_remat_keeps_params_and_gradients_and_saves_less():
    plain = StackLM(CFG)
    params, loss, grads, kept_plain = plain_run(CFG)
    kept = {"none": kept_plain}
    for policy in ("full", "dots_saveable", "dots_with_no_batch_dims_saveable"):
        model = StackLM(CFG, remat=policy)
        # Same parameter tree: remat changes the backward pass, not the model.
        assert param_shapes(model) == param_shapes(plain)
        if policy == "dots_with_no_batch_dims_saveable":
            # (its gradients are checked below with full and dots_saveable)
            kept[policy] = saved_residual_count(loss_fn(model), params)
            continue
        # Same loss and gradients, dropout included (the recomputation replays the same mask).
        loss_r, grads_r, kept[policy] = remat_run(CFG, policy)
        np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
        assert max_diff(grads_r, grads) < 1e-6
    # Keeping matmul outputs keeps more than keeping none; full keeps only the layer inputs.
    assert kept["none"] > kept["dots_saveable"] > kept["dots_with_no_batch_dims_saveable"]
    assert kept["dots_with_no_batch_dims_saveable"] > kept["full"]


@pytest.mark.slow
def test_scan_over_layers_equals_the_loop_under_fsdp_and_tensor_parallel():
    """The scanned (and rematted) stack on a data x fsdp x tensor mesh, started from the loop
    model's parameters restacked, trains exactly like the loop model on one device; the
    stacked ``layers`` axis stays whole, the rest shards as usual."""
    # scan and loop split dropout keys differently
    cfg = dataclasses.replace(CFG, dropout=0.0, n_layers=SCAN_LAYERS)
    plain, scanned = StackLM(cfg), StackLM(cfg, remat="dots_saveable", scan=True)
    boxed = jax.eval_shape(scanned.init, jax.random.key(0), TOKENS)["params"]
    kernel = boxed["layers"]["attention"]["query"]["kernel"]
    assert kernel.names == ("layers", "embed", "heads", "head_dim")
    assert kernel.value.shape == (cfg.n_layers, 32, 4, 8)

    # learning.optim's optimizer, whose decay mask knows the stacked layout (its decay_mask).
    optimizer = make_optimizer(TrainConfig(steps=10, warmup_steps=2, learning_rate=1e-3))
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        tokens = rng.integers(0, 64, (16, 17)).astype(np.int32)
        batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    state = jax.jit(lambda: init_state(plain, optimizer, 0, batches[0]))()
    stacked = stack_layer_params(state.params, cfg.n_layers)
    assert jax.tree.structure(stacked) == jax.tree.structure(nn.meta.unbox(boxed))
    assert max_diff(unstack_layer_params(stacked, cfg.n_layers), state.params) == 0.0

    trainer = make_trainer("jit", scanned, optimizer, batches[0], mesh="data=2,fsdp=2,tensor=2")
    sharded = trainer.place_state(
        state.replace(params=stacked, opt_state=optimizer.init(stacked))
    )
    up = sharded.params["layers"]["mlp"]["up"]["kernel"]  # [L, C, F] = [2, 32, 128]
    assert {s.data.shape for s in up.addressable_shards} == {(2, 16, 64)}
    step = jax.jit(make_train_step(plain, optimizer))
    for batch in batches:
        state, ref = step(state, batch)
        sharded, got = trainer.step(sharded, batch)
        np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    got_params = unstack_layer_params(jax.device_get(sharded.params), cfg.n_layers)
    assert max_diff(got_params, state.params) < 1e-5


TRANSFORMERS = [name for name, family in FAMILIES.items() if not family.recurrent]


@pytest.mark.slow
@pytest.mark.parametrize("family", TRANSFORMERS)
@pytest.mark.parametrize("remat, scan", [("full", False), ("save_attention_out", False),
                                         ("dots_saveable", True)])
def test_every_family_runs_its_layers_through_the_one_stack(family, remat, scan):
    """remat and scan_layers work for every transformer family: the same loss and gradients
    as the plain loop (dropout on: the recomputation replays the same masks), the same
    parameter tree (scan: stacked under ``layers``)."""
    cfg = dataclasses.replace(CFG, family=family, mask=FAMILIES.get(family).default_mask,
                              dropout=0.0 if scan else 0.1,  # scan splits dropout keys anew
                              n_layers=SCAN_LAYERS if scan else CFG.n_layers)
    params, loss, grads, kept_plain = plain_run(cfg)  # the plain loop model, once per cfg
    other = build_model(cfg.replace(remat=remat, scan_layers=scan))
    if scan:
        params = _stack_every_side(params, cfg)
        loss_r, grads_r = jax.jit(jax.value_and_grad(loss_fn(other)))(params)
        kept = saved_residual_count(loss_fn(other), params)
    else:  # (gpt with full remat: the test above's run)
        loss_r, grads_r, kept = remat_run(cfg, remat)
    assert jax.tree.structure(param_shapes(other)) == jax.tree.structure(params)
    np.testing.assert_allclose(loss_r, loss, rtol=1e-5)
    if scan:
        grads_r = _unstack_every_side(grads_r, cfg)
    assert max_diff(grads_r, grads) < 1e-5
    assert kept < kept_plain


def _sides(params):
    """Every subtree that holds layers (the model itself, or encoder/decoder/encoder)."""
    return [k for k, v in params.items() if isinstance(v, dict) and (
        "layer_0" in v or "layers" in v)]


def _stack_every_side(params, cfg):
    if "layer_0" in params:
        return stack_layer_params(params, cfg.n_layers)
    return {**params, **{k: stack_layer_params(params[k], cfg.n_layers) for k in _sides(params)}}


def _unstack_every_side(params, cfg):
    if "layers" in params:
        return unstack_layer_params(params, cfg.n_layers)
    return {**params, **{k: unstack_layer_params(params[k], cfg.n_layers)
                         for k in _sides(params)}}


def test_remat_policy_names_match_the_config_choices():
    from transformers_jax import config

    assert set(config.REMAT_POLICIES) == set(REMAT_POLICIES)
