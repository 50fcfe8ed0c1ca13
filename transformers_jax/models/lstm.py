"""An LSTM language model: the recurrent baseline of the context-usage experiment.

Same interface as GPT (``tokens [B, T] -> logits [B, T, V]``) so the same training loop,
checkpoints and evaluation serve it. It uses ``d_model``, ``n_layers``, ``vocab_size``,
``dropout``, ``tie_embeddings`` and the dtypes of the config (not ``init_std``: see the
embedding); no switch of the config applies to a recurrence, and one set is refused (the
family's entry, ``lstm`` in ``family.py``, declares ``switches=()``). The state is not reset
between packed documents (train with ``--train.pack none`` for one document per row).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.config import ModelConfig
from transformers_jax.nn.layers import dtype_of, normal_init


class LSTMLM(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, tokens_BT: jax.Array, *, deterministic: bool = True, **unused) -> jax.Array:
        cfg = self.config
        if unused.get("cache") is not None:
            raise ValueError("the LSTM baseline has no KV cache: sampling is for the "
                             "transformer families")
        # Unit-variance embeddings, not the transformer's init_std (0.02): the gates see the
        # embedding directly (no norm in between), and at 0.02 their inputs are so small that
        # training sits at the unigram loss for hundreds of steps before it uses any context.
        embed = nn.Embed(cfg.vocab_size, cfg.d_model,
                         embedding_init=normal_init(1.0, ("vocab", "embed")),
                         param_dtype=dtype_of(cfg.param_dtype), dtype=dtype_of(cfg.dtype))
        x_BTC = embed(tokens_BT)
        x_BTC = self.perturb("embeddings", x_BTC)
        for i in range(cfg.n_layers):
            x_BTC = nn.Dropout(cfg.dropout)(x_BTC, deterministic=deterministic)
            cell = nn.OptimizedLSTMCell(cfg.d_model, param_dtype=dtype_of(cfg.param_dtype),
                                        dtype=dtype_of(cfg.dtype))
            x_BTC = nn.RNN(cell, name=f"lstm_{i}")(x_BTC)
        x_BTC = nn.Dropout(cfg.dropout)(x_BTC, deterministic=deterministic)
        if cfg.tie_embeddings:
            logits_BTV = embed.attend(x_BTC)
        else:
            logits_BTV = nn.Dense(cfg.vocab_size, name="lm_head",
                                  param_dtype=dtype_of(cfg.param_dtype))(x_BTC)
        return logits_BTV.astype(jnp.float32)
