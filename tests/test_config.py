"""Config validation: every bad value fails at construction with a message that helps."""

import inspect
import json
import subprocess
import sys
import warnings

import pytest

from transformers_jax import ModelConfig, Rope, TrainConfig
from transformers_jax.cli import build_configs
from transformers_jax.config import SHUFFLE_ROWS, ConfigError, apply_overrides, check_lengths
from transformers_jax.registry import Registry, UnknownNameError


def jax_and_flax_after(code: str) -> str:
    """Run ``code`` in a fresh interpreter; what it prints, then which of JAX and Flax it
    imported."""
    code += "\nimport sys\nprint(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_train_config_is_built_and_validated_without_jax():
    """``TrainConfig()``, its checks and its registry (the tokenizers) import neither JAX nor
    Flax: ``builtins.py`` fills each registry on its first read, from that registry's
    modules only."""
    out = jax_and_flax_after(
        "from transformers_jax import TrainConfig, ConfigError\n"
        "TrainConfig(); TrainConfig(tokenizer='char', steps=3)\n"
        "try:\n    TrainConfig(tokenizer='bogus')\n"
        "except ConfigError as err:\n    print(err)")
    assert out.splitlines()[-2].startswith("train.tokenizer='bogus': not known; valid choices")
    assert out.splitlines()[-1] == "[]"


# Configs that name every kind of switch with settings, and bad values each switch's check
# refuses: built in a fresh interpreter without JAX, and here, where JAX is loaded.
SWITCHED = [
    {},
    {"family": "encdec", "position": {"name": "t5", "num_buckets": 32},
     "mask": {"name": "sliding_window", "window": 16}, "attention": "chunked",
     "norm": {"name": "rmsnorm", "eps": 1e-6}, "norm_position": "post", "mlp": "swiglu"},
    {"family": "bert", "mask": "bidirectional", "position": "learned", "mlp": "gelu_exact"},
    {"family": "lstm", "d_model": 48},
    {"position": "sinusoidal", "mlp": "relu"},
    {"position": {"name": "rope", "scaling": {"name": "yarn", "factor": 4.0}}, "mlp": "geglu",
     "attention": "reference", "mask": "prefix"},
    {"position": {"name": "randomized", "base": "xpos", "max_position": 512},
     "dtype": "bfloat16"},
    {"position": "alibi", "attention": "pallas"}, {"position": "fire"}, {"position": "kerple"},
    {"position": "none", "attention": "cudnn"},
]
REFUSED = [
    {"position": {"name": "t5", "num_buckets": 2}},
    {"mask": "sliding_window"},
    {"attention": {"name": "chunked", "chunk_size": 0}},
    {"family": "encdec", "mask": "bidirectional"},
    {"attn_logit_softcap": 50.0, "attention": "xla"},
    {"mask": {"name": "sliding_window", "window": 4}, "attention": "pallas"},
    {"d_model": 12, "n_heads": 4, "position": "rope"},
    {"position": {"name": "rope", "scaling": {"name": "yarn", "factor": 1.0}}},
    {"position": {"name": "randomized", "base": "alibi"}},
    {"position": {"name": "randomized", "base": "learned", "max_position": 512}},
    {"position": {"name": "xpos", "gamma": 0.0}},
    {"position": {"name": "sinusoidal", "form": "fancy"}},
    {"norm": {"name": "layernorm", "eps": -1.0}},
    {"mlp": "swishy"},
    {"family": "gpt2"},
    {"family": "lstm", "position": "sinusoidal"},  # a switch the family does not read
]


def built_and_refused(switched: list[dict], refused: list[dict]) -> list[str]:
    """What building ``switched`` (their sizes, round trip, length checks) and ``refused``
    (their errors) gives, one line each. Run here and, from its source, in a fresh
    interpreter."""
    lines = []
    for changes in switched:
        cfg = ModelConfig(**changes)
        assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            check_lengths(cfg, 64)
        lines.append(f"{cfg.ff_dim} {cfg.position.max_length(cfg)} {cfg.mask.cache_slots(99)} "
                     f"{[str(w.message) for w in warned]}")
    for changes in refused:
        try:
            ModelConfig(**changes)
        except ValueError as err:
            lines.append(f"{type(err).__name__}: {err}")
    return lines


def test_a_model_config_is_built_and_validated_without_jax():
    """``ModelConfig()``, configs naming each switch with settings, their JSON round trip and
    length checks, and the refusals of bad values import neither JAX nor Flax (an entry's
    hooks import the maths they call), and say what they say with JAX loaded."""
    out = jax_and_flax_after(
        "import json, warnings\n"
        "from transformers_jax import ModelConfig, TrainConfig\n"
        "from transformers_jax.config import check_lengths\n"
        + inspect.getsource(built_and_refused)
        + f"TrainConfig()\nprint(json.dumps(built_and_refused({SWITCHED!r}, {REFUSED!r})))")
    without_jax, jax_and_flax = out.splitlines()[-2:]
    assert jax_and_flax == "[]"
    assert json.loads(without_jax) == built_and_refused(SWITCHED, REFUSED)
    assert len(json.loads(without_jax)) == len(SWITCHED) + len(REFUSED)  # each one refused


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
        ({"mask": "sliding_window"}, ["mask.window=None", "positive window"]),
        ({"mask": {"name": "causal", "window": 8}}, ["mask.window", "mask=causal has no such"]),
        ({"position": {"name": "t5", "num_buckets": 2}}, ["position.num_buckets=2", ">= 4"]),
        ({"attention": {"name": "chunked", "chunk_size": 0}}, ["chunk_size=0", "positive"]),
        ({"family": "encdec", "mask": "bidirectional"}, ["mask='bidirectional'", "decodes"]),
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
        ("attention", "chunked, cudnn, pallas, reference, splash, xla"),
        ("mask", "bidirectional, causal, prefix, sliding_window"),
        ("position", "alibi, fire, kerple, learned, none, randomized, rope, sinusoidal, t5, xpos"),
        ("norm", "layernorm, rmsnorm"),
        ("mlp", "geglu, gelu, gelu_exact, relu, swiglu"),
    ],
)
def test_unknown_names_list_valid_ones(field, valid):
    with pytest.raises(UnknownNameError) as err:
        ModelConfig(**{field: "nonsense"})
    assert f"{field}='nonsense'" in str(err.value)
    assert valid in str(err.value)


def test_registry_select_refuses_what_a_config_may_not_name():
    reg = Registry("widget")
    reg.add("built", {"can_build": True})
    reg.add("restored", {"can_build": False})
    assert reg.select("restored", "w") == {"can_build": False}  # no refusal set: any entry
    reg.refusal = lambda entry: None if entry["can_build"] else "only restored"
    assert reg.selectable() == ("built",) and reg.select("built", "w") == {"can_build": True}
    with pytest.raises(ConfigError, match="x.w='restored': only restored; valid choices: built$"):
        reg.select("restored", "x.w")
    with pytest.raises(ConfigError, match="x.w='gizmo': not known; valid choices: built$"):
        reg.select("gizmo", "x.w")
    with pytest.raises(ConfigError, match="train.tokenizer='wordpiece': not known; valid "
                       "choices: byte, char, hf, sentencepiece, sentencepiece_bpe$"):
        TrainConfig(tokenizer="wordpiece")


def test_rope_config_checks():
    with pytest.raises(ConfigError, match="scaling=yarn needs a factor > 1"):
        ModelConfig(position=Rope(scaling="yarn"))
    with pytest.raises(ConfigError, match="position.pairing"):
        ModelConfig(position=Rope(pairing="sideways"))
    with pytest.raises(UnknownNameError, match="scaling='nope'.*dynamic_ntk"):
        Rope(scaling="nope")
    # partial rotary that leaves an odd rotary width
    with pytest.raises(ConfigError, match="rotary width"):
        ModelConfig(d_model=64, n_heads=4, position=Rope(fraction=0.3125))


def test_learned_table_length_check():
    cfg = ModelConfig(position="learned", max_len=64)
    check_lengths(cfg, 64)
    with pytest.raises(ConfigError, match="longer than position=learned allows"):
        check_lengths(cfg, 65)
    check_lengths(cfg.replace(position="rope"), 4096)  # rope has no table


@pytest.mark.parametrize("position, max_len, limit, field", [
    ({"name": "learned"}, 64, 64, "model.max_len"),
    ({"name": "randomized", "max_position": 48}, 128, 48, "model.position.max_position"),
    ({"name": "randomized", "max_position": 48, "base": {"name": "learned"}}, 128, 48,
     "model.position.max_position"),
    ({"name": "xpos", "scale_base": 1.0}, 128, None, "model.position.scale_base"),
])
def test_a_length_error_names_the_setting_that_limits(position, max_len, limit, field):
    """Raising the named setting is the fix: the error names the field that sets the limit
    (a randomized scheme's max_position, not max_len; xpos's scale_base)."""
    cfg = ModelConfig.from_dict({"position": position, "max_len": max_len})
    limit = limit or cfg.position.max_length(cfg)
    assert cfg.position.length_field(cfg) == field
    with pytest.raises(ConfigError, match=rf"{limit} positions, set by {field}\); raise {field},"):
        check_lengths(cfg, limit + 1)
    raised = apply_overrides(cfg, {field.removeprefix("model."): str(2 * (limit + 1))})
    check_lengths(raised, limit + 1)  # the named fix works


def test_train_config_checks():
    with pytest.raises(ConfigError, match="train.warmup_steps"):
        TrainConfig(steps=10, warmup_steps=10)
    with pytest.raises(ConfigError, match="train.batch_size=0"):
        TrainConfig(batch_size=0)
    with pytest.raises(ConfigError, match="train.bos_per_row=True: applies to text"):
        TrainConfig(task="copy", bos_per_row=True)
    with pytest.raises(ConfigError, match="train.shuffle_rows=-1: must be >= 0"):
        TrainConfig(shuffle_rows=-1)
    with pytest.raises(ConfigError, match="train.shuffle_rows=64: applies to text"):
        TrainConfig(task="copy", shuffle_rows=64)
    # the default follows the data kind, also across replace()
    text, task = TrainConfig(), TrainConfig(task="copy")
    assert (text.shuffle_rows, task.shuffle_rows) == (SHUFFLE_ROWS, 0)
    assert text.replace(task="copy").shuffle_rows == 0
    assert task.replace(task=None).shuffle_rows == SHUFFLE_ROWS
    assert text.replace(shuffle_rows=0).replace(steps=3).shuffle_rows == 0


def test_overrides_coerce_types_and_nest():
    cfg = apply_overrides(
        ModelConfig(),
        {"d_model": "64", "qk_norm": "true", "n_kv_heads": "2", "position.scaling": "linear",
         "position.scaling.factor": "4", "attn_logit_softcap": "none", "attention": "chunked",
         "attention.chunk_size": "32"},
    )
    assert cfg.d_model == 64 and cfg.qk_norm is True and cfg.n_kv_heads == 2
    assert cfg.position.scaling.name == "linear" and cfg.position.scaling.factor == 4.0
    assert cfg.attention.name == "chunked" and cfg.attention.chunk_size == 32
    # a switch and its fields in one go; a field of another entry is refused by name
    t5 = apply_overrides(ModelConfig(), {"position": "t5", "position.num_buckets": "16"})
    assert (t5.position.name, t5.position.num_buckets) == ("t5", 16)
    with pytest.raises(ConfigError, match=r"position=rope has no setting num_buckets \(its "
                                          r"settings: base, fraction, pairing, scaling\); "
                                          r"num_buckets is a setting of t5: choose one first, "
                                          r"e.g. --position=t5 --position.num_buckets=\.\.\."):
        apply_overrides(ModelConfig(), {"position.num_buckets": "16"})
    with pytest.raises(ConfigError, match=r"position=alibi has no setting scaling \(it has no "
                                          r"settings\); scaling is a setting of rope, xpos"):
        apply_overrides(ModelConfig(), {"position": "alibi", "position.scaling": "yarn"})
    with pytest.raises(ConfigError, match=r"attention=xla has no setting chunk \(it has no "
                                          r"settings\); did you mean chunk_size, a setting of "
                                          r"chunked\?"):
        apply_overrides(ModelConfig(), {"attention.chunk": "3"})
    # the flat fields of older versions point to their new place
    with pytest.raises(ConfigError, match="moved into its switch; use --model.mask.window"):
        apply_overrides(ModelConfig(), {"window": "16"}, "model.")
    with pytest.raises(ConfigError, match="--model.position.FIELD"):
        apply_overrides(ModelConfig(), {"rope.base": "500"}, "model.")
    assert cfg.attn_logit_softcap is None
    with pytest.raises(ConfigError, match="unknown option --nonsense"):
        apply_overrides(ModelConfig(), {"nonsense": "1"})
    with pytest.raises(ConfigError, match="unknown option --model.d_modle; did you mean "
                                          "--model.d_model?"):
        apply_overrides(ModelConfig(), {"d_modle": "1"}, "model.")
    with pytest.raises(ConfigError, match="expected a whole number, e.g. 64"):
        apply_overrides(ModelConfig(), {"d_model": "wide"})


def test_cli_builds_both_sections():
    model, train = build_configs(
        ["--model.position=rope", "--model.position.base", "500", "--steps", "7", "--json",
         "--train.learning_rate=1e-3", "--train.warmup_steps=2"]
    )
    assert model.position.name == "rope" and model.position.base == 500.0
    assert model.vocab_size == 262  # follows the byte tokenizer
    assert train.steps == 7 and train.json and train.learning_rate == 1e-3
    with pytest.raises(ConfigError, match="use --model.FIELD or --train.FIELD"):
        build_configs(["--d_model=3"])


def test_round_trip_through_dict():
    cfg = ModelConfig(position=Rope(scaling={"name": "yarn", "factor": 4.0}),
                      mask={"name": "sliding_window", "window": 8}, attention="chunked")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_configs_written_before_the_switches_carried_settings_migrate():
    """A run directory's config.json from before the registry refactor (flat rope, window,
    t5_* and attention_chunk fields) loads as the same model."""
    old = {"family": "gpt", "position": "rope", "mask": "sliding_window", "window": 16,
           "attention": "chunked", "attention_chunk": 64, "t5_num_buckets": 32,
           "t5_max_distance": 128, "fire_hidden": 32,
           "rope": {"base": 500.0, "pairing": "rotate_half", "fraction": 1.0,
                    "scaling": "llama3", "factor": 8.0, "original_max_len": 64,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "beta_fast": 32.0,
                    "beta_slow": 1.0}}
    cfg = ModelConfig.from_dict(old)
    assert cfg.position == Rope(base=500.0, scaling={"name": "llama3", "factor": 8.0,
                                                      "original_max_len": 64})
    assert cfg.mask.window == 16 and cfg.attention.chunk_size == 64
    t5 = ModelConfig.from_dict({**old, "position": "t5", "t5_num_buckets": 16, "mask": "causal"})
    assert (t5.position.num_buckets, t5.position.max_distance, t5.mask.name) == (16, 128, "causal")


@pytest.mark.parametrize(("position", "field"), [
    ({"name": "t5", "max_distance": 128}, "position.max_distance=128"),
    ({"name": "fire", "init_threshold": 512.0}, "position.init_threshold=512")])
def test_bias_settings_beyond_the_training_length_warn(position, field):
    cfg = ModelConfig(position=position)
    with pytest.warns(UserWarning, match=field):
        check_lengths(cfg, 64)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_lengths(cfg, 512)  # the whole range trains


def test_sinusoidal_saved_before_its_form_loads_as_it_was_trained():
    old = ModelConfig(position="rope").to_dict() | {"position": {"name": "sinusoidal"}}
    assert ModelConfig.from_dict(old).position.form == "rms"
    new = ModelConfig(position="sinusoidal")
    assert new.position.form == "vaswani"
    assert ModelConfig.from_dict(new.to_dict()) == new  # round trip keeps the form
