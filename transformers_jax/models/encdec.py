"""Encoder-decoder transformer (Vaswani et al. 2017; T5, Raffel et al. 2020).

Shape legend: B batch, S source (encoder) length, T target (decoder) length, C model width,
V vocabulary, H heads.

- One token embedding, shared by the encoder, the decoder and (``tie_embeddings``) the output
  projection, as in both papers; with ``learned``/``sinusoidal`` positions the same position
  embedding is added on both sides.
- Encoder: the shared ``LayerStack`` of ``Block``s, always bidirectional, with padding/packing
  by ``encoder_segment_ids`` (0 = padding).
- Decoder: the same stack with each ``Block``'s cross-attention slot on: self-attention under
  the config's ``mask`` (one that decodes: ``causal``, ``sliding_window`` or ``prefix``;
  ``bidirectional`` would let a target see the targets it has to predict and is refused),
  cross-attention (queries from the decoder, keys and values from the encoder output; a query
  of decoder segment k sees only encoder tokens of segment k, so encoder padding is never
  attended), then the MLP.
- Positions: a bias scheme (``t5``, ``alibi``, ``fire``) is computed once per stack and shared by
  its layers: one bidirectional bias for the encoder, one causal bias for decoder
  self-attention; cross-attention gets no position term (like T5), so RoPE rotates only
  self-attention queries and keys.

``encode`` runs the encoder once; ``decode`` runs the decoder over it; ``__call__`` is both,
for teacher-forced training; ``init_cache``/``prefill``/``decode_step`` are the decoding API
every generating family shares (``sample.py``). Parameters:
``{"embed", "encoder": {"relative_bias"?, "layer_i", "final_norm"?}, "decoder": {...},
"lm_head"?}``. The family's entry is ``encdec`` in ``family.py``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.config import ModelConfig
from transformers_jax.models.gpt import check_length, default_positions
from transformers_jax.nn.kvcache import KVCache, init_cache, plan_step
from transformers_jax.nn.layers import Embedder, LMHead
from transformers_jax.nn.masks import AttentionMask, build_mask
from transformers_jax.nn.stack import LayerStack, encoding_positions


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


class Side(nn.Module):
    """One side (``encoder`` or ``decoder``): its relative bias, computed once and shared by
    its layers (bidirectional for the encoder, by the mask for the decoder), and the layer
    stack (with cross-attention on the decoder side). Returns what ``LayerStack`` returns."""

    config: ModelConfig
    n_layers: int
    decoder: bool = False

    def setup(self) -> None:
        cfg = self.config
        bidirectional = not (self.decoder and cfg.mask.causal)
        self.relative_bias = cfg.position.bias(cfg, bidirectional)
        self.stack = LayerStack(cfg, self.n_layers, cross=self.decoder)
        nn.share_scope(self, self.stack)

    def __call__(self, x_BTC, *, positions, mask, kv_positions=None, **stack_inputs):
        kv_positions = positions if kv_positions is None else kv_positions
        bias = (None if self.relative_bias is None
                else self.relative_bias(positions, kv_positions))
        return self.stack(x_BTC, positions=positions, mask=mask, bias=bias, **stack_inputs)


class EncoderDecoder(nn.Module):
    """``(decoder inputs [B, T], encoder_inputs [B, S]) -> logits [B, T, V]`` (float32).

    The decoder inputs are the targets shifted right (starting with ``bos``).
    """

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        self.embed = Embedder(cfg)
        self.encoder = Side(cfg, cfg.n_layers)
        self.decoder = Side(cfg, cfg.decoder_layers, decoder=True)
        self.head = LMHead(cfg)
        nn.share_scope(self, self.head)  # lm_head (untied) sits beside embed
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

    def _embed(self, tokens_BT, positions_BT, name: str, deterministic: bool) -> jax.Array:
        x_BTC = self.embed(tokens_BT, positions_BT)
        x_BTC = self.perturb(name, x_BTC)  # zero hooks: gradients w.r.t. the embedded inputs
        x_BTC = self.dropout(x_BTC, deterministic=deterministic)
        return nn.with_logical_constraint(x_BTC, ("batch", "length", "embed"))

    def encode(
        self,
        encoder_inputs: jax.Array,
        *,
        encoder_positions: jax.Array | None = None,
        encoder_segment_ids: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """The encoder output ``[B, S, C]`` for source tokens ``[B, S]``."""
        cfg = self.config
        check_length(cfg, encoder_inputs.shape[1])
        positions_BS = (
            default_positions(encoder_inputs) if encoder_positions is None else encoder_positions
        )
        mask = AttentionMask(positions_BS, positions_BS, q_segments=encoder_segment_ids,
                             kv_segments=encoder_segment_ids,  # the encoder sees both ways
                             aligned=encoder_positions is None)
        positions_BS = encoding_positions(self, cfg, positions_BS, deterministic,
                                          encoder_segment_ids)
        x_BSC = self._embed(encoder_inputs, positions_BS, "encoder_embeddings", deterministic)
        x_BSC, _ = self.encoder(x_BSC, positions=positions_BS, mask=mask,
                                deterministic=deterministic)
        return x_BSC

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
        encoder_positions_BS = (default_positions(encoded_BSC[..., 0])
                                if encoder_positions is None else encoder_positions)
        mask = build_mask(cfg.mask, positions_BT, positions_BT, prefix_len=prefix_len,
                          q_segments=segment_ids, kv_segments=segment_ids,
                          aligned=positions is None)
        cross_mask = cross_attention_mask(positions_BT, encoder_positions_BS, segment_ids,
                                          encoder_segment_ids)
        positions_BT = encoding_positions(self, cfg, positions_BT, deterministic, segment_ids)
        x_BTC = self._embed(tokens_BT, positions_BT, "decoder_embeddings", deterministic)
        x_BTC, _ = self.decoder(x_BTC, positions=positions_BT, mask=mask, encoded=encoded_BSC,
                                cross_mask=cross_mask, deterministic=deterministic)
        return self.head(x_BTC, self.embed)

    # Decoding (the API every generating family shares; see sample.py) ---------------------

    @nn.nowrap
    def init_cache(self, batch_size: int, prompt_len: int, max_new_tokens: int) -> KVCache:
        """An empty cache: decoder slots for ``bos`` and the new tokens, and per decoder layer
        room for the encoder's projected keys and values over ``prompt_len`` source tokens."""
        cfg = self.config
        cache = init_cache(cfg, batch_size, cfg.mask.cache_slots(max_new_tokens + 1),
                           n_layers=cfg.decoder_layers)
        cross = init_cache(cfg, batch_size, prompt_len, n_layers=cfg.decoder_layers)
        shape = (batch_size, prompt_len)
        return cache.replace(
            cross=cross.layers,
            encoder_positions=jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), shape),
            encoder_valid=jnp.ones(shape, bool))

    def prefill(self, sources_BS: jax.Array, lengths_B: jax.Array, cache: KVCache,
                bos_id: int | None = None) -> tuple[jax.Array, KVCache]:
        """Encode the right-padded sources once, store each decoder layer's cross-attention
        keys/values, and run ``bos``: ``(logits [B, V] of the first new token, cache)``."""
        if bos_id is None:
            raise ValueError("an encoder-decoder starts decoding from bos: pass bos_id")
        valid_BS = jnp.arange(sources_BS.shape[1])[None, :] < lengths_B[:, None]
        encoded_BSC = self.encode(sources_BS, encoder_segment_ids=valid_BS.astype(jnp.int32))
        cache = cache.replace(encoder_valid=valid_BS)
        if self.config.mask.needs_prefix_len:  # a prefix-LM decoder starts with no prefix
            cache = cache.replace(prefix_len=jnp.zeros_like(lengths_B))
        bos_B1 = jnp.full((sources_BS.shape[0], 1), bos_id, jnp.int32)
        logits_B1V, cache = self.decode_step(bos_B1, cache, encoded=encoded_BSC)
        return logits_B1V[:, 0], cache

    def decode_step(self, tokens_BT: jax.Array, cache: KVCache,
                    lengths: jax.Array | None = None,
                    encoded: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """``(logits [B, T, V], new cache)`` for new decoder tokens. Pass ``encoded`` (from
        ``encode``) on the first call: each layer projects it into cross-attention keys/values
        once and stores them; later calls read them from the cache."""
        cfg = self.config
        step = plan_step(cache, tokens_BT.shape[1], lengths)
        mask = build_mask(cfg.mask, step.positions, step.kv_positions, kv_valid=step.kv_valid,
                          prefix_len=cache.prefix_len)
        cross_mask = AttentionMask(step.positions, cache.encoder_positions,
                                   kv_valid=cache.encoder_valid)
        x_BTC = self.embed(tokens_BT, jnp.where(step.valid, step.positions, 0))
        x_BTC, (layers, cross) = self.decoder(
            x_BTC, positions=step.positions, kv_positions=step.kv_positions, mask=mask,
            encoded=encoded, cross_mask=cross_mask, cache=cache.layers,
            cross_cache=cache.cross, write=step.write)
        return self.head(x_BTC, self.embed), cache.replace(**step.meta, layers=layers,
                                                             cross=cross)


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
