"""Config validation: every bad value fails at construction with a message that helps."""

import pytest

from transformers_jax import ModelConfig, RopeConfig, TrainConfig
from transformers_jax.cli import build_configs
from transformers_jax.config import ConfigError, apply_overrides, check_lengths
from transformers_jax.registry import UnknownNameError


def test_defaults_are_valid_and_frozen():
    cfg = ModelConfig()
    assert cfg.kv_heads == cfg.n_heads and cfg.dims_per_head == 32
    with pytest.raises(AttributeError):
        cfg.d_model = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "changes, fragments",
    [
        ({"d_model": 100, "n_heads": 3}, ["n_heads=3", "must divide d_model=100"]),
        ({"n_heads": 4, "n_kv_heads": 3}, ["n_kv_heads=3", "must divide n_heads=4"]),
        ({"d_model": 12, "n_heads": 4, "position": "rope"}, ["head_dim=3", "even"]),
        ({"mask": "sliding_window"}, ["window=None", "positive window"]),
        ({"window": 8}, ["window=8", "only used with mask=sliding_window"]),
        ({"dropout": 1.5}, ["dropout=1.5"]),
        ({"attn_logit_softcap": 50.0, "attention": "xla"}, ["soft-cap", "chunked"]),
        ({"attn_logit_softcap": 50.0, "attention": "pallas"}, ["pallas kernel", "chunked"]),
        ({"dtype": "float64"}, ["dtype='float64'", "bfloat16"]),
    ],
)
def test_bad_values_name_field_and_fix(changes, fragments):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**changes)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(
    "field, valid",
    [
        ("attention", "chunked, cudnn, pallas, reference, xla"),
        ("mask", "bidirectional, causal, prefix, sliding_window"),
        ("position", "alibi, fire, learned, none, rope, sinusoidal, t5"),
        ("norm", "layernorm, rmsnorm"),
        ("mlp", "geglu, gelu, gelu_exact, relu, swiglu"),
    ],
)
def test_unknown_names_list_valid_ones(field, valid):
    with pytest.raises(UnknownNameError) as err:
        ModelConfig(**{field: "nonsense"})
    assert f"{field}='nonsense'" in str(err.value)
    assert valid in str(err.value)


def test_rope_config_checks():
    with pytest.raises(ConfigError, match="rope.scaling='yarn' needs a factor > 1"):
        RopeConfig(scaling="yarn")
    with pytest.raises(ConfigError, match="rope.pairing"):
        RopeConfig(pairing="sideways")
    # partial rotary that leaves an odd rotary width
    with pytest.raises(ConfigError, match="rotary width"):
        ModelConfig(d_model=64, n_heads=4, rope=RopeConfig(fraction=0.3125))


def test_learned_table_length_check():
    cfg = ModelConfig(position="learned", max_len=64)
    check_lengths(cfg, 64)
    with pytest.raises(ConfigError, match="longer than the learned position table"):
        check_lengths(cfg, 65)
    check_lengths(cfg.replace(position="rope"), 4096)  # rope has no table


def test_train_config_checks():
    with pytest.raises(ConfigError, match="train.warmup_steps"):
        TrainConfig(steps=10, warmup_steps=10)
    with pytest.raises(ConfigError, match="train.batch_size=0"):
        TrainConfig(batch_size=0)


def test_overrides_coerce_types_and_nest():
    cfg = apply_overrides(
        ModelConfig(),
        {"d_model": "64", "qk_norm": "true", "n_kv_heads": "2", "rope.scaling": "linear",
         "rope.factor": "4", "attn_logit_softcap": "none", "attention": "chunked"},
    )
    assert cfg.d_model == 64 and cfg.qk_norm is True and cfg.n_kv_heads == 2
    assert cfg.rope.scaling == "linear" and cfg.rope.factor == 4.0
    assert cfg.attn_logit_softcap is None
    with pytest.raises(ConfigError, match="unknown option --nonsense"):
        apply_overrides(ModelConfig(), {"nonsense": "1"})
    with pytest.raises(ConfigError, match="expected a int"):
        apply_overrides(ModelConfig(), {"d_model": "wide"})


def test_cli_builds_both_sections():
    model, train = build_configs(
        ["--model.position=alibi", "--model.rope.base", "500", "--steps", "7", "--json",
         "--train.learning_rate=1e-3", "--train.warmup_steps=2"]
    )
    assert model.position == "alibi" and model.rope.base == 500.0
    assert model.vocab_size == 262  # follows the byte tokenizer
    assert train.steps == 7 and train.json and train.learning_rate == 1e-3
    with pytest.raises(ConfigError, match="use --model.FIELD or --train.FIELD"):
        build_configs(["--d_model=3"])


def test_round_trip_through_dict():
    cfg = ModelConfig(position="rope", rope=RopeConfig(scaling="yarn", factor=4.0))
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
