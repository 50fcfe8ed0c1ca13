"""Shared by the decoding tests (test_kvcache.py, test_sample.py): tiny models initialised once
per config, and ``init`` / ``apply`` / ``decode_step`` jitted once at module level with the
model static and the params an argument.

XLA compiling is most of these tests' time. Run eagerly, a model's init or forward pass
compiles each of its hundred-odd operations for every new shape (a test with a new config or
length paid for 100-450 small compiles); a ``jax.jit(lambda ...)`` closing over the params,
made per call, compiles on every call. Here each is one program per model config and shapes,
whichever test asks.
"""

import functools

import flax.linen as nn
import jax
import numpy as np

from transformers_jax import build_model


@functools.partial(jax.jit, static_argnames="model")
def init_params(model, key, *args, **kwargs):
    """``model.init(key, *args, **kwargs)``'s params, unboxed: one compiled program."""
    return nn.meta.unbox(model.init(key, *args, **kwargs)["params"])


@functools.partial(jax.jit, static_argnames=("model", "method"))
def apply(model, params, *args, method=None, **kwargs):
    """``model.apply({"params": params}, *args, method=method, **kwargs)``, compiled."""
    return model.apply({"params": params}, *args, method=method, **kwargs)


def decode_step(model, params, cache, tokens, lengths=None, **inputs):
    """``model.decode_step``: ``(logits [B, T, V], new cache)`` for ``tokens`` [B, T]."""
    return apply(model, params, tokens, cache, lengths, method="decode_step", **inputs)


@functools.cache
def built(cfg, T: int = 12, B: int = 2, seed: int = 0):
    """``model_helpers.init`` (same keys), compiled, once per (config, shape, seed):
    ``(model, params, tokens [B, T])``."""
    model = build_model(cfg)
    tokens = jax.random.randint(jax.random.key(seed + 1), (B, T), 0, cfg.vocab_size)
    return model, init_params(model, jax.random.key(seed), tokens), tokens


@functools.cache
def full_logits(cfg, T: int = 12, B: int = 2, seed: int = 0) -> np.ndarray:
    """The full (uncached) forward pass over ``built(cfg, T, B, seed)``'s tokens: [B, T, V]."""
    model, params, tokens = built(cfg, T, B, seed)
    return np.asarray(apply(model, params, tokens))
