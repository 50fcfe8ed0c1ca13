"""AdamW with linear warm-up, cosine decay and global-norm gradient clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from transformers_jax.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Warm up linearly to ``learning_rate`` (first step already > 0), then cosine-decay to
    ``learning_rate * min_lr_ratio`` at the last step."""
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup, decay = cfg.warmup, max(cfg.steps - cfg.warmup, 1)

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


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            learning_rate_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        ),
    )
