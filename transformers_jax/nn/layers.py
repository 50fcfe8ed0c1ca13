"""Transformer building blocks: projections, the MLP, attention, the block, embedding and head.

Shape legend: B batch, T length (Q queries, K keys), C model width, H query heads,
N key/value heads, D head dim, F MLP width, V vocabulary.

Parameters carry logical axis names (``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``,
``vocab``); the sharding layer maps them to mesh axes, so nothing here knows about devices.
Activations that remat policies may keep or drop by name are tagged with ``checkpoint_name``
(see ``nn/stack.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from transformers_jax import backends
from transformers_jax.config import ModelConfig
from transformers_jax.nn.attention import attend_to_cache, dot_product_attention
from transformers_jax.nn.kvcache import CacheWrite, LayerKV, RowSlot, write_row_slot, write_slots
from transformers_jax.nn.masks import AttentionMask

Mask = AttentionMask | jax.Array | None


def dtype_of(name: str) -> Any:
    return jnp.dtype(name)


def normal_init(std: float, axes: tuple[str | None, ...]) -> Callable:
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


def residual_std(cfg: ModelConfig) -> float:
    """GPT-2's scaled init for projections that write into the residual stream."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """Gemma-2 style soft cap: ``cap * tanh(x / cap)``; identity when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def count_params(params: Any) -> int:
    return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))


class Dense(nn.Module):
    """A linear map whose kernel keeps its logical shape (e.g. ``[C, H, D]``).

    The matmul itself is one 2-D ``[rows, in] @ [in, out]`` product, a ``dot_general`` with
    float32 sums even for bfloat16 compute (which is also what makes bfloat16 fast on
    AMX/TPU/GPU): ``backends.matmul``, whose gradients a platform may compute its own way
    (XLA:CPU: ``backends/cpu.py``). On XLA:CPU an einsum over ``[B, T, C]`` inserts a transpose
    copy before every weight-gradient matmul, while the 2-D form does not (measured about 1.8x
    faster outside attention).
    """

    features: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical names of the kernel's input then output dims
    in_dims: int = 1  # how many trailing input dims are contracted
    use_bias: bool = True
    std: float = 0.02
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        in_shape = x.shape[x.ndim - self.in_dims :]
        lead = x.shape[: x.ndim - self.in_dims]
        n_in, n_out = math.prod(in_shape), math.prod(self.features)
        kernel = self.param("kernel", normal_init(self.std, self.axes),
                            (*in_shape, *self.features), self.param_dtype)
        y = backends.matmul(x.reshape(-1, n_in).astype(self.dtype),
                            kernel.reshape(n_in, n_out).astype(self.dtype))  # [R, O] float32
        if self.use_bias:
            out_axes = self.axes[len(self.axes) - len(self.features) :]
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, out_axes),
                              self.features, self.param_dtype)
            y = y + bias.reshape(n_out).astype(jnp.float32)
        return y.astype(self.dtype).reshape(*lead, *self.features)


def dense(cfg: ModelConfig, features: tuple[int, ...], axes: tuple[str, ...], name: str, *,
          in_dims: int = 1, std: float | None = None) -> Dense:
    """A ``Dense`` with the config's bias, init and dtypes."""
    return Dense(features, axes, in_dims=in_dims, use_bias=cfg.use_bias,
                 std=cfg.init_std if std is None else std, dtype=dtype_of(cfg.dtype),
                 param_dtype=dtype_of(cfg.param_dtype), name=name)


class MLP(nn.Module):
    """``[B, T, C] -> [B, T, C]``: up (and gate) to F, the ``mlp`` switch's activation, down."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTC: jax.Array) -> jax.Array:
        cfg = self.config
        kind = cfg.mlp
        h_BTF = dense(cfg, (cfg.ff_dim,), ("embed", "mlp"), "up")(x_BTC)
        # the platform's way to run an activation (XLA:CPU: in float32, rounded once)
        if kind.gated:
            gate_BTF = dense(cfg, (cfg.ff_dim,), ("embed", "mlp"), "gate")(x_BTC)
            h_BTF = backends.elementwise(lambda h, g: kind.activation(g) * h, h_BTF, gate_BTF)
        else:
            h_BTF = backends.elementwise(kind.activation, h_BTF)
        h_BTF = checkpoint_name(nn.with_logical_constraint(h_BTF, ("batch", "length", "mlp")),
                                "mlp_hidden")
        out_BTC = dense(cfg, (cfg.d_model,), ("mlp", "embed"), "down", std=residual_std(cfg))(h_BTF)
        return checkpoint_name(out_BTC, "mlp_out")


def _heads_first(x_BKND: jax.Array, dtype=None) -> jax.Array:
    return x_BKND.transpose(0, 2, 1, 3).astype(dtype or x_BKND.dtype)


def _seq_first(x_BNKD: jax.Array, dtype) -> jax.Array:
    return x_BNKD.transpose(0, 2, 1, 3).astype(dtype)


class Attention(nn.Module):
    """Multi-head attention (MHA, GQA or MQA) with the mask and position switches plugged in.

    Self-attention (keys and values from ``x``, positions through the scheme's ``rotate`` hook,
    its bias in ``bias``), or with ``cross=True`` attention to an encoder output ``kv_BKC``
    (no position term: queries and keys come from different sequences).

    Returns ``(out [B, Q, C], new_cache)``. Without a ``cache`` the second item is None. With
    one (decoding), ``mask`` and ``bias`` cover ``[cached slots, new tokens]`` (self) or the
    encoder tokens (cross): self-attention stores the new keys/values as ``write`` plans;
    cross-attention projects ``kv_BKC`` into the cache when given (the first step) and reads
    the cache otherwise. A step with one query per row reads the heads-first cache in place
    with ``attend_to_cache`` (the same maths as every implementation, no copy of the cache).
    """

    config: ModelConfig
    cross: bool = False

    @nn.compact
    def __call__(self, x_BQC: jax.Array, *, positions: jax.Array, mask: Mask,
                 bias: jax.Array | None = None, kv_BKC: jax.Array | None = None,
                 cache: LayerKV | None = None, write: CacheWrite | RowSlot | None = None):
        cfg = self.config
        q_BQHD = self._project(x_BQC, "query", cfg.n_heads)
        if self.cross:
            out_BQHD, new_cache = self._cross(q_BQHD, kv_BKC, mask, cache)
        else:
            k_BKND = self._project(x_BQC, "key", cfg.kv_heads)
            v_BKND = self._project(x_BQC, "value", cfg.kv_heads)
            q_BQHD = cfg.position.rotate(cfg, q_BQHD, positions, "query")
            k_BKND = cfg.position.rotate(cfg, k_BKND, positions, "key")
            out_BQHD, new_cache = self._self(q_BQHD, k_BKND, v_BKND, mask, bias, cache, write)
        out_BQHD = checkpoint_name(out_BQHD, "attention_out")
        out_BQC = dense(cfg, (cfg.d_model,), ("heads", "head_dim", "embed"), "out", in_dims=2,
                        std=residual_std(cfg))(out_BQHD)
        return out_BQC, new_cache

    @nn.nowrap
    def _project(self, x_BTC: jax.Array, name: str, heads: int) -> jax.Array:
        """``[B, T, C] -> [B, T, heads, D]`` (query, key or value), q/k RMS-normalised per head
        with ``qk_norm`` (it keeps logits bounded at high learning rates)."""
        cfg = self.config
        axes = ("embed", "heads" if name == "query" else "kv_heads", "head_dim")
        y_BTHD = dense(cfg, (heads, cfg.dims_per_head), axes, name)(x_BTC)
        if cfg.qk_norm and name != "value":
            # with the eps of the model's norm (QK-norm has no setting of its own)
            y_BTHD = nn.RMSNorm(epsilon=cfg.norm.eps, dtype=dtype_of(cfg.dtype),
                                name=f"{name}_norm")(y_BTHD)
        return checkpoint_name(y_BTHD, f"{name}_proj")

    @nn.nowrap
    def _attend(self, q, k, v, mask, bias) -> jax.Array:
        cfg = self.config
        return dot_product_attention(q, k, v, bias=bias, mask=mask, implementation=cfg.attention,
                                     scale=cfg.attention_scale,
                                     logit_softcap=cfg.attn_logit_softcap)

    @nn.nowrap
    def _decode(self, q, k, v, mask, bias, **new) -> jax.Array:
        cfg = self.config
        k_new, v_new = new.get("k_new"), new.get("v_new")
        return attend_to_cache(
            q, k.astype(q.dtype), v.astype(q.dtype), mask=mask, bias=bias,
            k_new=None if k_new is None else k_new.astype(q.dtype),
            v_new=None if v_new is None else v_new.astype(q.dtype),
            scale=cfg.attention_scale, logit_softcap=cfg.attn_logit_softcap)

    @nn.nowrap
    def _self(self, q_BQHD, k_BKND, v_BKND, mask, bias, cache, write):
        if cache is None:
            return self._attend(q_BQHD, k_BKND, v_BKND, mask, bias), None
        k_new, v_new = _heads_first(k_BKND), _heads_first(v_BKND)  # [B, N, T, D]
        if isinstance(write, RowSlot):  # one token per row, in the order it asks for
            if write.read_first:
                out = self._decode(q_BQHD, cache.key, cache.value, mask, bias,
                                   k_new=k_new, v_new=v_new)
                # stored where out was read from: after that read (a backend may tie them)
                k_new, v_new = backends.ordered_after((k_new, v_new), out)
                return out, LayerKV(write_row_slot(cache.key, k_new, write, axis=2),
                                    write_row_slot(cache.value, v_new, write, axis=2))
            new = LayerKV(write_row_slot(cache.key, k_new, write, axis=2),
                          write_row_slot(cache.value, v_new, write, axis=2))
            return self._decode(q_BQHD, new.key, new.value, mask, bias), new
        # prefill: attend over [cached slots, new tokens], then store the new ones
        new = LayerKV(write_slots(cache.key, k_new.astype(cache.key.dtype), write, axis=2),
                      write_slots(cache.value, v_new.astype(cache.value.dtype), write, axis=2))
        k_all = jnp.concatenate([_seq_first(cache.key, k_BKND.dtype), k_BKND], axis=1)
        v_all = jnp.concatenate([_seq_first(cache.value, v_BKND.dtype), v_BKND], axis=1)
        return self._attend(q_BQHD, k_all, v_all, mask, bias), new

    @nn.nowrap
    def _cross(self, q_BQHD, kv_BKC, mask, cache):
        if kv_BKC is not None:  # training, or the first decoding step: project the encoder
            k_BKND = self._project(kv_BKC, "key", self.config.kv_heads)
            v_BKND = self._project(kv_BKC, "value", self.config.kv_heads)
            if cache is None:
                return self._attend(q_BQHD, k_BKND, v_BKND, mask, None), None
            dtype = cache.key.dtype
            cache = LayerKV(_heads_first(k_BKND, dtype), _heads_first(v_BKND, dtype))
        if q_BQHD.shape[1] == 1:
            return self._decode(q_BQHD, cache.key, cache.value, mask, None), cache
        out = self._attend(q_BQHD, _seq_first(cache.key, q_BQHD.dtype),
                           _seq_first(cache.value, q_BQHD.dtype), mask, None)
        return out, cache


class Block(nn.Module):
    """One transformer layer: self-attention, then (``cross=True``, an encoder-decoder's
    decoder) cross-attention to the encoder output, then the MLP; each with a residual and a
    norm. Pre-norm: ``x + f(norm(x))`` (GPT-2 onwards); post-norm: ``norm(x + f(x))`` (the
    original transformer and BERT).

    Returns ``(x [B, T, C], self-attention cache, cross-attention cache)``; the caches are None
    unless given (decoding).
    """

    config: ModelConfig
    cross: bool = False

    @nn.compact
    def __call__(self, x_BTC: jax.Array, *, positions: jax.Array, mask: Mask,
                 bias: jax.Array | None = None, encoded: jax.Array | None = None,
                 cross_mask: Mask = None, deterministic: bool = True,
                 cache: LayerKV | None = None, cross_cache: LayerKV | None = None,
                 write: CacheWrite | RowSlot | None = None):
        cfg = self.config
        drop = nn.Dropout(cfg.dropout)

        def residual(x, f, norm_name):
            norm = cfg.norm.layer(cfg, norm_name)
            return cfg.norm_position.residual(
                x, f, norm, lambda h: drop(h, deterministic=deterministic))

        caches = {}

        def self_attention(h):
            out, caches["self"] = Attention(cfg, name="attention")(
                h, positions=positions, mask=mask, bias=bias, cache=cache, write=write)
            return out

        def cross_attention(h):
            out, caches["cross"] = Attention(cfg, cross=True, name="cross_attention")(
                h, positions=positions, mask=cross_mask, kv_BKC=encoded, cache=cross_cache)
            return out

        x_BTC = residual(x_BTC, self_attention, "norm1")
        if self.cross:
            x_BTC = residual(x_BTC, cross_attention, "norm_cross")
        x_BTC = residual(x_BTC, MLP(cfg, name="mlp"), "norm2")
        x_BTC = nn.with_logical_constraint(x_BTC, ("batch", "length", "embed"))
        return x_BTC, caches["self"], caches.get("cross")


def make_embed(cfg: ModelConfig, rows: int, axes: tuple[str | None, str]) -> nn.Embed:
    """A ``[rows, C]`` embedding table with the config's init and dtypes (``axes``: logical
    partitioning); one place for the token, learned-position and BERT token-type tables."""
    return nn.Embed(rows, cfg.d_model, embedding_init=normal_init(cfg.init_std, axes),
                    param_dtype=dtype_of(cfg.param_dtype), dtype=dtype_of(cfg.dtype))


def tied_logits(x_BTC: jax.Array, table_VC: jax.Array, dtype: Any) -> jax.Array:
    """Logits ``[B, T, V]`` float32 of a tied output projection: ``x`` against the token table,
    both in the compute ``dtype`` (float32 sums: in a lower compute dtype ``nn.Embed.attend``
    rounded the logits, and XLA:CPU widened its operands)."""
    *lead, c = x_BTC.shape
    logits_RV = backends.matmul_transposed(x_BTC.reshape(-1, c).astype(dtype),
                                           table_VC.astype(dtype))
    return logits_RV.reshape(*lead, -1)


class Embedder(nn.Module):
    """Token embedding plus the position scheme's embedding, if it has one (learned,
    sinusoidal); ``attend`` is the tied output projection, so the two share one table."""

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        self.tokens = make_embed(cfg, cfg.vocab_size, ("vocab", "embed"))
        self.table = cfg.position.embedding(cfg)
        self.token_scale = cfg.position.token_scale(cfg)

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
        x_BTC = self.tokens(tokens_BT)
        if self.token_scale != 1.0:
            x_BTC = x_BTC * jnp.asarray(self.token_scale, x_BTC.dtype)
        if self.table is not None:
            x_BTC = x_BTC + self.table(positions_BT).astype(x_BTC.dtype)
        return x_BTC

    def attend(self, x_BTC: jax.Array) -> jax.Array:
        return tied_logits(x_BTC, self.tokens.embedding, self.tokens.dtype)

    def table_VC(self) -> jax.Array:
        """The token table ``[V, C]`` (what a tied output projection multiplies by)."""
        return self.tokens.embedding


class LMHead(nn.Module):
    """``[B, T, C] -> logits [B, T, V]`` float32: the token table transposed when tied (pass
    ``embed``), else a ``lm_head`` kernel of its own; then the final soft-cap. Share its scope
    with the model (``nn.share_scope``) so ``lm_head`` sits beside ``embed``."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTC: jax.Array, embed: Embedder | None = None) -> jax.Array:
        cfg = self.config
        if cfg.tie_embeddings:
            logits_BTV = embed.attend(x_BTC)
        else:
            logits_BTV = nn.Dense(cfg.vocab_size, use_bias=False,
                                  kernel_init=normal_init(cfg.init_std, ("embed", "vocab")),
                                  dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype),
                                  name="lm_head")(x_BTC)
        logits_BTV = softcap(logits_BTV.astype(jnp.float32), cfg.final_logit_softcap)
        return nn.with_logical_constraint(logits_BTV, ("batch", "length", "vocab"))

