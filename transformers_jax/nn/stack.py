"""The one layer stack every family runs: blocks in a loop or one ``nn.scan``, remat by policy
name, the final norm; and the positions the scheme's hooks see in training.

Shape legend: B batch, T length, C model width, L layers.

``remat`` trades compute for memory: the backward pass recomputes what the forward pass did not
keep. The policy (``model.remat``) says what is kept:

====================================  ===========================================================
``none``                              keep everything (no remat; the default)
``full`` / ``nothing_saveable``       keep only each layer's input; recompute the whole layer
``dots_saveable``                     keep every matmul output, recompute the cheap elementwise
                                      work (norms, activations, softmax)
``dots_with_no_batch_dims_saveable``  keep the weight matmuls (q/k/v/out, MLP) but recompute the
                                      attention score/value products (batched dots)
``save_qkv_proj``                     keep the q/k/v projections (tagged ``query_proj``,
                                      ``key_proj``, ``value_proj``), recompute the rest
``save_attention_out``                also keep each attention output (``attention_out``):
                                      the backward pass recomputes only the MLP and norms
``everything_saveable``               remat in name only: for comparisons
====================================  ===========================================================

``scan_layers`` runs the layers as one ``nn.scan`` over stacked parameters (a leading ``layers``
axis, logical name ``layers``): one layer is compiled instead of L, so compile time stops
growing with depth. ``stack_layer_params`` / ``unstack_layer_params`` convert between the two
parameter layouts, which compute the same function.

A model creates ``LayerStack`` and shares its scope (``nn.share_scope``), so the layers sit in
the model's own parameter tree (``layer_0`` ... or ``layers``, and ``final_norm``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.config import ConfigError, ModelConfig
from transformers_jax.nn.kvcache import CacheWrite, LayerKV, RowSlot
from transformers_jax.nn.layers import Block

_cp = jax.checkpoint_policies
_QKV = ("query_proj", "key_proj", "value_proj")
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,  # no remat at all
    "full": _cp.nothing_saveable,
    "nothing_saveable": _cp.nothing_saveable,
    "dots_saveable": _cp.dots_saveable,
    "dots_with_no_batch_dims_saveable": _cp.dots_with_no_batch_dims_saveable,
    "everything_saveable": _cp.everything_saveable,
    "save_qkv_proj": _cp.save_only_these_names(*_QKV),
    "save_attention_out": _cp.save_only_these_names(*_QKV, "attention_out"),
}

LAYERS_AXIS = "layers"


def remat_policy(name: str) -> Callable[..., bool] | None:
    """The ``jax.checkpoint`` policy called ``name`` (None for ``none``: no remat)."""
    if name not in REMAT_POLICIES:
        raise ConfigError(f"remat={name!r} is not a known remat policy; valid choices: "
                          f"{', '.join(REMAT_POLICIES)}")
    return REMAT_POLICIES[name]


class _Layer(Block):
    """``Block`` with a positional signature, static ``deterministic``, and the residual stream
    as its only output (what ``nn.remat``/``nn.scan`` want: they trace their arguments, so the
    Python bool that switches dropout must not be one). A subclass, so the parameter tree is
    exactly ``Block``'s."""

    deterministic: bool = True
    scanned: bool = False  # nn.scan wants (carry, output); the carry is the residual stream

    def __call__(self, x_BTC, positions, mask, bias, encoded, cross_mask):
        y_BTC, _, _ = super().__call__(x_BTC, positions=positions, mask=mask, bias=bias,
                                       encoded=encoded, cross_mask=cross_mask,
                                       deterministic=self.deterministic)
        return (y_BTC, None) if self.scanned else y_BTC


class LayerStack(nn.Module):
    """``n_layers`` blocks (with cross-attention when ``cross``), then the final norm of a
    pre-norm model. Returns ``(x [B, T, C], caches)``: caches are None without a ``cache``,
    else ``(self-attention LayerKVs, cross-attention LayerKVs or None)`` for the new cache."""

    config: ModelConfig
    n_layers: int
    cross: bool = False

    @nn.compact
    def __call__(self, x_BTC: jax.Array, *, positions: jax.Array, mask: Any,
                 bias: jax.Array | None = None, encoded: jax.Array | None = None,
                 cross_mask: Any = None, deterministic: bool = True,
                 cache: tuple[LayerKV, ...] | None = None,
                 cross_cache: tuple[LayerKV, ...] | None = None,
                 write: CacheWrite | RowSlot | None = None):
        cfg = self.config
        policy = remat_policy(cfg.remat)
        caches = None
        if cache is not None:  # decoding: a plain loop that threads each layer's cache
            if cfg.scan_layers:
                raise ValueError(
                    "KV-cache decoding reads each layer's parameters by name: convert scanned "
                    "parameters with nn.stack.unstack_layer_params and decode with "
                    "scan_layers=False")
            new_self, new_cross = [], []
            for i in range(self.n_layers):
                x_BTC, kv, cross_kv = Block(cfg, self.cross, name=f"layer_{i}")(
                    x_BTC, positions=positions, mask=mask, bias=bias, encoded=encoded,
                    cross_mask=cross_mask, cache=cache[i],
                    cross_cache=None if cross_cache is None else cross_cache[i], write=write)
                new_self.append(kv)
                new_cross.append(cross_kv)
            caches = (tuple(new_self), tuple(new_cross) if self.cross else None)
        elif cfg.scan_layers:
            layer = _Layer if policy is None else nn.remat(_Layer, policy=policy,
                                                           prevent_cse=False)
            stack = nn.scan(
                layer,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast,) * 5,
                length=self.n_layers,
                metadata_params={nn.PARTITION_NAME: LAYERS_AXIS},
            )
            x_BTC, _ = stack(cfg, self.cross, deterministic=deterministic, scanned=True,
                             name=LAYERS_AXIS)(x_BTC, positions, mask, bias, encoded, cross_mask)
        else:
            layer = _Layer if policy is None else nn.remat(_Layer, policy=policy)
            for i in range(self.n_layers):
                x_BTC = layer(cfg, self.cross, deterministic=deterministic, name=f"layer_{i}")(
                    x_BTC, positions, mask, bias, encoded, cross_mask)
        if cfg.norm_position.final_norm:
            x_BTC = cfg.norm.layer(cfg, "final_norm")(x_BTC)
        return x_BTC, caches


def encoding_positions(module: nn.Module, config: ModelConfig, positions_BT: jax.Array,
                       deterministic: bool, segment_ids: jax.Array | None = None) -> jax.Array:
    """The positions the scheme's hooks see: in training, those of ``train_positions``
    (randomized schemes draw them from the ``dropout`` RNG stream, the one the train step
    passes); otherwise those of ``eval_positions`` (the real ones, except for a scheme that
    evaluates as it trains). Masks always use the real positions."""
    if deterministic or not config.position.randomizes:
        return config.position.eval_positions(positions_BT, config, segment_ids)
    return config.position.train_positions(module.make_rng("dropout"), positions_BT, config,
                                           segment_ids)


def stack_layer_params(params: dict, n_layers: int) -> dict:
    """Loop layout (``layer_0`` ... ``layer_{L-1}``) -> scan layout (``layers``, axis 0 = L)."""
    params = dict(params)
    layers = [params.pop(f"layer_{i}") for i in range(n_layers)]
    params[LAYERS_AXIS] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return params


def unstack_layer_params(params: dict, n_layers: int) -> dict:
    """Scan layout -> loop layout (the inverse of ``stack_layer_params``)."""
    params = dict(params)
    stacked = params.pop(LAYERS_AXIS)
    for i in range(n_layers):
        params[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return params
