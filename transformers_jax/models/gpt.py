"""GPT-style decoder-only language model built from the switchable core.

Shape legend: B batch, T length, C model width, V vocabulary, H heads.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.config import ModelConfig
from transformers_jax.models.family import Family
from transformers_jax.nn.kvcache import plan_step
from transformers_jax.nn.layers import Block, dtype_of, make_norm, normal_init, softcap
from transformers_jax.nn.masks import build_mask
from transformers_jax.nn.stack import apply_layers
from transformers_jax.registry import FAMILIES


def default_positions(tokens_BT: jax.Array) -> jax.Array:
    """0, 1, ..., T-1 for every row."""
    B, T = tokens_BT.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def make_embed(cfg: ModelConfig, rows: int, axes: tuple[str | None, str]) -> nn.Embed:
    """A ``[rows, C]`` embedding table with the config's init and dtypes (``axes``: logical
    partitioning); one place for the token, learned-position and BERT token-type tables."""
    return nn.Embed(
        rows,
        cfg.d_model,
        embedding_init=normal_init(cfg.init_std, axes),
        param_dtype=dtype_of(cfg.param_dtype),
        dtype=dtype_of(cfg.dtype),
    )


def self_attention_mask(cfg: ModelConfig, positions_BT: jax.Array,
                        segment_ids: jax.Array | None, prefix_len: jax.Array | None):
    """The config's mask for a stack attending to itself (queries and keys are the same tokens:
    GPT and the BERT encoder, without a cache)."""
    return build_mask(
        cfg.mask,
        positions_BT,
        positions_BT,
        prefix_len=prefix_len,
        q_segments=segment_ids,
        kv_segments=segment_ids,
    )


class Embedder(nn.Module):
    """Token embedding plus the position scheme's embedding, if it has one (learned,
    sinusoidal). Also the tied output head (``attend``), so the two share one table when tied.
    """

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        self.tokens = make_embed(cfg, cfg.vocab_size, ("vocab", "embed"))
        self.table = cfg.position.embedding(cfg)

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
        x_BTC = self.tokens(tokens_BT)
        if self.table is not None:
            x_BTC = x_BTC + self.table(positions_BT).astype(x_BTC.dtype)
        return x_BTC

    def attend(self, x_BTC: jax.Array) -> jax.Array:
        return self.tokens.attend(x_BTC)


def check_length(config: ModelConfig, length: int) -> None:
    """A scheme with a longest length (a learned table) fails loudly instead of clamping."""
    limit = config.position.max_length(config)
    if limit is not None and length > limit:
        raise ValueError(
            f"sequence length {length} is longer than position={config.position.name} allows "
            f"(max_len={limit}); use a shorter input, a larger model.max_len, or a position "
            "scheme that extrapolates"
        )


def encoding_positions(module: nn.Module, config: ModelConfig, positions_BT: jax.Array,
                       deterministic: bool) -> jax.Array:
    """The positions the scheme's hooks see: in training, those of ``train_positions``
    (randomized schemes draw them from the ``dropout`` RNG stream, the one the train step
    passes); otherwise the real ones. Masks always use the real positions."""
    if deterministic or not config.position.randomizes:
        return positions_BT
    return config.position.train_positions(module.make_rng("dropout"), positions_BT, config)


def relative_bias(parent: nn.Module, config: ModelConfig, q_pos, k_pos, *, bidirectional: bool,
                  name: str = "relative_bias"):
    """The scheme's additive [B, H, Q, K] bias, or None for schemes without one.

    Computed once per forward pass and shared by every layer (as T5 does).
    """
    module = config.position.bias(config, bidirectional)
    if module is None:
        return None
    return module.clone(parent=parent, name=name)(q_pos, k_pos)


class GPT(nn.Module):
    """Decoder-only LM: ``tokens [B, T] -> logits [B, T, V]`` (float32)."""

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens_BT: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        prefix_len: jax.Array | None = None,
        deterministic: bool = True,
        cache: dict | None = None,
        lengths: jax.Array | None = None,
    ):
        """Logits ``[B, T, V]``; with a ``cache`` (see ``nn/kvcache.py``) ``(logits, cache)``.

        Decoding: pass the cache, the new tokens ``[B, T]`` (a right-padded prompt batch for
        prefill, or one token per row) and ``lengths`` ``[B]`` (real new tokens per row,
        default T). Positions then continue from each row's cache index.
        """
        cfg = self.config
        B, T = tokens_BT.shape
        check_length(cfg, T)
        if cache is not None:
            return self._cached(tokens_BT, cache, lengths, prefix_len)
        positions_BT = default_positions(tokens_BT) if positions is None else positions

        mask = self_attention_mask(cfg, positions_BT, segment_ids, prefix_len)
        positions_BT = encoding_positions(self, cfg, positions_BT, deterministic)

        embed = Embedder(cfg, name="embed")
        x_BTC = embed(tokens_BT, positions_BT)
        # A zero "perturbation" hook: lets tests take gradients w.r.t. the embedded inputs.
        x_BTC = self.perturb("embeddings", x_BTC)
        x_BTC = nn.Dropout(cfg.dropout)(x_BTC, deterministic=deterministic)
        x_BTC = nn.with_logical_constraint(x_BTC, ("batch", "length", "embed"))

        bias_BHTT = relative_bias(
            self, cfg, positions_BT, positions_BT, bidirectional=not cfg.mask.causal
        )

        x_BTC = apply_layers(
            cfg, x_BTC, positions=positions_BT, mask=mask, bias=bias_BHTT,
            deterministic=deterministic, remat=cfg.remat, scan=cfg.scan_layers,
        )
        return self._logits(embed, x_BTC)

    def _logits(self, embed: Embedder, x_BTC: jax.Array) -> jax.Array:
        cfg = self.config
        if cfg.norm_position == "pre":
            x_BTC = make_norm(cfg, "final_norm")(x_BTC)
        if cfg.tie_embeddings:
            logits_BTV = embed.attend(x_BTC)
        else:
            logits_BTV = nn.Dense(
                cfg.vocab_size,
                use_bias=False,
                kernel_init=normal_init(cfg.init_std, ("embed", "vocab")),
                dtype=dtype_of(cfg.dtype),
                param_dtype=dtype_of(cfg.param_dtype),
                name="lm_head",
            )(x_BTC)
        logits_BTV = softcap(logits_BTV.astype(jnp.float32), cfg.final_logit_softcap)
        return nn.with_logical_constraint(logits_BTV, ("batch", "length", "vocab"))

    def _cached(self, tokens_BT, cache: dict, lengths, prefix_len):
        """The forward pass over new tokens that attend to [cached slots, themselves]."""
        cfg = self.config
        if cfg.scan_layers:
            raise ValueError(
                "KV-cache decoding reads each layer's parameters by name: convert scanned "
                "parameters with parallel.remat.unstack_layer_params and decode with "
                "scan_layers=False"
            )
        step = plan_step(cache, tokens_BT.shape[1], lengths)
        embed = Embedder(cfg, name="embed")
        # Padding slots of a prompt batch may lie past a learned table: look up row 0 for them
        # (they are never attended to) rather than read out of bounds.
        x_BTC = embed(tokens_BT, jnp.where(step.valid, step.positions, 0))
        mask = build_mask(cfg.mask, step.positions, step.kv_positions, prefix_len=prefix_len,
                          kv_valid=step.kv_valid)
        bias = relative_bias(self, cfg, step.positions, step.kv_positions,
                             bidirectional=not cfg.mask.causal)
        new_cache = dict(step.meta)
        for i in range(cfg.n_layers):
            name = f"layer_{i}"
            x_BTC, new_cache[name] = Block(cfg, name=name)(
                x_BTC, positions=step.positions, mask=mask, bias=bias, cache=cache[name],
                cache_write=step.write,
            )
        return self._logits(embed, x_BTC), new_cache


FAMILIES.add("gpt", Family(GPT, objective="lm", generates="self"))
