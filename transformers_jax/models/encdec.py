"""Encoder-decoder transformer (Vaswani et al. 2017; T5, Raffel et al. 2020).

Shape legend: B batch, S source (encoder) length, T target (decoder) length, C model width,
V vocabulary, H heads.

- One token embedding, shared by the encoder, the decoder and (``tie_embeddings``) the output
  projection, as in both papers; with ``learned``/``sinusoidal`` positions the same position
  embedding is added on both sides.
- Encoder: the shared ``Block``, always bidirectional, with padding/packing by
  ``encoder_segment_ids`` (0 = padding).
- Decoder: ``DecoderBlock`` = causal self-attention (the config's ``mask``: ``causal``,
  ``sliding_window`` or ``prefix``; ``bidirectional`` would let a target see the targets it has
  to predict and is refused), cross-attention (queries from the decoder, keys and values from
  the encoder output; a query of decoder segment k sees only encoder tokens of segment k, so
  encoder padding is never attended), then the MLP.
- Positions: a bias scheme (``t5``, ``alibi``, ``fire``) is computed once per stack and shared by
  its layers: one bidirectional bias for the encoder, one causal bias for decoder
  self-attention; cross-attention gets no position term (like T5), so RoPE rotates only
  self-attention queries and keys.

``encode`` runs the encoder once; ``decode`` runs the decoder over it (for a later KV cache);
``__call__`` is both, for teacher-forced training. Parameters:
``{"embed", "encoder": {"relative_bias"?, "layer_i", "final_norm"?}, "decoder": {...},
"lm_head"?}``.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.config import ModelConfig
from transformers_jax.models.family import Family, check_decoder_mask
from transformers_jax.models.gpt import (
    Embedder,
    check_length,
    default_positions,
    relative_bias,
)
from transformers_jax.nn.kvcache import CacheStep, init_cache, plan_step
from transformers_jax.nn.layers import (
    MLP,
    Attention,
    Block,
    dtype_of,
    make_norm,
    normal_init,
    softcap,
)
from transformers_jax.nn.masks import AttentionMask, build_mask
from transformers_jax.registry import FAMILIES


def cross_attention_mask(
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segments: jax.Array | None,
    kv_segments: jax.Array | None,
) -> AttentionMask:
    """Decoder queries over encoder keys: same segment when both sides have ids, otherwise
    only non-padding encoder keys (``kv_segments != 0``); never causal."""
    if q_segments is not None and kv_segments is not None:
        return AttentionMask(q_positions, kv_positions, q_segments=q_segments,
                             kv_segments=kv_segments)
    kv_valid = None if kv_segments is None else kv_segments != 0
    return AttentionMask(q_positions, kv_positions, kv_valid=kv_valid)


class DecoderBlock(nn.Module):
    """Self-attention, cross-attention, MLP; each with a residual and a norm (pre or post).

    Norm names follow ``Block`` (``norm1`` before/after self-attention, ``norm2`` for the MLP),
    plus ``norm_cross`` for cross-attention.
    """

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        x_BTC: jax.Array,
        *,
        positions: jax.Array,
        mask: AttentionMask | jax.Array | None,
        encoded: jax.Array,
        encoder_positions: jax.Array,
        cross_mask: AttentionMask | jax.Array | None,
        bias: jax.Array | None = None,
        deterministic: bool = True,
        cache: dict | None = None,
        cache_write=None,
    ):
        """``[B, T, C]``; with this layer's ``cache`` (decoding) ``(output, new_cache)``: the
        self-attention keys/values are stored as planned by ``cache_write``, and the
        cross-attention keys/values are projected from ``encoded`` once (when it is given)
        and read back from the cache afterwards (when ``encoded`` is None)."""
        cfg = self.config
        drop = nn.Dropout(cfg.dropout)
        self_attention = Attention(cfg, name="attention")
        cross_attention = Attention(cfg, cross=True, name="cross_attention")
        mlp = MLP(cfg, name="mlp")
        norm1, norm_cross, norm2 = (
            make_norm(cfg, "norm1"), make_norm(cfg, "norm_cross"), make_norm(cfg, "norm2")
        )

        new_cache: dict = {}

        def attend(h):
            if cache is None:
                return self_attention(h, positions=positions, mask=mask, bias=bias)
            out, kv = self_attention(h, positions=positions, mask=mask, bias=bias,
                                     cache={"key": cache["key"], "value": cache["value"]},
                                     cache_write=cache_write)
            new_cache.update(kv)
            return out

        def cross(h):
            if cache is None:
                return cross_attention(h, positions=positions, mask=cross_mask, bias=None,
                                       kv_inputs=encoded, kv_positions=encoder_positions)
            stored = None if encoded is not None else {
                "key": cache["cross_key"], "value": cache["cross_value"]}
            out, kv = cross_attention(h, positions=positions, mask=cross_mask, bias=None,
                                      kv_inputs=encoded, kv_positions=encoder_positions,
                                      cross_kv=stored, return_kv=True)
            new_cache["cross_key"] = kv["key"].astype(cache["cross_key"].dtype)
            new_cache["cross_value"] = kv["value"].astype(cache["cross_value"].dtype)
            return out

        def step(x, f, norm):
            if cfg.norm_position == "pre":
                return x + drop(f(norm(x)), deterministic=deterministic)
            return norm(x + drop(f(x), deterministic=deterministic))

        x_BTC = step(x_BTC, attend, norm1)
        x_BTC = step(x_BTC, cross, norm_cross)
        x_BTC = step(x_BTC, mlp, norm2)
        x_BTC = nn.with_logical_constraint(x_BTC, ("batch", "length", "embed"))
        return x_BTC if cache is None else (x_BTC, new_cache)


class EncoderStack(nn.Module):
    """Embedded source ``[B, S, C]`` -> encoder output ``[B, S, C]`` (final norm if pre-norm)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BSC, *, positions, segment_ids, deterministic: bool = True):
        cfg = self.config
        mask = AttentionMask(positions, positions, q_segments=segment_ids,
                             kv_segments=segment_ids)  # the encoder sees both ways
        bias_BHSS = relative_bias(self, cfg, positions, positions, bidirectional=True)
        for i in range(cfg.n_layers):
            x_BSC = Block(cfg, name=f"layer_{i}")(
                x_BSC, positions=positions, mask=mask, bias=bias_BHSS,
                deterministic=deterministic,
            )
        if cfg.norm_position == "pre":
            x_BSC = make_norm(cfg, "final_norm")(x_BSC)
        return x_BSC


class DecoderStack(nn.Module):
    """Embedded targets ``[B, T, C]`` + encoder output -> hidden ``[B, T, C]``."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTC, encoded_BSC, *, positions, segment_ids, encoder_positions,
                 encoder_segment_ids, prefix_len=None, deterministic: bool = True,
                 cache: dict | None = None, step: CacheStep | None = None):
        cfg = self.config
        if cache is not None:
            return self._cached(x_BTC, encoded_BSC, cache, step, prefix_len)
        mask = build_mask(cfg.mask, positions, positions, prefix_len=prefix_len,
                          q_segments=segment_ids, kv_segments=segment_ids)
        cross_mask = cross_attention_mask(positions, encoder_positions, segment_ids,
                                          encoder_segment_ids)
        bias_BHTT = relative_bias(self, cfg, positions, positions,
                                  bidirectional=not cfg.mask.causal)
        for i in range(cfg.decoder_layers):
            x_BTC = DecoderBlock(cfg, name=f"layer_{i}")(
                x_BTC, positions=positions, mask=mask, bias=bias_BHTT, encoded=encoded_BSC,
                encoder_positions=encoder_positions, cross_mask=cross_mask,
                deterministic=deterministic,
            )
        if cfg.norm_position == "pre":
            x_BTC = make_norm(cfg, "final_norm")(x_BTC)
        return x_BTC

    def _cached(self, x_BTC, encoded_BSC, cache: dict, step: CacheStep, prefix_len):
        """New decoder tokens over [cached slots, themselves] and the cached encoder."""
        cfg = self.config
        mask = build_mask(cfg.mask, step.positions, step.kv_positions, prefix_len=prefix_len,
                          kv_valid=step.kv_valid)
        cross_mask = AttentionMask(step.positions, cache["encoder_positions"],
                                   kv_valid=cache["encoder_valid"])
        bias = relative_bias(self, cfg, step.positions, step.kv_positions,
                             bidirectional=not cfg.mask.causal)
        new_layers = {}
        for i in range(cfg.decoder_layers):
            name = f"layer_{i}"
            x_BTC, new_layers[name] = DecoderBlock(cfg, name=name)(
                x_BTC, positions=step.positions, mask=mask, bias=bias, encoded=encoded_BSC,
                encoder_positions=cache["encoder_positions"], cross_mask=cross_mask,
                cache=cache[name], cache_write=step.write,
            )
        if cfg.norm_position == "pre":
            x_BTC = make_norm(cfg, "final_norm")(x_BTC)
        return x_BTC, new_layers


def init_encdec_cache(config: ModelConfig, batch_size: int, size: int, encoder_len: int,
                      encoder_positions=None, encoder_valid=None) -> dict:
    """The decoding cache of an encoder-decoder: decoder self-attention slots (as
    ``nn.kvcache.init_cache``) plus, per layer, the encoder's projected keys and values."""
    cache = init_cache(config, batch_size, size, n_layers=config.decoder_layers)
    N, D = config.kv_heads, config.dims_per_head
    for i in range(config.decoder_layers):
        cache[f"layer_{i}"]["cross_key"] = jnp.zeros((batch_size, N, encoder_len, D),
                                                     jnp.dtype(config.dtype))  # heads-first
        cache[f"layer_{i}"]["cross_value"] = jnp.zeros_like(cache[f"layer_{i}"]["cross_key"])
    shape = (batch_size, encoder_len)
    cache["encoder_positions"] = (
        jnp.broadcast_to(jnp.arange(encoder_len, dtype=jnp.int32), shape)
        if encoder_positions is None else encoder_positions
    )
    cache["encoder_valid"] = jnp.ones(shape, bool) if encoder_valid is None else encoder_valid
    return cache


class EncoderDecoder(nn.Module):
    """``(decoder inputs [B, T], encoder_inputs [B, S]) -> logits [B, T, V]`` (float32).

    The decoder inputs are the targets shifted right (starting with ``bos``).
    """

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        self.embed = Embedder(cfg)
        self.encoder = EncoderStack(cfg)
        self.decoder = DecoderStack(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Dense(
                cfg.vocab_size,
                use_bias=False,
                kernel_init=normal_init(cfg.init_std, ("embed", "vocab")),
                dtype=dtype_of(cfg.dtype),
                param_dtype=dtype_of(cfg.param_dtype),
            )
        self.dropout = nn.Dropout(cfg.dropout)

    def __call__(
        self,
        tokens_BT: jax.Array,
        *,
        encoder_inputs: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        encoder_positions: jax.Array | None = None,
        encoder_segment_ids: jax.Array | None = None,
        prefix_len: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        encoded_BSC = self.encode(
            encoder_inputs,
            encoder_positions=encoder_positions,
            encoder_segment_ids=encoder_segment_ids,
            deterministic=deterministic,
        )
        return self.decode(
            tokens_BT,
            encoded_BSC,
            positions=positions,
            segment_ids=segment_ids,
            encoder_positions=encoder_positions,
            encoder_segment_ids=encoder_segment_ids,
            prefix_len=prefix_len,
            deterministic=deterministic,
        )

    def encode(
        self,
        encoder_inputs: jax.Array,
        *,
        encoder_positions: jax.Array | None = None,
        encoder_segment_ids: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """The encoder output ``[B, S, C]`` for source tokens ``[B, S]``."""
        check_length(self.config, encoder_inputs.shape[1])
        positions_BS = (
            default_positions(encoder_inputs) if encoder_positions is None else encoder_positions
        )
        x_BSC = self.embed(encoder_inputs, positions_BS)
        x_BSC = self.perturb("encoder_embeddings", x_BSC)
        x_BSC = self.dropout(x_BSC, deterministic=deterministic)
        x_BSC = nn.with_logical_constraint(x_BSC, ("batch", "length", "embed"))
        return self.encoder(x_BSC, positions=positions_BS, segment_ids=encoder_segment_ids,
                            deterministic=deterministic)

    def decode(
        self,
        tokens_BT: jax.Array,
        encoded_BSC: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        encoder_positions: jax.Array | None = None,
        encoder_segment_ids: jax.Array | None = None,
        prefix_len: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Logits ``[B, T, V]`` of decoder inputs ``[B, T]`` attending to ``encoded_BSC``.

        ``encoder_positions``/``encoder_segment_ids`` must be those given to ``encode``.
        """
        cfg = self.config
        check_length(cfg, tokens_BT.shape[1])
        positions_BT = default_positions(tokens_BT) if positions is None else positions
        encoder_positions_BS = (
            jnp.broadcast_to(
                jnp.arange(encoded_BSC.shape[1], dtype=jnp.int32), encoded_BSC.shape[:2]
            )
            if encoder_positions is None
            else encoder_positions
        )
        x_BTC = self.embed(tokens_BT, positions_BT)
        x_BTC = self.perturb("decoder_embeddings", x_BTC)
        x_BTC = self.dropout(x_BTC, deterministic=deterministic)
        x_BTC = nn.with_logical_constraint(x_BTC, ("batch", "length", "embed"))
        x_BTC = self.decoder(
            x_BTC,
            encoded_BSC,
            positions=positions_BT,
            segment_ids=segment_ids,
            encoder_positions=encoder_positions_BS,
            encoder_segment_ids=encoder_segment_ids,
            prefix_len=prefix_len,
            deterministic=deterministic,
        )
        logits_BTV = self.embed.attend(x_BTC) if cfg.tie_embeddings else self.lm_head(x_BTC)
        logits_BTV = softcap(logits_BTV.astype(jnp.float32), cfg.final_logit_softcap)
        return nn.with_logical_constraint(logits_BTV, ("batch", "length", "vocab"))

    def decode_cached(self, tokens_BT, cache: dict, encoded_BSC=None, lengths=None):
        """``(logits [B, T, V], new cache)`` for new decoder tokens (see ``sample.py``).

        Pass ``encoded_BSC`` (from ``encode``) on the first call: each layer projects it into
        cross-attention keys/values once and stores them; later calls pass None and read
        them from the cache.
        """
        cfg = self.config
        step = plan_step(cache, tokens_BT.shape[1], lengths)
        x_BTC = self.embed(tokens_BT, jnp.where(step.valid, step.positions, 0))
        x_BTC, layers = self.decoder(
            x_BTC, encoded_BSC, positions=step.positions, segment_ids=None,
            encoder_positions=cache["encoder_positions"], encoder_segment_ids=None,
            cache=cache, step=step,
        )
        logits_BTV = self.embed.attend(x_BTC) if cfg.tie_embeddings else self.lm_head(x_BTC)
        logits_BTV = softcap(logits_BTV.astype(jnp.float32), cfg.final_logit_softcap)
        new_cache = {**step.meta, "encoder_positions": cache["encoder_positions"],
                     "encoder_valid": cache["encoder_valid"], **layers}
        return logits_BTV, new_cache



# Greedy decoding (no cache: the decoder reruns over the whole buffer each step) -------------


@functools.partial(jax.jit, static_argnames=("model", "max_len", "bos_id", "eos_id", "pad_id"))
def greedy_decode(
    model: EncoderDecoder,
    params,
    encoder_inputs: jax.Array,
    *,
    max_len: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    encoder_segment_ids: jax.Array | None = None,
    encoder_positions: jax.Array | None = None,
) -> jax.Array:
    """Greedy output ``[B, max_len]`` (without the leading bos; ``pad_id`` after each ``eos``).

    The encoder runs once; then, for t = 0 .. max_len-1, the decoder runs over the buffer
    ``[bos, y_1 .. y_t, pad ..]`` and ``y_{t+1}`` is the argmax at position t. The causal mask
    keeps the not-yet-written slots from influencing position t, so this equals step-by-step
    decoding; it costs O(max_len^2) per row, fine for short outputs until the KV cache lands.
    """
    variables = {"params": params}
    encoded_BSC = model.apply(
        variables, encoder_inputs, encoder_positions=encoder_positions,
        encoder_segment_ids=encoder_segment_ids, method="encode",
    )
    B = encoder_inputs.shape[0]
    buffer_BT = jnp.full((B, max_len + 1), pad_id, jnp.int32).at[:, 0].set(bos_id)

    def body(t, carry):
        buffer_BT, done_B = carry
        logits_BTV = model.apply(
            variables, buffer_BT[:, :max_len], encoded_BSC, encoder_positions=encoder_positions,
            encoder_segment_ids=encoder_segment_ids, method="decode",
        )
        next_B = jnp.argmax(logits_BTV[:, t], axis=-1).astype(jnp.int32)
        next_B = jnp.where(done_B, pad_id, next_B)
        buffer_BT = jax.lax.dynamic_update_index_in_dim(buffer_BT, next_B, t + 1, axis=1)
        return buffer_BT, done_B | (next_B == eos_id)

    buffer_BT, _ = jax.lax.fori_loop(0, max_len, body, (buffer_BT, jnp.zeros((B,), bool)))
    return buffer_BT[:, 1:]


@dataclasses.dataclass(frozen=True)
class EncDecFamily(Family):
    def check(self, config: ModelConfig) -> None:
        check_decoder_mask(config)

    def inputs_for(self, config: ModelConfig, tokens_BT):
        return {**super().inputs_for(config, tokens_BT), "encoder_inputs": tokens_BT}


FAMILIES.add("encdec", EncDecFamily(EncoderDecoder, objective="seq2seq", generates="seq2seq",
                                    tasks="encdec", needs_task=True, cross_attention=True))
