"""GPT-style decoder-only language model: embedding, the layer stack, the LM head.

Shape legend: B batch, T length, C model width, V vocabulary, H heads, S cache slots.

Reading order, config to logits: ``GPT.__call__`` here, then ``nn/stack.py`` (``LayerStack``)
and ``nn/layers.py`` (``Block``, ``Attention``, ``MLP``, ``Embedder``, ``LMHead``). The three
switches enter through their registry entries: ``cfg.mask`` builds the mask, ``cfg.position``
embeds, rotates or biases, ``cfg.attention`` attends. The family's entry (objective, batch keys,
decoding) is ``gpt`` in ``family.py``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.config import ModelConfig
from transformers_jax.nn.attention import every_key
from transformers_jax.nn.kvcache import KVCache, init_cache, plan_step
from transformers_jax.nn.layers import Embedder, LMHead
from transformers_jax.nn.masks import build_mask
from transformers_jax.nn.stack import LayerStack, encoding_positions


def default_positions(tokens_BT: jax.Array) -> jax.Array:
    """0, 1, ..., T-1 for every row."""
    B, T = tokens_BT.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def check_length(config: ModelConfig, length: int) -> None:
    """A scheme with a longest length (a learned table) fails loudly instead of clamping."""
    limit = config.position.max_length(config)
    if limit is not None and length > limit:
        raise ValueError(
            f"sequence length {length} is longer than position={config.position.name} allows "
            f"(max_len={limit}); use a shorter input, a larger model.max_len, or a position "
            "scheme that extrapolates")


class GPT(nn.Module):
    """Decoder-only LM: ``tokens [B, T] -> logits [B, T, V]`` (float32).

    Parameters: ``embed``, ``relative_bias`` (bias schemes), ``layer_i`` (or ``layers`` when
    scanned), ``final_norm`` (pre-norm), ``lm_head`` (untied).
    """

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        self.embed = Embedder(cfg)
        # One bias module for the whole stack (None for schemes without one).
        self.relative_bias = cfg.position.bias(cfg, not cfg.mask.causal)
        self.stack = LayerStack(cfg, cfg.n_layers)
        self.head = LMHead(cfg)
        nn.share_scope(self, self.stack)  # layer_i and final_norm sit beside embed
        nn.share_scope(self, self.head)
        self.dropout = nn.Dropout(cfg.dropout)

    def __call__(self, tokens_BT: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, prefix_len: jax.Array | None = None,
                 deterministic: bool = True) -> jax.Array:
        """``positions`` restart in each packed segment (``segment_ids``, 0 = padding);
        ``prefix_len`` [B] for ``mask=prefix``."""
        cfg = self.config
        check_length(cfg, tokens_BT.shape[1])
        positions_BT = default_positions(tokens_BT) if positions is None else positions
        mask = build_mask(cfg.mask, positions_BT, positions_BT, prefix_len=prefix_len,
                          q_segments=segment_ids, kv_segments=segment_ids,
                          aligned=positions is None)
        positions_BT = encoding_positions(self, cfg, positions_BT, deterministic, segment_ids)
        # the bias of these queries against every key (all shards' when the sequence is split)
        bias_BHTT = self._bias(positions_BT, every_key(positions_BT))

        x_BTC = self.embed(tokens_BT, positions_BT)
        # A zero "perturbation" hook: lets tests take gradients w.r.t. the embedded inputs.
        x_BTC = self.perturb("embeddings", x_BTC)
        x_BTC = self.dropout(x_BTC, deterministic=deterministic)
        x_BTC = nn.with_logical_constraint(x_BTC, ("batch", "length", "embed"))
        x_BTC, _ = self.stack(x_BTC, positions=positions_BT, mask=mask, bias=bias_BHTT,
                              deterministic=deterministic)
        return self.head(x_BTC, self.embed)

    def _bias(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array | None:
        return None if self.relative_bias is None else self.relative_bias(q_pos, k_pos)

    # Decoding (the API every generating family shares; see sample.py) ---------------------

    @nn.nowrap
    def init_cache(self, batch_size: int, prompt_len: int, max_new_tokens: int) -> KVCache:
        """An empty cache for prompts of up to ``prompt_len`` tokens plus the new ones."""
        cfg = self.config
        return init_cache(cfg, batch_size, cfg.mask.cache_slots(prompt_len + max_new_tokens))

    def decode_step(self, tokens_BT: jax.Array, cache: KVCache,
                    lengths: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """``(logits [B, T, V], new cache)`` for new tokens attending to [cache, themselves]:
        a right-padded prompt batch (``lengths`` real tokens per row, default T) or one token
        per row. Positions continue from each row's cache index."""
        cfg = self.config
        check_length(cfg, tokens_BT.shape[1])
        step = plan_step(cache, tokens_BT.shape[1], lengths)
        mask = build_mask(cfg.mask, step.positions, step.kv_positions, kv_valid=step.kv_valid,
                          prefix_len=cache.prefix_len)
        # Padding slots of a prompt batch may lie past a learned table: look up row 0 for them
        # (they are never attended to) rather than read out of bounds.
        x_BTC = self.embed(tokens_BT, jnp.where(step.valid, step.positions, 0))
        x_BTC, (layers, _) = self.stack(
            x_BTC, positions=step.positions, mask=mask,
            bias=self._bias(step.positions, step.kv_positions), cache=cache.layers,
            write=step.write)
        return self.head(x_BTC, self.embed), cache.replace(**step.meta, layers=layers)

    def prefill(self, prompts_BP: jax.Array, lengths_B: jax.Array, cache: KVCache,
                bos_id: int | None = None) -> tuple[jax.Array, KVCache]:
        """Run the right-padded prompts through the cache: ``(logits [B, V] of each row's last
        prompt token, cache)``."""
        del bos_id  # a decoder-only model continues the prompt itself
        if self.config.mask.needs_prefix_len:  # prefix-LM: the prompt is the prefix
            cache = cache.replace(prefix_len=lengths_B)
        logits_BPV, cache = self.decode_step(prompts_BP, cache, lengths_B)
        return logits_BPV[jnp.arange(prompts_BP.shape[0]), lengths_B - 1], cache
