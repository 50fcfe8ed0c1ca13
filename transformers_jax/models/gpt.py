"""GPT-style decoder-only language model built from the switchable core.

Shape legend: B batch, T length, C model width, V vocabulary, H heads.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.config import ModelConfig
from transformers_jax.nn.kvcache import plan_step
from transformers_jax.nn.layers import Block, dtype_of, make_norm, normal_init, softcap
from transformers_jax.nn.masks import build_mask
from transformers_jax.nn.positions import POSITIONS, sinusoidal_embedding
from transformers_jax.parallel.remat import apply_layers


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
        window=cfg.window,
        prefix_len=prefix_len,
        q_segments=segment_ids,
        kv_segments=segment_ids,
    )


class Embedder(nn.Module):
    """Token embedding plus, for ``sinusoidal``/``learned``, an absolute position embedding.

    Also the tied output head (``attend``), so the two share one table when tied.
    """

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        self.tokens = make_embed(cfg, cfg.vocab_size, ("vocab", "embed"))
        if cfg.position == "learned":
            self.table = make_embed(cfg, cfg.max_len, ("length", "embed"))

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
        cfg = self.config
        x_BTC = self.tokens(tokens_BT)
        if cfg.position == "learned":
            x_BTC = x_BTC + self.table(positions_BT)
        elif cfg.position == "sinusoidal":
            # The fixed table is scaled so each component's RMS is init_std, the scale of the
            # token embeddings (the original transformer's ratio, where both are O(1)). Larger,
            # it drowns the tokens: at amplitude 1 training sat at the unigram loss, and at
            # d**-0.5 (3x the tokens here) held-out loss was 2.77 against 2.19 (experiments/).
            scale = cfg.init_std * math.sqrt(2.0)  # sin and cos have RMS 1/sqrt(2)
            table = sinusoidal_embedding(positions_BT, cfg.d_model) * scale
            x_BTC = x_BTC + table.astype(x_BTC.dtype)
        return x_BTC

    def attend(self, x_BTC: jax.Array) -> jax.Array:
        return self.tokens.attend(x_BTC)


def check_length(config: ModelConfig, length: int) -> None:
    """A learned table has no row past max_len: fail loudly instead of clamping the index."""
    if config.position == "learned" and length > config.max_len:
        raise ValueError(
            f"sequence length {length} is longer than the learned position table "
            f"(max_len={config.max_len}); use a shorter input, a larger model.max_len, or a "
            f"position scheme that extrapolates (rope, alibi, t5, fire, sinusoidal, none)"
        )


def relative_bias(parent: nn.Module, config: ModelConfig, q_pos, k_pos, *, bidirectional: bool,
                  name: str = "relative_bias"):
    """The additive [B, H, Q, K] bias of a bias scheme, or None for other schemes.

    Computed once per forward pass and shared by every layer (as T5 does).
    """
    scheme = POSITIONS.get(config.position)
    if scheme.kind != "bias":
        return None
    module = scheme.make_bias(config, bidirectional)
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

        embed = Embedder(cfg, name="embed")
        x_BTC = embed(tokens_BT, positions_BT)
        # A zero "perturbation" hook: lets tests take gradients w.r.t. the embedded inputs.
        x_BTC = self.perturb("embeddings", x_BTC)
        x_BTC = nn.Dropout(cfg.dropout)(x_BTC, deterministic=deterministic)
        x_BTC = nn.with_logical_constraint(x_BTC, ("batch", "length", "embed"))

        mask = self_attention_mask(cfg, positions_BT, segment_ids, prefix_len)
        bias_BHTT = relative_bias(
            self, cfg, positions_BT, positions_BT, bidirectional=not cfg.causal
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
        mask = build_mask(
            cfg.mask, step.positions, step.kv_positions, window=cfg.window,
            prefix_len=prefix_len, kv_valid=step.kv_valid,
        )
        bias = relative_bias(self, cfg, step.positions, step.kv_positions,
                             bidirectional=not cfg.causal)
        new_cache = dict(step.meta)
        for i in range(cfg.n_layers):
            name = f"layer_{i}"
            x_BTC, new_cache[name] = Block(cfg, name=name)(
                x_BTC, positions=step.positions, mask=mask, bias=bias, cache=cache[name],
                cache_write=step.write,
            )
        return self._logits(embed, x_BTC), new_cache
