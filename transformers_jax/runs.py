"""Restore a trained run in one call: ``model, params, tokenizer, config = load_run(RUN_DIR)``."""

from __future__ import annotations

import os
from typing import Any

import jax

from transformers_jax.config import ModelConfig, TrainConfig, from_dict
from transformers_jax.data.tokenizers import EXTERNAL, load_tokenizer, train_tokenizer
from transformers_jax.models import build_model, family_of
from transformers_jax.registry import TOKENIZERS
from transformers_jax.train.checkpoint import Checkpointer, abstract_like
from transformers_jax.train.data import TOKENIZER_DIR
from transformers_jax.train.objectives import objective_for
from transformers_jax.train.optim import make_optimizer
from transformers_jax.train.step import init_state


def run_tokenizer(run_dir: str, spec: dict):
    """The tokenizer saved beside the checkpoints (byte-level needs no files); None when the
    checkpoint came from elsewhere with a tokenizer this project cannot load (ids only)."""
    kind = spec.get("kind")
    if kind == EXTERNAL:  # converted weights whose tokenizer we cannot load
        return None
    directory = os.path.join(run_dir, spec.get("dir", TOKENIZER_DIR))
    if os.path.isdir(directory):
        return load_tokenizer(directory)
    if kind in TOKENIZERS and not TOKENIZERS.get(kind).needs_text:  # byte: no files needed
        return train_tokenizer(kind)
    raise FileNotFoundError(
        f"the run uses a {spec.get('kind')!r} tokenizer but {directory} is missing; copy the "
        "whole run directory, not only its checkpoints"
    )


def load_run(run_dir: str, step: int | None = None, shardings: Any | None = None):
    """Restore ``(model, params, tokenizer, config)`` from the given checkpoint step, or the
    newest intact one (a damaged newer one is skipped with a warning on stderr).

    ``shardings`` restores straight onto devices (any count: a checkpoint does not remember
    the devices it came from): one ``jax.sharding.Sharding`` for every array, a function from
    each array's ``jax.ShapeDtypeStruct`` to its sharding, or a pytree matching the train state.
    """
    ckpt = Checkpointer(run_dir, create=False)
    try:
        step = ckpt.pick(step)  # a damaged step asked for is refused, naming the intact ones
        meta = ckpt.read_meta(step)
        config = from_dict(ModelConfig, meta["model"])
        train_cfg = from_dict(TrainConfig, meta["train"])
        model = build_model(config)
        tokens, inputs = family_of(config).example_inputs(config)
        example = {"inputs": tokens, **inputs}
        optimizer = make_optimizer(train_cfg)
        objective = objective_for(config.family)
        target = jax.eval_shape(
            lambda: init_state(model, optimizer, train_cfg.seed, example, objective)
        )
        if isinstance(shardings, jax.sharding.Sharding):
            shardings = jax.tree.map(lambda _, s=shardings: s, target)
        elif callable(shardings):
            shardings = jax.tree.map(shardings, target)
        state, _ = ckpt.restore(abstract_like(target, shardings), step)
    finally:
        ckpt.close()
    return model, state.params, run_tokenizer(run_dir, meta["tokenizer"]), config
