"""Transformer building blocks: projections, norms, MLPs, the attention layer and the block.

Shape legend: B batch, T length (Q queries, K keys), C model width, H query heads,
N key/value heads, D head dim, F MLP width, V vocabulary.

Parameters carry logical axis names (``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``,
``vocab``); the sharding layer maps them to mesh axes, so nothing here knows about devices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax.config import ModelConfig
from transformers_jax.nn.attention import attend_to_cache, dot_product_attention
from transformers_jax.nn.kvcache import CacheWrite, RowSlot, write_row_slot, write_slots
from transformers_jax.nn.masks import AttentionMask
from transformers_jax.registry import MLPS, NORMS


def dtype_of(name: str) -> Any:
    return jnp.dtype(name)


def normal_init(std: float, axes: tuple[str, ...]) -> Callable:
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


class Dense(nn.Module):
    """A linear map whose kernel keeps its logical shape (e.g. ``[C, H, D]``).

    The matmul itself is one 2-D ``[rows, in] @ [in, out]`` product: on XLA:CPU an einsum over
    ``[B, T, C]`` inserts a transpose copy before every weight-gradient matmul, while the 2-D
    form does not (measured about 1.8x faster outside attention). Accumulation is float32 even
    for bfloat16 compute, which is also what makes bfloat16 fast on AMX/TPU/GPU.
    """

    features: tuple[int, ...]
    axes: tuple[str, ...]  # logical names of the kernel's input dims followed by output dims
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
        kernel = self.param(
            "kernel",
            normal_init(self.std, self.axes),
            (*in_shape, *self.features),
            self.param_dtype,
        )
        y = jax.lax.dot_general(
            x.reshape(-1, n_in).astype(self.dtype),
            kernel.reshape(n_in, n_out).astype(self.dtype),
            (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(
                    nn.initializers.zeros, self.axes[len(self.axes) - len(self.features) :]
                ),
                self.features,
                self.param_dtype,
            )
            y = y + bias.reshape(n_out).astype(jnp.float32)
        return y.astype(self.dtype).reshape(*lead, *self.features)


# Norms -----------------------------------------------------------------------------------------
@NORMS.register("layernorm")
def _layernorm(config: ModelConfig, name: str | None = None) -> nn.Module:
    return nn.LayerNorm(
        epsilon=config.norm_eps,
        use_bias=config.use_bias,
        dtype=dtype_of(config.dtype),
        param_dtype=dtype_of(config.param_dtype),
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        name=name,
    )


@NORMS.register("rmsnorm")
def _rmsnorm(config: ModelConfig, name: str | None = None) -> nn.Module:
    return nn.RMSNorm(
        epsilon=config.norm_eps,
        dtype=dtype_of(config.dtype),
        param_dtype=dtype_of(config.param_dtype),
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        name=name,
    )


def make_norm(config: ModelConfig, name: str | None = None) -> nn.Module:
    return NORMS.get(config.norm)(config, name=name)


# MLPs ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MLPKind:
    activation: Callable[[jax.Array], jax.Array]
    gated: bool  # gated: act(x W_gate) * (x W_up), as in SwiGLU


MLPS.add("gelu", MLPKind(lambda x: nn.gelu(x, approximate=True), gated=False))  # GPT-2's tanh
MLPS.add("gelu_exact", MLPKind(lambda x: nn.gelu(x, approximate=False), gated=False))  # BERT
MLPS.add("relu", MLPKind(nn.relu, gated=False))
MLPS.add("swiglu", MLPKind(nn.silu, gated=True))  # Llama
MLPS.add("geglu", MLPKind(lambda x: nn.gelu(x, approximate=True), gated=True))  # T5 v1.1


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTC: jax.Array) -> jax.Array:
        cfg = self.config
        kind = MLPS.get(cfg.mlp)
        dense = dict(
            use_bias=cfg.use_bias,
            dtype=dtype_of(cfg.dtype),
            param_dtype=dtype_of(cfg.param_dtype),
        )
        h_BTF = Dense((cfg.ff_dim,), ("embed", "mlp"), std=cfg.init_std, name="up", **dense)(
            x_BTC
        )
        if kind.gated:
            gate_BTF = Dense(
                (cfg.ff_dim,), ("embed", "mlp"), std=cfg.init_std, name="gate", **dense
            )(x_BTC)
            h_BTF = kind.activation(gate_BTF) * h_BTF
        else:
            h_BTF = kind.activation(h_BTF)
        h_BTF = nn.with_logical_constraint(h_BTF, ("batch", "length", "mlp"))
        return Dense(
            (cfg.d_model,), ("mlp", "embed"), std=residual_std(cfg), name="down", **dense
        )(h_BTF)


def residual_std(cfg: ModelConfig) -> float:
    """GPT-2's scaled init for projections that write into the residual stream."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


# Attention -------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Multi-head attention (MHA, GQA or MQA) with the position and mask switches plugged in.

    Self-attention when ``kv_inputs`` is None, cross-attention otherwise. In self-attention
    positions enter through the scheme's ``rotate`` hook (rope, xpos) and through ``bias``
    (ALiBi, T5, FIRE, ...; computed once by the stack); cross-attention (``cross=True``:
    queries and keys from different sequences) has no position term.
    """

    config: ModelConfig
    cross: bool = False

    @nn.compact
    def __call__(
        self,
        x_BQC: jax.Array,
        *,
        positions: jax.Array,
        mask: AttentionMask | jax.Array | None,
        bias: jax.Array | None = None,
        kv_inputs: jax.Array | None = None,
        kv_positions: jax.Array | None = None,
        cache: dict | None = None,
        cache_write: CacheWrite | RowSlot | None = None,
        cross_kv: dict | None = None,
        return_kv: bool = False,
    ):
        """Returns the output ``[B, Q, C]``, or ``(output, new_cache)`` when given a cache.

        With a cache, ``mask`` and ``bias`` must cover the keys ``[cached slots, new tokens]``
        (the model builds them once for all layers); new keys and values are stored as planned
        by ``cache_write``. Cross-attention decoding projects the encoder output once:
        ``return_kv=True`` returns ``(output, {"key", "value"})`` (heads-first ``[B, N, K, D]``,
        as the cache) and later calls pass them back as ``cross_kv`` instead of ``kv_inputs``.
        A decoding step (one query per row) reads the cache with ``attend_to_cache`` whatever
        ``config.attention`` is: for one query they compute the same thing, and that one reads
        the heads-first cache without copying it.
        """
        cfg = self.config
        H, N, D = cfg.n_heads, cfg.kv_heads, cfg.dims_per_head
        dense = dict(
            use_bias=cfg.use_bias,
            dtype=dtype_of(cfg.dtype),
            param_dtype=dtype_of(cfg.param_dtype),
        )
        kv_BKC = x_BQC if kv_inputs is None else kv_inputs
        kv_positions = positions if kv_positions is None else kv_positions

        q_BQHD = Dense((H, D), ("embed", "heads", "head_dim"), std=cfg.init_std, name="query",
                       **dense)(x_BQC)
        if cfg.qk_norm:  # normalise each head's q and k: keeps logits bounded at high LR
            q_BQHD = nn.RMSNorm(epsilon=cfg.norm_eps, dtype=dense["dtype"], name="query_norm")(
                q_BQHD
            )
        if not self.cross:
            q_BQHD = cfg.position.rotate(cfg, q_BQHD, positions, "query")

        project_out = Dense((cfg.d_model,), ("heads", "head_dim", "embed"), in_dims=2,
                            std=residual_std(cfg), name="out", **dense)
        attend = functools.partial(
            dot_product_attention, bias=bias, mask=mask, implementation=cfg.attention,
            scale=cfg.attention_scale, logit_softcap=cfg.attn_logit_softcap)
        decode = functools.partial(attend_to_cache, bias=bias, mask=mask,
                                   scale=cfg.attention_scale, logit_softcap=cfg.attn_logit_softcap)

        if cross_kv is not None:  # encoder keys/values projected once, stored heads-first
            k_BNKD, v_BNKD = cross_kv["key"], cross_kv["value"]
            if q_BQHD.shape[1] == 1:
                out_BQHD = decode(q_BQHD, k_BNKD.astype(q_BQHD.dtype), v_BNKD.astype(q_BQHD.dtype))
            else:
                out_BQHD = attend(q_BQHD, _seq_first(k_BNKD, q_BQHD.dtype),
                                  _seq_first(v_BNKD, q_BQHD.dtype))
            out_BQC = project_out(out_BQHD)
            return (out_BQC, cross_kv) if return_kv else out_BQC

        k_BKND = Dense((N, D), ("embed", "kv_heads", "head_dim"), std=cfg.init_std,
                       name="key", **dense)(kv_BKC)
        v_BKND = Dense((N, D), ("embed", "kv_heads", "head_dim"), std=cfg.init_std,
                       name="value", **dense)(kv_BKC)
        if cfg.qk_norm:
            k_BKND = nn.RMSNorm(epsilon=cfg.norm_eps, dtype=dense["dtype"],
                                name="key_norm")(k_BKND)
        if not self.cross:
            k_BKND = cfg.position.rotate(cfg, k_BKND, kv_positions, "key")

        if isinstance(cache_write, RowSlot):  # one token per row, in the order it asks for
            k_new, v_new = _heads_first(k_BKND), _heads_first(v_BKND)  # [B, N, 1, D]
            new_cache = {
                "key": write_row_slot(cache["key"], k_new, cache_write, axis=2),
                "value": write_row_slot(cache["value"], v_new, cache_write, axis=2),
            }
            dtype = q_BQHD.dtype
            if cache_write.read_first:
                out_BQHD = decode(q_BQHD, cache["key"].astype(dtype),
                                  cache["value"].astype(dtype), k_new=k_new.astype(dtype),
                                  v_new=v_new.astype(dtype))
            else:
                out_BQHD = decode(q_BQHD, new_cache["key"].astype(dtype),
                                  new_cache["value"].astype(dtype))
            return project_out(out_BQHD), new_cache
        if cache is not None:  # prefill: attend over [cached slots, new tokens]; then store them
            new_cache = {
                name: write_slots(cache[name], _heads_first(new).astype(cache[name].dtype),
                                  cache_write, axis=2)
                for name, new in (("key", k_BKND), ("value", v_BKND))
            }
            k_all = jnp.concatenate([_seq_first(cache["key"], k_BKND.dtype), k_BKND], axis=1)
            v_all = jnp.concatenate([_seq_first(cache["value"], v_BKND.dtype), v_BKND], axis=1)
            return project_out(attend(q_BQHD, k_all, v_all)), new_cache

        out_BQC = project_out(attend(q_BQHD, k_BKND, v_BKND))
        if return_kv:  # stored heads-first, as the KV cache
            return out_BQC, {"key": _heads_first(k_BKND), "value": _heads_first(v_BKND)}
        return out_BQC


def _heads_first(x_BKND: jax.Array) -> jax.Array:
    return x_BKND.transpose(0, 2, 1, 3)


def _seq_first(x_BNKD: jax.Array, dtype) -> jax.Array:
    return x_BNKD.transpose(0, 2, 1, 3).astype(dtype)


class Block(nn.Module):
    """One transformer layer: attention then MLP, each with a residual and a norm.

    Pre-norm: ``x + f(norm(x))`` (GPT-2 onwards); post-norm: ``norm(x + f(x))`` (the original
    transformer and BERT).
    """

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        x_BTC: jax.Array,
        *,
        positions: jax.Array,
        mask: AttentionMask | jax.Array | None,
        bias: jax.Array | None = None,
        deterministic: bool = True,
        cache: dict | None = None,
        cache_write: CacheWrite | RowSlot | None = None,
    ):
        """Returns ``[B, T, C]``, or ``(output, new_cache)`` when given this layer's cache."""
        cfg = self.config
        drop = nn.Dropout(cfg.dropout)
        attention = Attention(cfg, name="attention")
        mlp = MLP(cfg, name="mlp")
        norm1, norm2 = make_norm(cfg, "norm1"), make_norm(cfg, "norm2")

        new_cache = None

        def attend(h):
            nonlocal new_cache
            if cache is None:
                return attention(h, positions=positions, mask=mask, bias=bias)
            out, new_cache = attention(
                h, positions=positions, mask=mask, bias=bias, cache=cache, cache_write=cache_write
            )
            return out

        if cfg.norm_position == "pre":
            x_BTC = x_BTC + drop(attend(norm1(x_BTC)), deterministic=deterministic)
            x_BTC = x_BTC + drop(mlp(norm2(x_BTC)), deterministic=deterministic)
        else:
            x_BTC = norm1(x_BTC + drop(attend(x_BTC), deterministic=deterministic))
            x_BTC = norm2(x_BTC + drop(mlp(x_BTC), deterministic=deterministic))
        x_BTC = nn.with_logical_constraint(x_BTC, ("batch", "length", "embed"))
        return x_BTC if cache is None else (x_BTC, new_cache)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """Gemma-2 style soft cap: ``cap * tanh(x / cap)``; identity when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def count_params(params: Any) -> int:
    return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))
