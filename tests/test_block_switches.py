"""The block's switches, ``norm``, ``norm_position`` and ``mlp``: every registered entry (a new
one is covered the moment it is registered) round-trips through JSON and the command line and
keeps its promises; configs saved when they were plain names (and ``norm_eps`` a field of its
own) load as the same model."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import init, tiny

from transformers_jax.cli import build_configs
from transformers_jax.config import ConfigError, ModelConfig, apply_overrides
from transformers_jax.registry import MLPS, NORM_PLACEMENTS, NORMS

SWITCHES = [("norm", name) for name in NORMS] + [
    ("norm_position", name) for name in NORM_PLACEMENTS] + [("mlp", name) for name in MLPS]


@pytest.mark.parametrize(("field", "name"), SWITCHES)
def test_every_entry_round_trips_through_json_and_the_command_line(field, name):
    registry = {"norm": NORMS, "norm_position": NORM_PLACEMENTS, "mlp": MLPS}[field]
    cfg = ModelConfig(**{field: name})
    assert getattr(cfg, field) == registry.get(name)()
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data[field]["name"] == name
    assert ModelConfig.from_dict(data) == cfg
    assert apply_overrides(ModelConfig(), {field: name}) == cfg
    assert ModelConfig.from_dict({**data, field: name}) == cfg  # saved as a plain name


@pytest.mark.parametrize("norm", NORMS.names())
def test_every_norm_normalises_with_its_own_eps(norm):
    """Unit RMS out for a unit scale, whatever the input's scale (eps small beside it); a
    large eps shrinks the output, so the setting reaches the layer; the output has the
    compute dtype."""
    x = jax.random.normal(jax.random.key(0), (2, 3, 16)) * 5.0 + 1.0

    def normalised(eps: float, dtype: str = "float32", scale: float = 1.0):
        cfg = ModelConfig(norm={"name": norm, "eps": eps}, d_model=16, n_heads=2, dtype=dtype)
        layer = cfg.norm.layer(cfg)
        params = layer.init(jax.random.key(1), x)
        return layer.apply(params, x * scale)

    rms = jnp.sqrt(jnp.mean(normalised(1e-6) ** 2, axis=-1))
    np.testing.assert_allclose(rms, 1.0, rtol=1e-3)
    np.testing.assert_allclose(normalised(1e-6, scale=100.0), normalised(1e-6), atol=1e-4)
    assert float(jnp.abs(normalised(1e4)).max()) < 0.5
    assert normalised(1e-6, "bfloat16").dtype == jnp.bfloat16
    with pytest.raises(ConfigError, match=r"norm\.eps=0\.0: must be positive"):
        ModelConfig(norm={"name": norm, "eps": 0.0})


@pytest.mark.parametrize("mlp", MLPS.names())
def test_every_mlp_builds_the_matrices_its_gating_says(mlp):
    """A gated MLP has a gate beside its up projection and keeps a 4x MLP's parameter count
    (d_ff = 8/3 d_model, rounded to 8); the activation keeps shape and dtype, and is finite."""
    cfg = tiny(mlp=mlp, n_layers=1)
    kind = cfg.mlp
    _, params, _ = init(cfg)
    block = params["layer_0"]["mlp"]
    assert ("gate" in block) == kind.gated
    assert block["up"]["kernel"].shape == (cfg.d_model, cfg.ff_dim)
    assert cfg.ff_dim == (88 if kind.gated else 128)  # d_model 32
    x = jnp.linspace(-30.0, 30.0, 601, dtype=jnp.bfloat16)
    y = kind.activation(x)
    assert y.shape == x.shape and y.dtype == x.dtype and bool(jnp.isfinite(y).all())


def test_the_norm_takes_its_settings_on_the_command_line():
    model, _ = build_configs(["--model.norm=rmsnorm", "--model.norm.eps=1e-6",
                              "--model.mlp=swiglu", "--model.norm_position=post"])
    assert (model.norm.name, model.norm.eps) == ("rmsnorm", 1e-6)
    assert (model.mlp.name, model.norm_position.name) == ("swiglu", "post")
    assert str(model.norm) == "rmsnorm(eps=1e-06)"
    same = apply_overrides(model, {"norm": "rmsnorm"})  # naming the entry in use keeps it
    assert same.norm.eps == 1e-6
    assert apply_overrides(model, {"norm": "layernorm"}).norm.eps == 1e-5  # another: defaults
    with pytest.raises(ConfigError, match=r"--model\.norm_eps: the field moved into its "
                                          r"switch; use --model\.norm\.eps"):
        build_configs(["--model.norm_eps=1e-6"])
    with pytest.raises(ConfigError, match=r"norm=rmsnorm has no setting epsilon \(its settings: "
                                          r"eps\); did you mean --model\.norm\.eps"):
        build_configs(["--model.norm=rmsnorm", "--model.norm.epsilon=1e-6"])


def test_configs_saved_with_plain_names_and_norm_eps_migrate():
    """A run's config.json from before norm, norm_position and mlp were switches loads as the
    same model, resumes against it, and a JSON config's norm_eps sets the norm's eps."""
    from transformers_jax.runs.checkpoint import check_same_model

    new = ModelConfig(norm={"name": "rmsnorm", "eps": 1e-6}, norm_position="post", mlp="swiglu")
    old = {**new.to_dict(), "norm": "rmsnorm", "norm_eps": 1e-6, "norm_position": "post",
           "mlp": "swiglu"}
    assert ModelConfig.from_dict(old) == new
    check_same_model(old, new, "an old run")  # no mismatch: same model, old layout
    no_norm_named = {k: v for k, v in old.items() if k != "norm"}
    assert ModelConfig.from_dict(no_norm_named).norm == NORMS.get("layernorm")(eps=1e-6)
    merged = {**new.to_dict(), "norm_eps": 1e-3}  # a JSON config given over a saved one
    assert ModelConfig.from_dict(merged).norm.eps == 1e-3
    with pytest.raises(ConfigError, match="norm.eps=-1.0"):
        ModelConfig.from_dict({"norm_eps": -1.0})
