"""Fuzzed inputs (issue 15): configurations, sampling options and prompts, damaged Hugging Face
files. Every drawn input either works (validates; for tiny models: one forward pass and one
train step with a finite loss) or fails with the project's own error naming the field or file:
never another exception, never a hang, never a NaN.

Reproducible: ``derandomize=True`` (the examples are a function of the test), no example
database. ``TJAX_FUZZ_STATS=FILE`` writes how many inputs each category tried (README figures).
How many each test draws: ``profiles.examples`` -- CI's number by default, the full search with
``TJAX_TEST_PROFILE=thorough``. The tests that compile or train (tiny models, sampling, the
CLI on a trained run) are left out of the quick tier (``slow``).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from profiles import examples

from transformers_jax.config import ConfigError, ModelConfig, TrainConfig, apply_overrides
from transformers_jax.config import check_lengths as check_seq_len
from transformers_jax.registry import (
    ATTENTION,
    FAMILIES,
    MASKS,
    MLPS,
    NORM_PLACEMENTS,
    NORMS,
    POSITIONS,
    UnknownNameError,
)

SETTINGS = dict(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Inputs tried per category and how each ended (written at exit when TJAX_FUZZ_STATS is set).
TRIED: collections.Counter = collections.Counter()


def _write_stats() -> None:
    path = os.environ.get("TJAX_FUZZ_STATS")
    if path and TRIED:
        with open(path, "w") as f:
            json.dump(dict(sorted(TRIED.items())), f, indent=1)


atexit.register(_write_stats)

CONFIG_ERRORS = (ConfigError, UnknownNameError)


def _field_names() -> set[str]:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    names |= {"train." + f.name for f in dataclasses.fields(TrainConfig)}
    for registry in (POSITIONS, MASKS, ATTENTION, NORMS):
        for _, cls in registry.items():
            names |= {f.name for f in dataclasses.fields(cls) if f.init}
    return names - {"name"}


FIELD_NAMES = _field_names()


def assert_names_a_field(error: Exception) -> None:
    message = str(error)
    assert any(name in message for name in FIELD_NAMES), f"error names no field: {message}"


# Strategies: command-line strings (what the CLI passes) -------------------------------------

GARBAGE = st.sampled_from(["", "abc", "1.5", "nan", "inf", "-inf", "1e3", "None", "[]", "{}",
                           "0x10", " 7", "true", "\x00", "é"])
INT_TEXT = st.one_of(st.integers(-3, 40).map(str), st.integers().map(str), GARBAGE)
FLOAT_TEXT = st.one_of(st.floats(-2, 2).map(repr), st.floats().map(repr),
                       st.sampled_from(["0", "-0.0", "1e-9", "1e30", "nan", "inf", "-inf"]),
                       GARBAGE)
BOOL_TEXT = st.sampled_from(["true", "false", "1", "0", "yes", "maybe", ""])


def names_of(registry) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(registry.names()),
                     st.sampled_from(["", "ROPE", "rope ", "bogus", "none2", "{}", "causal\n"]))


# (field, strategy) for each ModelConfig field; switch settings as "position.num_buckets" etc.
MODEL_TEXT = {
    "family": names_of(FAMILIES),
    "vocab_size": INT_TEXT, "d_model": INT_TEXT, "n_layers": INT_TEXT, "n_heads": INT_TEXT,
    "n_kv_heads": st.one_of(INT_TEXT, st.just("none")),
    "head_dim": st.one_of(INT_TEXT, st.just("none")),
    "d_ff": st.one_of(INT_TEXT, st.just("none")),
    "max_len": INT_TEXT, "type_vocab_size": INT_TEXT,
    "n_decoder_layers": st.one_of(INT_TEXT, st.just("none")),
    "position": names_of(POSITIONS), "mask": names_of(MASKS), "attention": names_of(ATTENTION),
    "position.num_buckets": INT_TEXT, "position.max_distance": INT_TEXT,
    "position.hidden": INT_TEXT, "position.base": FLOAT_TEXT, "position.fraction": FLOAT_TEXT,
    "position.max_position": INT_TEXT, "position.scaling": st.sampled_from(
        ["none", "linear", "ntk", "yarn", "llama3", "dynamic_ntk", "bogus"]),
    "position.scaling.factor": FLOAT_TEXT,
    "mask.window": st.one_of(INT_TEXT, st.just("none")),
    "attention.chunk_size": INT_TEXT,
    "norm": st.sampled_from(["layernorm", "rmsnorm", "batchnorm", ""]),
    "norm.eps": FLOAT_TEXT, "norm_eps": FLOAT_TEXT,  # the old spelling: refused, naming norm.eps
    "norm_position": names_of(NORM_PLACEMENTS), "mlp": names_of(MLPS),
    "use_bias": BOOL_TEXT, "tie_embeddings": BOOL_TEXT, "qk_norm": BOOL_TEXT,
    "dropout": FLOAT_TEXT,
    "attn_logit_softcap": st.one_of(FLOAT_TEXT, st.just("none")),
    "final_logit_softcap": st.one_of(FLOAT_TEXT, st.just("none")),
    "attention_scale": st.one_of(FLOAT_TEXT, st.just("none")),
    "init_std": FLOAT_TEXT,
    "dtype": st.sampled_from(["float32", "bfloat16", "float16", "float64", "int8"]),
    "param_dtype": st.sampled_from(["float32", "bfloat16", "float8"]),
    "remat": st.sampled_from(["none", "full", "dots_saveable", "everything"]),
    "scan_layers": BOOL_TEXT,
}
TRAIN_TEXT = {
    "steps": INT_TEXT, "batch_size": INT_TEXT, "seq_len": INT_TEXT,
    "learning_rate": FLOAT_TEXT, "min_lr_ratio": FLOAT_TEXT,
    "warmup_steps": st.one_of(INT_TEXT, st.just("none")),
    "schedule_steps": st.one_of(INT_TEXT, st.just("none")),
    "weight_decay": FLOAT_TEXT, "b1": FLOAT_TEXT, "b2": FLOAT_TEXT, "grad_clip": FLOAT_TEXT,
    "seed": INT_TEXT, "tokenizer": st.sampled_from(["byte", "char", "sentencepiece", "gpt2"]),
    "pack": st.sampled_from(["concat", "first_fit", "none", "best_fit"]),
    "train_lengths": st.sampled_from(["1,20", "5,3", "0,4", "1", "1,2,3", "a,b", "", "-1,2"]),
    "test_lengths": st.sampled_from(["21,80", "80,21", "x", "3,3"]),
    "val_fraction": FLOAT_TEXT, "eval_every": INT_TEXT, "eval_batches": INT_TEXT,
    "log_every": INT_TEXT, "checkpoint_every": INT_TEXT, "keep_checkpoints": INT_TEXT,
    "skip_nonfinite_steps": INT_TEXT, "accept_data_change": BOOL_TEXT,
    "mlm_rate": FLOAT_TEXT, "mlm_mask_fraction": FLOAT_TEXT, "mlm_random_fraction": FLOAT_TEXT,
    "strategy": st.sampled_from(["single", "pmap", "shard_map", "jit", "ddp"]),
    "mesh": st.sampled_from(["none", "data=2", "garbage"]),
    "grad_accum": INT_TEXT, "coordinator": st.sampled_from(["none", "127.0.0.1:1234"]),
    "context_attention": st.sampled_from(["all_gather", "ring", "ring_zigzag", "zigzag"]),
    "num_processes": st.one_of(INT_TEXT, st.just("none")),
    "process_id": st.one_of(INT_TEXT, st.just("none")),
    "profile": st.sampled_from(["none", "1:2", "0:1", "5", "a:b", "3:0", "-1:2", "1:2:3", "",
                                ":", "10000:1", " 2 : 3"]),
    "init_from": st.sampled_from(["none", "runs/base"]),
    "lora.rank": st.one_of(INT_TEXT, st.just("none")),
    "lora.alpha": st.one_of(FLOAT_TEXT, st.just("none")),
    "lora.targets": st.sampled_from(["query,value", "attention,mlp", "", ",", "layer_0/*", "q"]),
    "lora.dropout": FLOAT_TEXT,  # not a field: refused, naming the fields there are
}


def overrides(table: dict) -> st.SearchStrategy[dict[str, str]]:
    return st.dictionaries(st.sampled_from(sorted(table)), st.just(None), max_size=6).flatmap(
        lambda keys: st.fixed_dictionaries({k: table[k] for k in keys}))


def build(model_text: dict[str, str], train_text: dict[str, str]):
    """What the CLI does with ``--model.K=V`` and ``--train.K=V``: the configs, or the error."""
    model = apply_overrides(ModelConfig(), model_text, "model.")
    train = apply_overrides(TrainConfig(), train_text, "train.")
    check_seq_len(model, train.seq_len)
    return model, train


@settings(max_examples=examples(ci=100, thorough=400), **SETTINGS)
@given(overrides(MODEL_TEXT), overrides(TRAIN_TEXT))
@example({"d_model": "nan"}, {})
@example({}, {"learning_rate": "nan"})
@example({"position": "t5", "position.num_buckets": "-1"}, {})
def test_cli_overrides_validate_or_name_a_field(model_text, train_text):
    TRIED["config: CLI overrides (strings), validation"] += 1
    try:
        build(model_text, train_text)
    except CONFIG_ERRORS as error:
        assert_names_a_field(error)
        TRIED["config: CLI overrides, refused with ConfigError"] += 1


# Python values straight into the dataclasses: wrong types included --------------------------

ANY_INT = st.one_of(st.integers(-3, 40), st.integers(), st.sampled_from(["8", "x", 2.5, None,
                                                                           True, math.nan]))
ANY_FLOAT = st.one_of(st.floats(-2, 2), st.floats(), st.sampled_from(["0.1", None, 3]))
SWITCH_VALUE = {
    "position": st.one_of(names_of(POSITIONS), st.fixed_dictionaries({
        "name": st.sampled_from(["t5", "rope", "fire", "randomized", "bogus"])}, optional={
        "num_buckets": ANY_INT, "max_distance": ANY_INT, "hidden": ANY_INT,
        "max_position": ANY_INT, "base": ANY_FLOAT, "fraction": ANY_FLOAT,
        "junk": st.just(1)}), st.sampled_from([3, None, {"num_buckets": 3}, {"name": 5}])),
    "mask": st.one_of(names_of(MASKS), st.fixed_dictionaries(
        {"name": st.sampled_from(["sliding_window", "causal"])}, optional={"window": ANY_INT})),
    "attention": st.one_of(names_of(ATTENTION), st.fixed_dictionaries(
        {"name": st.sampled_from(["chunked", "xla"])}, optional={"chunk_size": ANY_INT})),
    "norm": st.one_of(names_of(NORMS), st.fixed_dictionaries(
        {"name": st.sampled_from(["layernorm", "rmsnorm", "bogus"])},
        optional={"eps": ANY_FLOAT, "junk": st.just(1)}), st.sampled_from([3, None, {}])),
    "norm_position": st.one_of(names_of(NORM_PLACEMENTS), st.sampled_from([{"name": "pre"}, 2])),
    "mlp": st.one_of(names_of(MLPS), st.sampled_from([{"name": "swiglu"}, {"name": 1}])),
}
MODEL_KWARGS = {
    **{name: ANY_INT for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                  "head_dim", "d_ff", "max_len", "type_vocab_size",
                                  "n_decoder_layers")},
    **{name: ANY_FLOAT for name in ("dropout", "attn_logit_softcap",
                                    "final_logit_softcap", "attention_scale", "init_std")},
    **{name: st.sampled_from([True, False, 1, "yes", None]) for name in
       ("use_bias", "tie_embeddings", "qk_norm", "scan_layers")},
    **SWITCH_VALUE,
    "family": st.one_of(names_of(FAMILIES), st.just(3)),
    "dtype": st.sampled_from(["float32", "bfloat16", 32, None]),
}


@settings(max_examples=examples(ci=100, thorough=400), **SETTINGS)
@given(overrides(MODEL_KWARGS))
@example({"d_model": "32"})
@example({"init_std": math.nan})
def test_model_config_kwargs_validate_or_name_a_field(kwargs):
    TRIED["config: ModelConfig(**kwargs) (any Python values), validation"] += 1
    try:
        ModelConfig(**kwargs)
    except CONFIG_ERRORS as error:
        assert_names_a_field(error)
        TRIED["config: ModelConfig(**kwargs), refused with ConfigError"] += 1


# Tiny models: validate, then one forward pass and one train step with a finite loss ---------

TRAINABLE_ATTENTION = ["xla", "reference", "chunked"]  # cudnn/pallas: no CPU kernel
TINY_MODEL = {
    "family": st.sampled_from(FAMILIES.names()),
    "vocab_size": st.sampled_from([1, 16, 33]),
    "d_model": st.sampled_from([0, 8, 16, 32]),
    "n_heads": st.sampled_from([1, 2, 3, 4]),
    "n_kv_heads": st.sampled_from([None, 1, 2, 3]),
    "max_len": st.sampled_from([4, 8, 16]),
    "position": st.one_of(st.sampled_from(POSITIONS.names()), st.fixed_dictionaries(
        {"name": st.just("t5")}, optional={"num_buckets": st.sampled_from([-1, 0, 1, 2, 32]),
                                           "max_distance": st.sampled_from([0, 1, 4, 128])}),
        st.fixed_dictionaries({"name": st.just("rope")}, optional={
            "fraction": st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5]),
            "base": st.sampled_from([-1.0, 0.0, 1.0, 10000.0])}),
        st.fixed_dictionaries({"name": st.just("fire")}, optional={
            "hidden": st.sampled_from([0, 1, 4])}),
        st.fixed_dictionaries({"name": st.just("randomized")}, optional={
            "max_position": st.sampled_from([0, 4, 64])})),
    "mask": st.one_of(st.sampled_from(MASKS.names()), st.fixed_dictionaries(
        {"name": st.just("sliding_window"), "window": st.sampled_from([-1, 0, 1, 3, 64])})),
    "attention": st.one_of(st.sampled_from(TRAINABLE_ATTENTION), st.fixed_dictionaries(
        {"name": st.just("chunked"), "chunk_size": st.sampled_from([-4, 0, 1, 3, 8, 100])})),
    "norm": st.fixed_dictionaries({"name": st.sampled_from(NORMS.names())}, optional={
        "eps": st.sampled_from([-1.0, 0.0, 1e-6, 1e-5, 10.0])}),  # every registered norm
    "norm_position": st.sampled_from(NORM_PLACEMENTS.names()),
    "mlp": st.sampled_from(list(MLPS)),  # every registered MLP
    "use_bias": st.booleans(), "tie_embeddings": st.booleans(), "qk_norm": st.booleans(),
    "dropout": st.sampled_from([0.0, 0.1, 0.5, 1.0, -0.1]),
    "attn_logit_softcap": st.sampled_from([None, -1.0, 0.5, 50.0]),
    "final_logit_softcap": st.sampled_from([None, 0.0, 30.0]),
    "attention_scale": st.sampled_from([None, -1.0, 0.0, 1.0]),
    "init_std": st.sampled_from([-0.02, 0.0, 0.02, 1.0]),
    "dtype": st.sampled_from(["float32", "bfloat16"]),
    "type_vocab_size": st.sampled_from([0, 2]),
    "scan_layers": st.booleans(),
    "remat": st.sampled_from(["none", "full"]),
}
TINY_TRAIN = {
    "seq_len": st.sampled_from([1, 2, 5, 8, 16]),
    "learning_rate": st.sampled_from([1e-3, 1.0, 1e6]),
    "b1": st.sampled_from([0.0, 0.9, 1.0, 1.5, -0.1]),
    "b2": st.sampled_from([0.95, 1.0, 2.0]),
    "weight_decay": st.sampled_from([0.0, 0.1, -1.0]),
    "grad_clip": st.sampled_from([-1.0, 0.0, 1.0]),
    "warmup_steps": st.sampled_from([None, 0, 1]),
}


def tiny_batch(model_cfg: ModelConfig, seq_len: int) -> dict:
    from transformers_jax.models import family_of

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, model_cfg.vocab_size, (2, seq_len + 1)), jnp.int32)
    inputs = tokens[:, :-1]
    return {"inputs": inputs, "targets": tokens[:, 1:],
            "weights": jnp.ones(inputs.shape, jnp.float32),
            **family_of(model_cfg).inputs_for(model_cfg, inputs)}


_STEPS: dict = {}  # (model config, train config) -> jitted (init + forward, step)


def jitted_steps(model_cfg: ModelConfig, train_cfg: TrainConfig):
    """``(start, step)``: ``start(batch) -> (state, forward pass of the initial params over the
    batch)``, one program (initialising traces the forward pass anyway), and the train step."""
    from transformers_jax.learning.objectives import objective_for
    from transformers_jax.learning.optim import make_optimizer
    from transformers_jax.learning.step import init_state, make_train_step
    from transformers_jax.models import build_model

    key = (model_cfg, train_cfg)
    if key not in _STEPS:
        model = build_model(model_cfg)
        objective = objective_for(model_cfg.family)
        optimizer = make_optimizer(train_cfg)

        def start(batch):
            state = init_state(model, optimizer, 0, batch, objective)
            out = model.apply({"params": state.params}, batch["inputs"],
                              **objective.inputs(batch))
            return state, out

        _STEPS[key] = (jax.jit(start),
                       jax.jit(make_train_step(model, optimizer, objective=objective)))
    return _STEPS[key]


@pytest.mark.slow
@settings(max_examples=examples(ci=12, thorough=40), **SETTINGS)
@given(overrides({**TINY_MODEL}).map(lambda d: d), st.fixed_dictionaries({}, optional=TINY_TRAIN))
@example({"norm": {"name": "rmsnorm", "eps": -1.0}}, {})
@example({}, {"b1": 1.5})
def test_tiny_configs_train_one_finite_step_or_name_a_field(model_kwargs, train_kwargs):
    TRIED["config: tiny models, validate + forward + train step"] += 1
    model_kwargs = {"d_model": 16, "n_heads": 2, "vocab_size": 16, "max_len": 16,
                    **model_kwargs, "n_layers": 1}
    try:
        model_cfg = ModelConfig(**model_kwargs)
        train_cfg = TrainConfig(**{"steps": 10, "batch_size": 2, "seq_len": 8, **train_kwargs})
        check_seq_len(model_cfg, train_cfg.seq_len)
    except CONFIG_ERRORS as error:
        assert_names_a_field(error)
        TRIED["config: tiny models, refused with ConfigError"] += 1
        return
    start, step = jitted_steps(model_cfg, train_cfg)
    batch = tiny_batch(model_cfg, train_cfg.seq_len)
    state, out = start(batch)
    assert np.isfinite(np.asarray(out, np.float32)).all(), "forward pass is not finite"
    state, metrics = step(state, batch)
    assert math.isfinite(float(metrics["loss"])), f"loss {float(metrics['loss'])}"
    assert math.isfinite(float(metrics["grad_norm"])), f"grad norm {metrics['grad_norm']}"
    params = jax.tree_util.tree_leaves(state.params)
    assert all(np.isfinite(np.asarray(p, np.float32)).all() for p in params), "params not finite"
    TRIED["config: tiny models, trained one finite step"] += 1


# Sampling options and prompts ---------------------------------------------------------------

_SAMPLERS: dict = {}


def tiny_sampler(position: str):
    """A tiny untrained byte-level GPT (16 positions for the learned table)."""
    if position not in _SAMPLERS:
        from transformers_jax.models import build_model

        cfg = ModelConfig(vocab_size=262, d_model=16, n_layers=1, n_heads=2, max_len=16,
                          position=position)
        model = build_model(cfg)
        params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
        _SAMPLERS[position] = (model, params)
    return _SAMPLERS[position]


def mostly(valid, invalid):
    """``valid`` three times in four, so that whole valid combinations are drawn too."""
    return st.one_of(valid, valid, valid, invalid)


SAMPLING_NAMES = ("max_new_tokens", "temperature", "top_k", "top_p", "prompt", "max_len")
PROMPTS = st.one_of(st.binary(min_size=1, max_size=24),  # arbitrary bytes, mostly not UTF-8
                    st.binary(max_size=24),
                    st.text(max_size=12),  # lone surrogates included (argv's undecodable bytes)
                    st.just(b""), st.just(b"\xff\xfe\x00"))


@pytest.mark.slow
@settings(max_examples=examples(ci=20, thorough=60), **SETTINGS)
@given(position=st.sampled_from(["learned", "rope"]), prompt=PROMPTS,
       max_new_tokens=mostly(st.integers(1, 12), st.integers(-2, 0) | st.sampled_from(
           [2.5, "3", None])),
       temperature=mostly(st.floats(0, 3), st.floats()),
       top_k=mostly(st.none() | st.integers(1, 300), st.integers(-2, 0) | st.just(1.5)),
       top_p=mostly(st.none() | st.floats(0.01, 1), st.floats(-0.5, 1.5) | st.floats()))
@example(position="learned", prompt=b"x" * 20, max_new_tokens=2, temperature=1.0, top_k=None,
         top_p=None)  # longer than the learned table
@example(position="rope", prompt="\udcff", max_new_tokens=2, temperature=1.0, top_k=None,
         top_p=None)  # an undecodable argv byte
@example(position="rope", prompt=b"ab", max_new_tokens=2, temperature=math.nan, top_k=None,
         top_p=None)
def test_sampling_options_and_prompts(position, prompt, max_new_tokens, temperature, top_k,
                                      top_p):
    from transformers_jax.data.tokenizers import ByteTokenizer
    from transformers_jax.sample import SamplingConfig, generate

    TRIED["sample: options x prompts (generate on a tiny model)"] += 1
    tokenizer = ByteTokenizer()
    model, params = tiny_sampler(position)
    try:
        tokens = [int(t) for t in tokenizer.encode(prompt)]
        cfg = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p)
        out = generate(model, params, [tokens], cfg)
    except ValueError as error:
        assert any(name in str(error) for name in SAMPLING_NAMES), str(error)
        TRIED["sample: refused with ValueError naming the option/prompt"] += 1
        return
    assert len(out) == 1 and 1 <= len(out[0]) <= max_new_tokens
    assert all(0 <= t < 262 for t in out[0]), out
    tokenizer.decode(out[0])  # never raises
    TRIED["sample: generated"] += 1


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 2-step byte-level run with a learned 32-row position table, checkpointed."""
    from transformers_jax.train.loop import train

    run_dir = tmp_path_factory.mktemp("fuzz_run") / "run"
    train(ModelConfig(d_model=16, n_layers=1, n_heads=2, max_len=32, position="learned"),
          TrainConfig(steps=2, batch_size=2, seq_len=16, eval_every=2, eval_batches=1,
                      log_every=1, checkpoint_every=2, run_dir=str(run_dir), progress=False),
          auto_vocab=True)
    return str(run_dir)


def run_cli(argv: list[str]):
    """``tjax ARGV`` in this process: (exit code, captured stdout, captured stderr)."""
    import contextlib
    import io

    from transformers_jax.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exit_:  # argparse: a value of the wrong type
            rc = exit_.code
    return rc, out, err


CLI_VALUE = st.one_of(st.integers(-3, 40).map(str), st.floats().map(repr), GARBAGE)
CLI_OPTIONS = {"--max-new-tokens": mostly(st.integers(1, 8).map(str), CLI_VALUE),
               "--temperature": mostly(st.floats(0, 2).map(repr), CLI_VALUE),
               "--top-k": mostly(st.integers(1, 300).map(str), CLI_VALUE),
               "--top-p": mostly(st.floats(0.01, 1).map(repr), CLI_VALUE),
               "--num-samples": st.sampled_from(["0", "-1", "1", "2"]),
               "--step": st.sampled_from(["2", "2", "0", "7", "-1"]),
               "--prompt": st.one_of(st.text(max_size=40), st.binary(max_size=40).map(
                   lambda b: b.decode("utf-8", "surrogateescape")))}


@pytest.mark.slow
@settings(max_examples=examples(ci=12, thorough=40), **SETTINGS)
@given(overrides(CLI_OPTIONS))
@example({"--prompt": "x" * 40})  # longer than the 32 learned positions
@example({"--num-samples": "0"})
@example({"--temperature": "nan"})
def test_cli_sample_bad_options_exit_2_with_a_message(tiny_run, options):


    TRIED["sample: `tjax sample` command lines on a trained run"] += 1
    argv = ["sample", "--run", tiny_run, "--max-new-tokens", "4"]
    for key, value in options.items():
        argv += [f"{key}={value}"]
    rc, out, err = run_cli(argv)
    assert rc in (0, 2), (rc, err.getvalue())
    if rc == 2:
        assert "error:" in err.getvalue() and "Traceback" not in err.getvalue(), err.getvalue()
        TRIED["sample: `tjax sample` refused (exit 2, message)"] += 1
    else:
        TRIED["sample: `tjax sample` sampled"] += 1


EVAL_LENGTHS = st.sampled_from(["16", "8,16", "2", "1", "0", "-4", "33", "64", "a,b", "",
                                 "16,,8", "16,16", "nan", " 8"])
EVAL_OPTIONS = {"--lengths": mostly(st.sampled_from(["16", "8,16", "4"]), EVAL_LENGTHS),
                "--batches": mostly(st.sampled_from(["1", "2"]), CLI_VALUE),
                "--passkey": st.sampled_from([None, None, "1"]),  # None: the bare flag
                "--passkey-lengths": EVAL_LENGTHS,
                "--passkey-trials": mostly(st.sampled_from(["1"]), CLI_VALUE),
                "--step": st.sampled_from(["2", "2", "0", "7", "-1", "x"]),
                "--data": st.sampled_from(["{text}", "lines:{text}", "{missing}", "lines:",
                                           "tfds:", "bogus:x", "{dir}", "{empty}",
                                           "{parquet}", "{body}", "{broken}", "{mixed}",
                                           "0.7*{text},0.3*{parquet}", "0.5*{text},{text}",
                                           "x*{text},1*{text}", "0*{text},1*{text}",
                                           "1*{text}", "1*{text},1*{missing}", "hf:",
                                           "hf:a:@", "hf:a/b/c"]),
                "--split": st.sampled_from(["validation", "", "train[:1]"]),
                "--plot": st.sampled_from(["{dir}/p.png", "{missing}/sub/p.png", ""]),
                "--out": st.sampled_from(["{dir}/e.json", "{missing}/sub/e.json"])}


@pytest.fixture(scope="module")
def eval_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_eval")
    (root / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    (root / "empty.txt").write_text("")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = ["the quick brown fox jumps over the lazy dog"] * 40
    pq.write_table(pa.table({"text": rows}), root / "rows.parquet")
    pq.write_table(pa.table({"body": rows, "title": rows}), root / "body.parquet")  # no 'text'
    (root / "broken.jsonl").write_text('{"text": "fine"}\n{"text": cut')
    (root / "mixed").mkdir()
    pq.write_table(pa.table({"text": rows}), root / "mixed" / "a.parquet")
    (root / "mixed" / "b.txt").write_text("plain text beside a parquet file")
    return {"text": str(root / "text.txt"), "empty": str(root / "empty.txt"),
            "missing": str(root / "missing"), "dir": str(root),
            "parquet": str(root / "rows.parquet"), "body": str(root / "body.parquet"),
            "broken": str(root / "broken.jsonl"), "mixed": str(root / "mixed")}


@pytest.mark.slow
@settings(max_examples=examples(ci=8, thorough=30), **SETTINGS)
@given(overrides(EVAL_OPTIONS))
@example({})
@example({"--lengths": "8,16", "--data": "{text}", "--batches": "1"})
@example({"--passkey": None})  # 32 learned positions: too short for a byte passkey prompt
@example({"--lengths": "64"})  # longer than the learned position table
@example({"--passkey-trials": "0", "--passkey": None, "--passkey-lengths": "16"})
@example({"--data": "{empty}"})
@example({"--data": "0.7*{text},0.3*{parquet}", "--lengths": "16"})
@example({"--data": "x*{text},1*{text}"})
@example({"--data": "{body}"})
@example({"--data": "{broken}"})
def test_cli_eval_bad_options_exit_2_with_a_message(tiny_run, eval_files, options):
    """`tjax eval` on a trained run: every option combination evaluates (one JSON object on
    stdout, finite figures) or exits 2 with a one-line error, never a traceback."""


    TRIED["eval: `tjax eval` command lines on a trained run"] += 1
    argv = ["eval", "--run", tiny_run, "--batches", "1", "--json"]
    for key, value in options.items():
        argv += [key] if value is None else [f"{key}={value.format(**eval_files)}"]
    rc, out, err = run_cli(argv)
    assert rc in (0, 2), (argv, rc, err.getvalue()[-2000:])
    if rc == 2:
        message = err.getvalue()
        assert "error:" in message and "Traceback" not in message, message
        # the message names the option at fault (argparse says "argument --x") or its value
        named = [key.lstrip("-") for key in [*options, "--batches"]]
        named += [v.format(**eval_files) for v in options.values() if v]
        assert any(name in message for name in named), message
        TRIED["eval: `tjax eval` refused (exit 2, message)"] += 1
        return
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    assert math.isfinite(result["loss"]) and result["loss"] > 0, result
    assert all(math.isfinite(e["loss"]) for e in result["by_length"]), result
    for cell in result.get("passkey", {}).get("cells", []):
        assert 0 <= cell["accuracy"] <= 1 and cell["trials"], cell
    TRIED["eval: `tjax eval` evaluated"] += 1


# The Hugging Face converter given damaged files ---------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny GPT-2 checkpoint in Hugging Face layout, written by our own exporter (no torch)."""
    from transformers_jax.convert import save_hf
    from transformers_jax.models import build_model

    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=16,
                      position="learned", mlp="gelu")
    import flax.linen as nn

    params = nn.meta.unbox(build_model(cfg).init(jax.random.key(0),
                                                 jnp.zeros((1, 4), jnp.int32))["params"])
    directory = tmp_path_factory.mktemp("hf") / "gpt2"
    save_hf(str(directory), cfg, params, architecture="gpt2")
    return directory


def convert_damaged(hf_dir, tmp_path_factory, damage) -> None:
    """Copy ``hf_dir``, apply ``damage(directory)``, convert: returns or raises."""
    import shutil

    from transformers_jax.convert import load_hf

    directory = tmp_path_factory.mktemp("damaged") / "gpt2"
    shutil.copytree(hf_dir, directory)
    damage(directory)
    load_hf(str(directory))


def assert_conversion_error_names(error: Exception, *names: str) -> None:
    from transformers_jax.convert import ConversionError

    assert isinstance(error, ConversionError), f"{type(error).__name__}: {error}"
    assert any(name in str(error) for name in names), str(error)


JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.integers(),
                        st.floats(), st.text(max_size=5), st.lists(st.integers(), max_size=2),
                        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=examples(ci=30, thorough=80), **SETTINGS)
@given(how=st.sampled_from(["truncate", "garbage", "retype", "drop"]), where=st.floats(0, 1),
       value=JSON_VALUES, junk=st.binary(min_size=1, max_size=16))
@pytest.mark.slow
@example(how="truncate", where=0.5, value=None, junk=b"x")
@example(how="retype", where=0.0, value="abc", junk=b"x")
@example(how="retype", where=0.5, value=False, junk=b"x")  # n_embd: false (named d_model once)
def test_converter_damaged_config_json(hf_dir, tmp_path_factory, how, where, value, junk):
    from transformers_jax.convert import ConversionError

    TRIED["convert: damaged config.json"] += 1
    text = (hf_dir / "config.json").read_text()
    keys = sorted(json.loads(text))
    key = keys[int(where * (len(keys) - 1))]

    def damage(directory):
        path = directory / "config.json"
        if how == "truncate":
            path.write_text(text[: int(where * len(text))])
        elif how == "garbage":
            path.write_bytes(junk + text.encode()[len(junk):])
        else:
            data = json.loads(text)
            if how == "retype":
                data[key] = value
            else:
                del data[key]
            path.write_text(json.dumps(data))

    try:
        convert_damaged(hf_dir, tmp_path_factory, damage)
    except ConversionError as error:
        assert_conversion_error_names(error, "config.json", key)
        TRIED["convert: damaged config.json, refused with ConversionError"] += 1
    except Exception as error:  # noqa: BLE001 (the wrong error type is the finding)
        pytest.fail(f"{how} {key}={value!r}: {type(error).__name__}: {error}")


@settings(max_examples=examples(ci=30, thorough=60), **SETTINGS)
@given(how=st.sampled_from(["truncate", "flip_header", "header_len", "shape", "offsets",
                            "dtype"]),
       where=st.floats(0, 1), byte=st.integers(0, 255))
@example(how="truncate", where=0.5, byte=0)
@example(how="shape", where=0.0, byte=3)
@example(how="flip_header", where=0.65625, byte=32)  # a tensor renamed
def test_converter_damaged_safetensors(hf_dir, tmp_path_factory, how, where, byte):
    import struct

    from transformers_jax.convert import ConversionError

    TRIED["convert: damaged model.safetensors"] += 1
    blob = (hf_dir / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    name = names[int(where * (len(names) - 1))]

    def damage(directory):
        path = directory / "model.safetensors"
        if how == "truncate":
            path.write_bytes(blob[: int(where * len(blob))])
        elif how == "flip_header":
            at = int(where * (8 + n - 1))
            path.write_bytes(blob[:at] + bytes([byte]) + blob[at + 1:])
        elif how == "header_len":
            path.write_bytes(struct.pack("<Q", n + byte * 1000 + 1) + blob[8:])
        else:
            edited = dict(header)
            info = dict(edited[name])
            if how == "shape":
                info["shape"] = [*info["shape"][:-1], info["shape"][-1] + byte % 5 + 1]
            elif how == "offsets":
                info["data_offsets"] = [byte * 64, byte * 64 - 4]
            else:
                info["dtype"] = ["F32", "F16", "I64", "Q4", 3][byte % 5]
            edited[name] = info
            text = json.dumps(edited).encode()
            path.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + n:])

    try:
        convert_damaged(hf_dir, tmp_path_factory, damage)
    except ConversionError as error:
        assert_conversion_error_names(error, "model.safetensors", name)
        TRIED["convert: damaged model.safetensors, refused with ConversionError"] += 1
    except Exception as error:  # noqa: BLE001 (the wrong error type is the finding)
        pytest.fail(f"{how} {name}: {type(error).__name__}: {error}")


# `tjax eval --lm-eval`: lm-eval tasks of every output type, written here (no hub access)

LM_EVAL_TASKS = {
    "fuzz_mc": """output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list: [{{metric: acc, higher_is_better: true}}]""",
    "fuzz_gen": """output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 4}}
metric_list: [{{metric: exact_match, higher_is_better: true}}]""",
    "fuzz_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{question}}}} {{{{choices[0]}}}}"
metric_list: [{{metric: bits_per_byte, higher_is_better: false}}]""",
}


@pytest.fixture(scope="module")
def lm_eval_files(tmp_path_factory, eval_files):
    pytest.importorskip("lm_eval")
    root = tmp_path_factory.mktemp("fuzz_lm_eval")
    rows = [{"question": "The for", "choices": [" statement", " xyzzy"], "answer": 0},
            {"question": "def f(x):" * 5, "choices": ["\n  return", " ???", "!"], "answer": 1}]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, body in LM_EVAL_TASKS.items():
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {root / 'rows.jsonl'}\ntest_split: test\n" + body.format() + "\n")
    return {**eval_files, "tasks": str(root)}


LM_EVAL_OPTIONS = {
    "--lm-eval": mostly(st.sampled_from(["fuzz_mc", "fuzz_gen", "fuzz_rolling",
                                         "fuzz_mc,fuzz_rolling"]),
                        st.sampled_from(["", ",", "fuzz_mcc", "fuzz_*", "no such task"])),
    "--include-path": mostly(st.just("{tasks}"), st.sampled_from(["{missing}", "{text}", ""])),
    "--limit": st.sampled_from(["1", "2", "0.5", "0", "-1", "1.5", "nan", "abc"]),
    "--num-fewshot": st.sampled_from(["0", "1", "-1", "x"]),
    "--batch-size": mostly(st.sampled_from(["1", "3"]), CLI_VALUE),
    "--max-length": st.sampled_from(["8", "16", "32", "33", "0", "x"]),
    "--max-gen-toks": st.sampled_from(["4", "16", "32", "0"]),
    "--step": st.sampled_from(["2", "7"]),
    "--lengths": st.sampled_from(["16"]),
}


@pytest.mark.slow
@settings(max_examples=examples(ci=2, thorough=6), **SETTINGS)
@given(overrides(LM_EVAL_OPTIONS))
@example({"--lm-eval": "fuzz_mc,fuzz_gen,fuzz_rolling", "--include-path": "{tasks}"})
@example({"--lm-eval": "fuzz_gen", "--include-path": "{tasks}", "--max-length": "8"})
@example({"--lm-eval": "fuzz_mcc", "--include-path": "{tasks}"})
def test_cli_eval_lm_eval_bad_options_exit_2_with_a_message(tiny_run, lm_eval_files, options):
    """`tjax eval --lm-eval` on a trained run (a 32-row learned position table): every option
    combination scores the tasks (finite figures) or exits 2 naming the option or value."""
    TRIED["eval: `tjax eval --lm-eval` command lines on a trained run"] += 1
    argv = ["eval", "--run", tiny_run, "--json"]
    options = {"--lm-eval": "fuzz_mc", **options}
    for key, value in options.items():
        argv += [f"{key}={value.format(**lm_eval_files)}"]
    from unittest import mock

    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_CACHE": os.path.join(lm_eval_files["tasks"], "cache")}
    with mock.patch.dict(os.environ, offline):
        rc, out, err = run_cli(argv)
    assert rc in (0, 2), (argv, rc, err.getvalue()[-2000:])
    if rc == 2:
        message = err.getvalue().strip().splitlines()[-1]
        assert "error:" in message and "Traceback" not in err.getvalue(), message
        named = [key.lstrip("-") for key in options]
        named += [v.format(**lm_eval_files) for v in options.values() if v]
        assert any(name in message for name in named), (argv, message)
        TRIED["eval: `tjax eval --lm-eval` refused (exit 2, message)"] += 1
        return
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    for scores in result["results"].values():
        figures = [v for k, v in scores.items() if "," in k and "stderr" not in k]
        assert figures and all(math.isfinite(v) for v in figures), scores
    TRIED["eval: `tjax eval --lm-eval` scored"] += 1
