"""Rematerialisation by policy name, and the layer stack as a Python loop or one ``nn.scan``.

Shape legend: B batch, T length, C model width, L layers.

``remat`` trades compute for memory: the backward pass recomputes what the forward pass did not
keep. The policy says what is kept:

====================================  ===========================================================
``none``                              keep everything (no remat; the default)
``full`` / ``nothing_saveable``       keep only each layer's input; recompute the whole layer
``dots_saveable``                     keep every matmul output, recompute the cheap elementwise
                                      work (norms, activations, softmax)
``dots_with_no_batch_dims_saveable``  keep the weight matmuls (q/k/v/out, MLP) but recompute the
                                      attention score/value products (batched dots): attention's
                                      ``[B, H, T, T]`` memory goes, the projections stay
====================================  ===========================================================

``scan=True`` runs the layers as one ``nn.scan`` over stacked parameters (a leading ``layers``
axis, logical name ``layers``): one layer is compiled instead of L, so compile time stops
growing with depth. ``stack_layer_params`` / ``unstack_layer_params`` convert between the two
parameter layouts, which compute the same function.

``apply_layers`` is called from a model's compact ``__call__`` in place of its
``for i in range(n_layers): x = Block(...)(x, ...)`` loop; with ``remat="none"`` and
``scan=False`` it builds exactly that loop and the same parameter tree (``layer_0``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.config import ConfigError, ModelConfig
from transformers_jax.nn.layers import Block

_cp = jax.checkpoint_policies
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,  # no remat at all
    "full": _cp.nothing_saveable,
    "nothing_saveable": _cp.nothing_saveable,
    "dots_saveable": _cp.dots_saveable,
    "dots_with_no_batch_dims_saveable": _cp.dots_with_no_batch_dims_saveable,
    "everything_saveable": _cp.everything_saveable,  # remat in name only: for comparisons
}

LAYERS_AXIS = "layers"


def check_remat(name: str) -> None:
    if name not in REMAT_POLICIES:
        raise ConfigError(
            f"remat={name!r} is not a known remat policy; valid choices: "
            f"{', '.join(REMAT_POLICIES)}"
        )


def remat_policy(name: str) -> Callable[..., bool] | None:
    """The ``jax.checkpoint`` policy called ``name`` (None for ``none``: no remat)."""
    check_remat(name)
    return REMAT_POLICIES[name]


class _Layer(Block):
    """``Block`` with a positional signature and ``deterministic`` as a static attribute.

    ``nn.remat`` and ``nn.scan`` pass arguments positionally and trace them, so the Python
    bool that switches dropout must not be one of them. Being a subclass (not a wrapper) keeps
    the parameter tree exactly that of ``Block``.
    """

    deterministic: bool = True
    scanned: bool = False  # nn.scan wants (carry, output); the carry is the residual stream

    def __call__(self, x_BTC, positions, mask, bias):
        y_BTC = super().__call__(
            x_BTC, positions=positions, mask=mask, bias=bias, deterministic=self.deterministic
        )
        return (y_BTC, None) if self.scanned else y_BTC


def layer_class(remat: str = "none", *, scanned: bool = False) -> type[nn.Module]:
    """The per-layer module: ``_Layer``, wrapped in ``nn.remat`` with the named policy."""
    policy = remat_policy(remat)
    if remat == "none":
        return _Layer
    # Inside a scan, CSE across iterations is impossible anyway; outside, keep JAX's default.
    return nn.remat(_Layer, policy=policy, prevent_cse=not scanned)


def apply_layers(
    config: ModelConfig,
    x_BTC: jax.Array,
    *,
    positions: jax.Array,
    mask: Any,
    bias: jax.Array | None = None,
    deterministic: bool = True,
    remat: str = "none",
    scan: bool = False,
) -> jax.Array:
    """Run ``config.n_layers`` blocks over ``x_BTC [B, T, C]``; call from a compact method.

    Parameters live under ``layer_{i}`` (loop) or ``layers`` (scan, stacked on axis 0).
    """
    check_remat(remat)
    if not scan:
        if remat == "none":
            for i in range(config.n_layers):
                x_BTC = Block(config, name=f"layer_{i}")(
                    x_BTC, positions=positions, mask=mask, bias=bias, deterministic=deterministic
                )
            return x_BTC
        cls = layer_class(remat)
        for i in range(config.n_layers):
            x_BTC = cls(config, deterministic=deterministic, name=f"layer_{i}")(
                x_BTC, positions, mask, bias
            )
        return x_BTC
    stack = nn.scan(
        layer_class(remat, scanned=True),
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
        length=config.n_layers,
        metadata_params={nn.PARTITION_NAME: LAYERS_AXIS},
    )
    x_BTC, _ = stack(config, deterministic=deterministic, scanned=True, name=LAYERS_AXIS)(
        x_BTC, positions, mask, bias
    )
    return x_BTC


def decay_mask(params: dict) -> Any:
    """``train.optim.decay_mask`` (decay matrices only) for either layout: under ``layers`` the
    leading axis stacks layers, so a stacked norm scale ``[L, C]`` is still a vector and gets
    no weight decay. (Counting it as a matrix silently decays every norm scale and bias.)"""

    def is_matrix(path, x) -> bool:
        stacked = any(getattr(k, "key", None) == LAYERS_AXIS for k in path)
        return x.ndim - (1 if stacked else 0) >= 2

    return jax.tree_util.tree_map_with_path(is_matrix, params)


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
