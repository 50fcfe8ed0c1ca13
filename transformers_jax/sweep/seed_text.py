"""The text each seed's run reads in training, token by token, in its order: what its n-gram
baselines are fitted on (``report.seed_baselines``), so that "past the n-gram" compares a
model with a baseline that saw exactly its tokens, not the corpus's first N in stored order.

A run's tokens are its data iterator's batches, drawn as training draws them (the same
config and seed, ``runs.data.make_run_data``) for its steps: each row's first input and its
targets (its padding left out). A fine-tune reads its parent's run's tokens first (it starts
from that run of the same seed), a zero-shot cell its parent's."""

from __future__ import annotations

import numpy as np


def row_tokens(batch: dict) -> list[np.ndarray]:
    """Each row's tokens: its first input, then its targets where they count."""
    inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
    weights = np.asarray(batch["weights"]) if "weights" in batch else np.ones(targets.shape)
    return [np.concatenate([inputs[r, :1], targets[r][weights[r] > 0]])
            for r in range(len(targets))]


def run_tokens(model_cfg, train_cfg, tokenizer) -> np.ndarray:
    """The token ids one run of these configs reads in its ``train_cfg.steps`` steps."""
    from transformers_jax.runs.data import make_run_data

    train = make_run_data(model_cfg, train_cfg, tokenizer).train
    rows = [row for _ in range(train_cfg.steps) for row in row_tokens(next(train))]
    return np.concatenate(rows) if rows else np.zeros(0, np.int64)


def data_key(planned, seed: int) -> tuple:
    """What decides a run's training batches: its training config with the seed, and what of
    the model the data reads (family, longest position, a prefix-LM mask); cells that differ
    elsewhere (a positional scheme, say) read the same tokens."""
    model = planned.model
    return (repr(planned.train.replace(seed=seed)), model.family,
            model.position.max_length(model), model.mask.needs_prefix_len)


def seed_tokens(planned, seed: int, tokenizer, cache: dict | None = None) -> np.ndarray:
    """What the run of ``planned`` (a ``sweep.plan.PlannedCell``) for ``seed`` has read when it
    is scored: its parent's tokens, then its own. ``cache``: shared between calls."""
    cache = {} if cache is None else cache
    if planned.zero_shot:
        return seed_tokens(planned.parent, seed, tokenizer, cache)
    key = data_key(planned, seed)
    if key not in cache:
        cache[key] = run_tokens(planned.model, planned.train.replace(seed=seed), tokenizer)
    own = cache[key]
    return own if planned.parent is None else np.concatenate(
        [seed_tokens(planned.parent, seed, tokenizer, cache), own])
