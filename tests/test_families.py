"""Properties every registered model family must have, parametrised over the registry, so a new
family is covered the moment it is registered (``tests/test_recipes.py`` checks that): a finite,
deterministic forward pass with logits over the vocabulary; no leak from later tokens for the
families that read left to right; a short training run through the real loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformers_jax import ModelConfig
from transformers_jax.config import TrainConfig
from transformers_jax.registry import FAMILIES

NAMES = FAMILIES.names()
# read left to right: a causal mask and no encoder that sees the whole sequence
LEFT_TO_RIGHT = [name for name, f in FAMILIES.items()
                 if f.default_mask == "causal" and not f.cross_attention]


def tiny(name: str) -> ModelConfig:
    return ModelConfig(family=name, vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                       max_len=64, mask=FAMILIES.get(name).default_mask)


@functools.cache
def apply_fn(name: str, length: int = 12):
    """(``apply(tokens) -> logits``, example tokens ``[2, length]``) of family ``name``'s tiny
    model, built once per family; ``apply`` is compiled once (the parameters an argument)."""
    cfg, family = tiny(name), FAMILIES.get(name)
    tokens, inputs = family.example_inputs(cfg, length)
    tokens = (jnp.arange(2 * length, dtype=jnp.int32).reshape(2, length) * 7) % 64
    inputs = family.inputs_for(cfg, tokens)
    model = family.build(cfg)
    params = jax.jit(model.init)(jax.random.key(0), tokens, **inputs)["params"]
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t, **family.inputs_for(cfg, t)))
    return (lambda t: forward(params, t)), tokens


@pytest.mark.parametrize("family", NAMES)
def test_forward_is_finite_deterministic_and_over_the_vocabulary(family):
    apply, tokens = apply_fn(family)
    first, second = np.asarray(apply(tokens)), np.asarray(apply(tokens))
    assert first.shape == (*tokens.shape, 64) and first.dtype == np.float32
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("family", LEFT_TO_RIGHT)
def test_no_output_sees_a_later_token(family):
    apply, tokens = apply_fn(family)
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % 64)
    delta = np.abs(np.asarray(apply(tokens)) - np.asarray(apply(changed))).max((0, 2))
    assert delta[:6].max() == 0.0  # earlier outputs never see the changed token
    assert delta[6:].min() > 0.0  # the outputs from it on do


# in the quick tier: a training step of every family through the real loop
@pytest.mark.parametrize("family", NAMES)
def test_trains_through_the_loop(family):
    from transformers_jax.train.loop import train

    entry = FAMILIES.get(family)
    cfg = TrainConfig(steps=3, batch_size=2, seq_len=24, eval_batches=1, eval_every=3,
                      log_every=1, progress=False, warmup_steps=0,
                      task="reverse" if entry.needs_task else None,
                      train_lengths=(1, 6), test_lengths=(7, 8))
    final = train(tiny(family).replace(vocab_size=262), cfg)  # the byte tokenizer's ids
    losses = [row["loss"] for row in final["history"] if "loss" in row]
    assert final["steps"] == 3 and np.isfinite(final["train_loss"])
    assert np.isfinite(final["eval_loss"]) and losses


# a value of each switch other than its default, with the settings it needs
OTHER_SWITCH = {"attention": "chunked", "mask": {"name": "sliding_window", "window": 8},
                "position": "alibi", "norm": "rmsnorm", "norm_position": "post", "mlp": "swiglu"}


@pytest.mark.parametrize("family", NAMES)
def test_a_switch_the_family_does_not_read_is_refused_when_set(family):
    """A family reads the switches it declares; setting another is refused naming the family
    (an LSTM with --model.attention=chunked would report a kernel it never ran)."""
    entry = FAMILIES.get(family)
    tiny(family)  # every default is accepted
    assert set(OTHER_SWITCH) == {f for f in ModelConfig.__dataclass_fields__
                                 if "registry" in ModelConfig.__dataclass_fields__[f].metadata}
    for name, value in OTHER_SWITCH.items():
        if name in entry.switches:
            continue
        with pytest.raises(ValueError, match=rf"model\.{name}=.*family={family} does not read "
                                             rf"the {name} switch.*drop it"):
            tiny(family).replace(**{name: value})


def test_next_token_training_under_a_mask_that_shows_the_next_token_is_refused():
    """``--family gpt --model.mask=bidirectional`` would train a model that copies its target
    (its loss falls without learning); refused before any work, as is a prefix mask on an
    encoder-decoder, whose batches have no prefix."""
    from transformers_jax.config import ConfigError
    from transformers_jax.train.loop import train

    gpt = tiny("gpt").replace(mask="bidirectional")
    with pytest.raises(ConfigError, match="mask=bidirectional: family=gpt learns to predict the "
                                          "next token .* --family bert for a masked LM"):
        train(gpt, TrainConfig(steps=1, batch_size=2, seq_len=16))
    with pytest.raises(ConfigError, match="mask='prefix': an encoder-decoder's decoder"):
        tiny("encdec").replace(mask="prefix")
