"""AdamW with linear warm-up, cosine decay and global-norm gradient clipping."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from transformers_jax.config import TrainConfig
from transformers_jax.learning.lora import adapters_only
from transformers_jax.learning.step import SkipsNonFinite


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Warm up linearly to ``learning_rate`` (first step already > 0), then cosine-decay to
    ``learning_rate * min_lr_ratio`` at step ``cfg.schedule_total`` (``steps`` unless
    ``schedule_steps`` is set) and stay there."""
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup, decay = cfg.warmup, max(cfg.schedule_total - cfg.warmup, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * (step + 1) / max(warmup, 1)
        progress = jnp.clip((step - warmup) / decay, 0.0, 1.0)
        cosine = floor + 0.5 * (peak - floor) * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup, warm, cosine)

    return schedule


def decay_mask(params):
    """Weight decay on matrices only: never on biases, norm scales or 1-D parameters (also
    when ``scan_layers`` stacks every layer's parameters under a leading ``layers`` axis)."""

    def is_matrix(path, p) -> bool:
        stacked = any(getattr(k, "key", None) == "layers" for k in path)
        return p.ndim - int(stacked) >= 2

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(cfg: TrainConfig) -> SkipsNonFinite:
    """AdamW (``clipped_adamw``); with ``--train.lora.rank`` on the adapters only."""
    optimizer = clipped_adamw(learning_rate_schedule(cfg), max_norm=cfg.grad_clip, b1=cfg.b1,
                              b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)
    return adapters_only(optimizer) if cfg.lora.enabled else optimizer


def clipped_adamw(schedule: optax.Schedule, *, max_norm: float, b1: float, b2: float,
                  weight_decay: float, mask, eps: float = 1e-8) -> SkipsNonFinite:
    """``optax.chain(clip_by_global_norm(max_norm), adamw(schedule, ...))`` written as one
    update: the same state (checkpoints and shardings do not change) and the same numbers to
    a rounding or two (XLA fuses the two programs differently, and a clipped step multiplies
    by ``max_norm / norm`` where optax divides by the norm and multiplies).

    Why not the chain: the update takes ``keep`` (the train step's "loss and gradient norm
    are finite"), keeps the moments where it is False, and moves each parameter by the kept
    moments. Built from the chain's pieces and selected afterwards (or selected twice),
    XLA:CPU copied every moment before overwriting it in place (two copies per parameter) and
    re-read each one three times; clipping by a division materialised a clipped copy of every
    gradient. Written as one update, GPT-2 small trained 1.11x faster on a CPU. With ``keep``
    False the updates are zero and the state comes back unchanged."""
    reference = optax.chain(optax.clip_by_global_norm(max_norm),
                            optax.adamw(schedule, b1=b1, b2=b2, eps=eps,
                                        weight_decay=weight_decay, mask=mask))

    @functools.partial(jax.jit, static_argnames="decays")
    def parameter_step(g, m, v, p, shared, *, decays: bool):
        """One parameter's step, ``(new m, new v, update)``, all kept where ``keep`` is
        False. A nested ``jit``: each distinct parameter shape is traced once per step (GPT-2
        small has 148 parameters of 7 shapes), not once per parameter; the compiled program is
        the same."""
        keep, scale, count, step_size = shared
        g = g * scale.astype(g.dtype)
        m = jnp.where(keep, (1 - b1) * g + b1 * m, m)  # optax.tree.update_moment
        v = jnp.where(keep, (1 - b2) * g ** 2 + b2 * v, v)  # ... update_moment_per_elem_norm
        # scale_by_adam, add_decayed_weights, scale_by_lr
        u = (m / (1 - b1 ** count).astype(m.dtype)) / (
            jnp.sqrt(v / (1 - b2 ** count).astype(v.dtype) + 0.0) + eps)
        if decays and weight_decay:
            u = u + weight_decay * p
        return m, v, jnp.where(keep, step_size.astype(u.dtype) * u, 0)

    def update(grads, state, params=None, *, keep=True, norm=None, **_):
        if params is None:
            raise ValueError("clipped_adamw needs the parameters (weight decay): "
                             "call update(grads, state, params)")
        clip_state, (adam, decay_state, lr_state) = state
        if norm is None:  # learning.step.apply_gradients passes the norm it computed already
            norm = optax.tree.norm(grads)
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)  # a multiply fuses freely
        count = optax.safe_increment(adam.count)
        shared = (jnp.asarray(keep), scale, count, -1 * schedule(lr_state.count))
        moved = jax.tree.map(
            lambda g, m, v, p, decays: parameter_step(g, m, v, p, shared, decays=bool(decays)),
            grads, adam.mu, adam.nu, params, mask(params))
        # the tree of (m, v, update) triples as three trees
        mu, nu, updates = jax.tree.transpose(
            jax.tree.structure(grads), jax.tree.structure((0, 0, 0)), moved)
        adam = adam._replace(count=jnp.where(keep, count, adam.count), mu=mu, nu=nu)
        lr_state = lr_state._replace(
            count=jnp.where(keep, optax.safe_increment(lr_state.count), lr_state.count))
        return updates, (clip_state, (adam, decay_state, lr_state))

    return SkipsNonFinite(reference.init, update)
