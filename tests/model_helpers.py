"""Tiny models shared by the model tests (small enough that each compile takes about a second)."""

import flax.linen as nn
import jax

from transformers_jax import ModelConfig, build_model

POSITIONS = ["none", "sinusoidal", "learned", "rope", "alibi", "t5", "fire"]


def tiny(**changes) -> ModelConfig:
    base = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, max_len=16)
    return ModelConfig(**{**base, **changes})


def init(cfg, T=12, B=2, seed=0, **inputs):
    """(model, unboxed params, random tokens [B, T])."""
    model = build_model(cfg)
    tokens = jax.random.randint(jax.random.key(seed + 1), (B, T), 0, cfg.vocab_size)
    variables = model.init(jax.random.key(seed), tokens, **inputs)
    return model, nn.meta.unbox(variables["params"]), tokens
