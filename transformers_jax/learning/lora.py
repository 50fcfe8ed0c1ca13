"""LoRA: low-rank adapters on a trained model's projections, the model itself frozen.

Each targeted projection's kernel ``W`` (a ``nn.layers.Dense`` kernel in its logical shape,
``[*in, *out]``, with a leading ``layers`` axis under ``scan_layers``) is used as

    W + scale * A @ B,   A: [*in, R] (Gaussian, std 1/sqrt(fan_in)),  B: [R, *out] (zeros)

so a fresh adapter leaves the model exactly as it was. ``LoraModel`` wraps any model built by
an objective: its params are ``{"base": the model's own, "lora": the adapters}``; its forward
pass folds the adapters into the (gradient-stopped) base kernels and applies the wrapped model
to the result.

Why fold before applying rather than add ``x @ A @ B`` beside each projection (peft's form):
the fold needs nothing from the model (``models/`` and ``nn/`` hold no LoRA branch, every
family, attention kernel, scan and KV-cache path works unchanged), the step stays one pure
jitted function, and the merge written on export is the same function, so a merged checkpoint
gives the very logits training saw. Its price: each targeted kernel exists twice during the
step (``W`` and the folded copy) and the backward pass forms the folded kernel's gradient
before reducing it to ``A`` and ``B`` (transient, one layer's projections at a time in
practice; the optimizer holds state for the adapters only, ``adapters_only``). Dropout on the
adapters' input (peft's ``lora_dropout``) has no place in this form and is not offered.

Which projections: ``find_targets`` runs the model's ``init`` abstractly, notes every ``Dense``
it calls (its path and how many input dims it contracts) and keeps those a pattern of
``LoraConfig.targets`` matches.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from transformers_jax.config import LoraConfig
from transformers_jax.learning.step import SkipsNonFinite
from transformers_jax.models import family_of
from transformers_jax.nn.layers import Dense
from transformers_jax.registry import ConfigError

BASE, LORA = "base", "lora"  # the two halves of a LoraModel's params
RANK_AXIS = "lora_rank"  # the adapters' logical axis (no sharding rule: replicated)


@dataclasses.dataclass(frozen=True)
class Target:
    """One adapted projection: where its kernel is and how its dims split."""

    path: tuple[str, ...]  # the Dense module's path in the params; its kernel is under it
    in_dims: int  # contracted (input) dims of the kernel, after the stacked ones
    stacked: int  # leading stacked-layer dims (1 under scan_layers, else 0)
    names: tuple[str | None, ...]  # the kernel's logical axis names

    def split(self, shape: tuple[int, ...]) -> tuple[tuple, tuple, tuple]:
        """``(stacked, in, out)`` parts of a kernel shape."""
        s, i = self.stacked, self.stacked + self.in_dims
        return tuple(shape[:s]), tuple(shape[s:i]), tuple(shape[i:])


def _matches(path: tuple[str, ...], pattern: str) -> bool:
    """``query`` or ``attention`` (a component of the path), or a glob over the path
    (``layer_0/attention/*``, also matched against every tail of it)."""
    joined = "/".join(path)
    return (
        pattern in path
        or fnmatch.fnmatchcase(joined, pattern)
        or fnmatch.fnmatchcase(joined, "*/" + pattern)
    )


def dense_layers(model: nn.Module, example: dict, inputs: dict) -> dict:
    """Every ``Dense`` the model calls: ``{path: (in_dims, out_dims, boxed kernel)}``, shapes
    only."""
    seen: dict[tuple[str, ...], tuple[int, int]] = {}

    def note(next_fun, args, kwargs, context):
        module = context.module
        if isinstance(module, Dense) and context.method_name == "__call__":
            seen[tuple(module.path)] = (module.in_dims, len(module.features))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(note):
        variables = jax.eval_shape(
            lambda key: model.init(key, example["inputs"], **inputs), jax.random.key(0)
        )
    params = variables["params"]
    out = {}
    for path, (in_dims, out_dims) in seen.items():
        out[path] = (in_dims, out_dims, _at(params, path)["kernel"])
    return out


def find_targets(
    model: nn.Module, example: dict, inputs: dict, lora: LoraConfig
) -> tuple[Target, ...]:
    """The projections of ``model`` that ``lora.targets`` names; a ``ConfigError`` naming the
    projections there are when a pattern matches none, or when the model has none."""
    layers = dense_layers(model, example, inputs)
    name = type(model).__name__
    if not layers:
        raise ConfigError(
            f"train.lora: {name} ({model.config.family}) has no projection "
            "LoRA can adapt (no Dense layer); fine-tune it without "
            "--train.lora.rank"
        )
    known = sorted({p[-1] for p in layers})
    for pattern in lora.targets:
        if not any(_matches(path, pattern) for path in layers):
            raise ConfigError(
                f"train.lora.targets: {pattern!r} matches no projection of {name}; its "
                f"projections are named {', '.join(known)} (modules: "
                f"{', '.join(sorted({c for p in layers for c in p[:-1]}))}), e.g. "
                f"--train.lora.targets=query,key,value,out or a glob such as 'layer_0/*'"
            )
    targets = []
    for path, (in_dims, out_dims, kernel) in sorted(layers.items()):
        if any(_matches(path, p) for p in lora.targets):
            value = getattr(kernel, "value", kernel)
            names = tuple(getattr(kernel, "names", (None,) * value.ndim))
            # dims before the input ones: a stacked-layer axis (scan_layers)
            targets.append(Target(path, in_dims, value.ndim - in_dims - out_dims, names))
    return tuple(targets)


def init_adapters(rng: jax.Array, base: Any, targets: tuple[Target, ...], rank: int) -> dict:
    """Boxed (logically named) adapters ``{*path: {"a", "b"}}`` for the unboxed ``base``:
    ``A`` Gaussian with std ``1/sqrt(fan_in)``, ``B`` zeros, in the kernel's dtype."""
    tree: dict = {}
    for i, t in enumerate(targets):
        kernel = _at(base, t.path)["kernel"]
        lead, ins, outs = t.split(kernel.shape)
        s, k = t.stacked, t.stacked + t.in_dims
        std = 1.0 / math.sqrt(math.prod(ins))
        a = std * jax.random.normal(jax.random.fold_in(rng, i), (*lead, *ins, rank), kernel.dtype)
        b = jnp.zeros((*lead, rank, *outs), kernel.dtype)
        node = tree
        for key in t.path:
            node = node.setdefault(key, {})
        node["a"] = nn.LogicallyPartitioned(a, (*t.names[:k], RANK_AXIS))
        node["b"] = nn.LogicallyPartitioned(b, (*t.names[:s], RANK_AXIS, *t.names[k:]))
    return tree


def _at(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def delta(target: Target, a: jax.Array, b: jax.Array, scale: float, shape) -> jax.Array:
    """``scale * A @ B`` in float32, in the kernel's logical ``shape``."""
    lead, ins, outs = target.split(shape)
    a2 = a.reshape(*lead, math.prod(ins), -1).astype(jnp.float32)
    b2 = b.reshape(*lead, -1, math.prod(outs)).astype(jnp.float32)
    return (scale * jnp.einsum("...ir,...ro->...io", a2, b2)).reshape(shape)


def merge(base: Any, adapters: Any, targets: tuple[Target, ...], scale: float) -> Any:
    """``base`` with every target kernel replaced by ``W + scale * A @ B`` (summed in float32,
    stored in the kernel's dtype): a plain parameter tree of the wrapped model."""
    merged = jax.tree.map(lambda x: x, base)  # new dicts; the arrays are shared
    for t in targets:
        module, ab = _at(merged, t.path), _at(adapters, t.path)
        w = module["kernel"]
        module["kernel"] = (
            w.astype(jnp.float32) + delta(t, ab["a"], ab["b"], scale, w.shape)
        ).astype(w.dtype)
    return merged


class LoraModel(nn.Module):
    """``inner`` with adapters: params ``{"base": inner's, "lora": adapters}``; the forward
    pass is ``inner`` applied to ``merge(stop_gradient(base), lora)``, so no gradient reaches
    the base. Takes whatever inputs and keywords ``inner`` takes."""

    inner: nn.Module
    targets: tuple[Target, ...]
    rank: int
    scale: float

    @property
    def config(self):  # the wrapped model's, which the objectives read (its family's inputs)
        return self.inner.config

    @nn.nowrap
    def plain(self) -> nn.Module:
        """The wrapped model, unbound: what a merged checkpoint holds."""
        return self.inner.clone(parent=None)

    @nn.nowrap
    def merged(self, params: Any) -> Any:
        """The wrapped model's params with the adapters folded in (export, sampling)."""
        return merge(params[BASE], params[LORA], self.targets, self.scale)

    @nn.compact
    def __call__(self, *args, **kwargs):
        inner = self.plain()
        base = self.param(BASE, lambda key: inner.init(key, *args, **kwargs)["params"])
        adapters = self.param(
            LORA, lambda key: init_adapters(key, nn.meta.unbox(base), self.targets, self.rank)
        )
        params = merge(jax.lax.stop_gradient(base), adapters, self.targets, self.scale)
        rngs = {"dropout": self.make_rng("dropout")} if self.has_rng("dropout") else None
        return inner.apply({"params": params}, *args, rngs=rngs, **kwargs)


def with_lora(model: nn.Module, lora: LoraConfig, example: dict, inputs: dict) -> nn.Module:
    """``model`` wrapped in adapters as ``lora`` says (``model`` itself when LoRA is off);
    ``example``/``inputs``: a batch's ``inputs`` and keyword inputs, to find the targets."""
    if not lora.enabled:
        return model
    targets = find_targets(model, example, inputs, lora)
    return LoraModel(model, targets, lora.rank, lora.scale)


def plain_model(model: nn.Module) -> nn.Module:
    """The model a checkpoint of ``model``'s merged params loads into."""
    return model.plain() if isinstance(model, LoraModel) else model


def plain_params(model: nn.Module, params: Any) -> Any:
    """``params`` of ``model`` as ``plain_model(model)`` takes them (adapters folded in)."""
    return model.merged(params) if isinstance(model, LoraModel) else params


def _adapter_mask(params: Any) -> Any:
    """True on the adapters, False on the frozen base. optax's tree utilities call ``init``
    with a placeholder for the whole tree: every leaf of it is trained."""
    if not isinstance(params, dict) or set(params) != {BASE, LORA}:
        return True
    return {
        BASE: jax.tree.map(lambda _: False, params[BASE]),
        LORA: jax.tree.map(lambda _: True, params[LORA]),
    }


def adapters_only(optimizer: SkipsNonFinite) -> SkipsNonFinite:
    """``optimizer`` on the adapters of a ``LoraModel``'s params, nothing on the base: its
    state holds moments for the adapters only (``optax.MaskedNode`` where the base is), and the
    base's update is its gradient, zero behind the stop-gradient."""
    masked = optax.masked(optimizer, _adapter_mask)
    return SkipsNonFinite(masked.init, masked.update)


def adapter_state(state: Any) -> Any:
    """The part of a LoRA run's ``TrainState`` a checkpoint holds: all but the base."""
    return state.replace(params={LORA: state.params[LORA]})


def with_base(state: Any, base: Any) -> Any:
    """``adapter_state``'s inverse: the base put back."""
    return state.replace(params={BASE: base, LORA: state.params[LORA]})


def wrap(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """``with_lora`` on the example inputs of ``model``'s family (its config's)."""
    if not lora.enabled:
        return model
    config = model.config
    tokens, inputs = family_of(config).example_inputs(config, min(8, config.max_len))
    return with_lora(model, lora, {"inputs": tokens}, inputs)


def trainable_count(params: Any) -> int:
    """Parameters the optimizer moves: the adapters of a LoRA tree, else all of them."""
    if isinstance(params, dict) and set(params) == {BASE, LORA}:
        params = params[LORA]
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


def memory_count(model: nn.Module, lora: LoraConfig) -> dict[str, int]:
    """Bytes a fine-tune of ``model`` keeps between steps, full versus LoRA (shapes only).

    Full: the weights, their gradients and AdamW's two moments (4x the weights, in the
    parameter dtype). LoRA: the weights once, and the same four copies of the adapters only
    (``adapter_bytes`` one copy, ``adapter_optimizer_bytes`` the two moments).
    ``lora_step_extra``: what the LoRA step adds while it runs, at most (every folded target
    kernel and its gradient alive at once; XLA frees them layer by layer)."""
    wrapped = wrap(model, lora)
    config = model.config
    tokens, inputs = family_of(config).example_inputs(config, min(8, config.max_len))
    shapes = nn.meta.unbox(
        jax.eval_shape(lambda key: wrapped.init(key, tokens, **inputs), jax.random.key(0))["params"]
    )

    def nbytes(tree) -> int:
        return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))

    base, adapters = shapes[BASE], shapes[LORA]
    targets = [_at(base, t.path)["kernel"] for t in wrapped.targets]
    return {
        "params": trainable_count(base),
        "adapter_params": trainable_count(adapters),
        "weights_bytes": nbytes(base),
        "adapter_bytes": nbytes(adapters),
        "adapter_optimizer_bytes": 2 * nbytes(adapters),  # AdamW's moments, in the param dtype
        "full_finetune_bytes": 4 * nbytes(base),
        "lora_bytes": nbytes(base) + 4 * nbytes(adapters),
        "lora_step_extra_bytes": 2 * nbytes(targets),
    }
