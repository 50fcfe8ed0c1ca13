"""Write parameters made elsewhere (converted weights) as a run directory that ``load_run``
restores like a trained run, laid out as ``runs/layout.py`` says::

    RUN_DIR/checkpoints/0/state   TrainState(step=0, params, opt_state, rng), orbax StandardSave
    RUN_DIR/checkpoints/0/meta    JSON: model, train, step, data, tokenizer, versions, source
    RUN_DIR/tokenizer/            the tokenizer, when there is one

The optimizer state is a fresh ``make_optimizer(TrainConfig())`` state for the params (AdamW
moments at zero), so training can start from the weights. ``meta["source"]`` records where the
weights came from; ``convert/`` puts the original ``config.json`` there, which export uses to
give back fields this project does not model (token ids, dropout rates, ...).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp

from transformers_jax import __version__
from transformers_jax.config import ModelConfig, TrainConfig
from transformers_jax.data.tokenizers import EXTERNAL, Tokenizer
from transformers_jax.learning.objectives import objective_for
from transformers_jax.learning.optim import make_optimizer
from transformers_jax.learning.step import TrainState
from transformers_jax.runs.checkpoint import Checkpointer
from transformers_jax.runs.layout import TOKENIZER_DIR, checkpoint_dir
from transformers_jax.runs.load import state_target


def train_config_for(config: ModelConfig) -> TrainConfig:
    """The default training settings, with a sequence length the model can take."""
    limit = config.position.max_length(config)
    if limit is not None:
        return TrainConfig(seq_len=min(TrainConfig().seq_len, limit))
    return TrainConfig()


def fresh_state(params: Any, optimizer: Any, seed: int) -> TrainState:
    """``TrainState`` at step 0 around ``params``: what ``learning.step.init_state`` builds (same
    RNG split), with the given params instead of a random init."""
    _, rng = jax.random.split(jax.random.key(seed))
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.key_data(rng),
    )


def _fitted(params: Any, want: Any) -> Any:
    """``params`` cast to the dtypes of ``want`` (the model's abstract params); a ``ValueError``
    naming the paths when their trees or shapes differ."""
    have_flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
    want_flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(want)}
    diff = sorted(set(want_flat) ^ set(have_flat)) or [
        f"{k}: {tuple(have_flat[k].shape)} vs {tuple(want_flat[k].shape)}"
        for k in sorted(want_flat) if tuple(have_flat[k].shape) != tuple(want_flat[k].shape)]
    if diff:
        raise ValueError(f"params do not fit the model of this config: {diff[:8]}")
    return jax.tree.map(lambda w, h: jnp.asarray(h, dtype=w.dtype), want, params)


def write_run(
    run_dir: str,
    config: ModelConfig,
    params: Any,
    *,
    tokenizer: Tokenizer | None = None,
    tokenizer_note: str | None = None,
    source: dict | None = None,
    train_config: TrainConfig | None = None,
    overwrite: bool = False,
    step: int = 0,
    data: dict | None = None,
) -> str:
    """Save ``params`` (the unboxed tree ``build_model(config).init`` makes) as step ``step``
    of a run (0: nothing trained yet), with a fresh optimizer state.

    ``tokenizer``: saved to ``RUN_DIR/tokenizer`` (any of ours, or ``HFTokenizer``); None
    records ``kind="external"`` with ``tokenizer_note`` saying why (token ids only).
    ``data``: the checkpoint's data record (where its data stream stands, its description);
    default: none consumed. Returns the checkpoint directory. Refuses to touch a run that
    already has checkpoints unless ``overwrite``.
    """
    train_cfg = train_config or train_config_for(config)
    ckpt_dir = checkpoint_dir(run_dir)
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        if not overwrite:
            raise FileExistsError(
                f"{run_dir!r} already holds checkpoints ({ckpt_dir}); choose a new output "
                "directory, or pass overwrite=True (--overwrite) to replace them"
            )
        shutil.rmtree(ckpt_dir)
    os.makedirs(run_dir, exist_ok=True)

    _, target = state_target(config, train_cfg, objective_for(config.family))
    params = _fitted(params, target.params)
    state = fresh_state(params, make_optimizer(train_cfg), train_cfg.seed)
    state = state.replace(step=jnp.asarray(step, jnp.int32))

    if tokenizer is not None:
        tokenizer.save(os.path.join(run_dir, TOKENIZER_DIR))
        spec = {"kind": tokenizer.name, "dir": TOKENIZER_DIR}
        if tokenizer_note:
            spec["note"] = tokenizer_note
    else:
        spec = {"kind": EXTERNAL, "note": tokenizer_note or "no tokenizer: token ids only"}
    description = "converted weights; no training data consumed yet"
    if source and source.get("path"):
        description = f"converted from {source['path']}; no training data consumed yet"
    meta = {
        "model": dataclasses.asdict(config),
        "train": dataclasses.asdict(train_cfg),
        "step": step,
        "data": data or {"iterator": None, "description": description},
        "tokenizer": spec,
        "versions": {"jax": jax.__version__, "transformers_jax": __version__},
        "source": source or {},
    }
    ckpt = Checkpointer(run_dir, async_save=False)
    try:
        ckpt.save(step, state, meta)
    finally:
        ckpt.close()
    return os.path.join(ckpt_dir, str(step))


def read_meta_of(run_dir: str, step: int) -> dict:
    ckpt = Checkpointer(run_dir, create=False)
    try:
        return ckpt.read_meta(step)
    finally:
        ckpt.close()
