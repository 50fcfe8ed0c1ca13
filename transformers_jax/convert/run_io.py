"""Write converted weights as a run directory that ``runs.load_run`` restores like a trained run.

The layout is the training loop's (``loop.py``, ``train/checkpoint.py``)::

    RUN_DIR/checkpoints/0/state   TrainState(step=0, params, opt_state, rng), orbax StandardSave
    RUN_DIR/checkpoints/0/meta    JSON: model, train, step, data, tokenizer, versions, source
    RUN_DIR/tokenizer/            the tokenizer, when there is one (see ``tokenizer_for``)

The optimizer state is a fresh ``make_optimizer(TrainConfig())`` state for the converted
params (AdamW moments at zero), so training can start from the weights. ``meta["source"]``
records where the weights came from, including the original ``config.json``, which export uses
to give back fields this project does not model (token ids, dropout rates, ...).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp

from transformers_jax import __version__
from transformers_jax.config import ModelConfig, TrainConfig, from_dict
from transformers_jax.convert.common import flatten, param_shapes, unflatten
from transformers_jax.convert.hf_files import ConversionError
from transformers_jax.data.tokenizers import EXTERNAL, Tokenizer, trainable
from transformers_jax.train.checkpoint import Checkpointer, abstract_like, checkpoint_dir
from transformers_jax.train.data import TOKENIZER_DIR


def train_config_for(config: ModelConfig) -> TrainConfig:
    """The default training settings, with a sequence length the model can take."""
    limit = config.position.max_length(config)
    if limit is not None:
        return TrainConfig(seq_len=min(TrainConfig().seq_len, limit))
    return TrainConfig()


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
) -> str:
    """Save ``params`` (the unboxed tree ``build_model(config).init`` makes) as step 0 of a run.

    ``tokenizer``: saved to ``RUN_DIR/tokenizer`` (any of ours, or ``HFTokenizer``); None
    records ``kind="external"`` with ``tokenizer_note`` saying why (token ids only).
    Returns the checkpoint directory. Refuses to touch a run that already has checkpoints
    unless ``overwrite``.
    """
    from transformers_jax.train.optim import make_optimizer

    train_cfg = train_config or train_config_for(config)
    ckpt_dir = checkpoint_dir(run_dir)
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        if not overwrite:
            raise FileExistsError(
                f"{run_dir!r} already holds checkpoints ({ckpt_dir}); choose a new output "
                "directory, or pass overwrite=True (--overwrite) to replace them"
            )
        import shutil

        shutil.rmtree(ckpt_dir)
    os.makedirs(run_dir, exist_ok=True)

    want, have = flatten(param_shapes(config)), flatten(params)
    if set(want) != set(have) or any(tuple(want[k].shape) != tuple(have[k].shape) for k in want):
        diff = sorted(set(want) ^ set(have)) or [
            f"{k}: {tuple(have[k].shape)} vs {tuple(want[k].shape)}" for k in sorted(want)
            if tuple(want[k].shape) != tuple(have[k].shape)
        ]
        raise ConversionError(f"params do not fit the model of this config: {diff[:8]}")
    params = unflatten({k: jnp.asarray(have[k], dtype=want[k].dtype) for k in want})
    state = fresh_state(params, make_optimizer(train_cfg), train_cfg.seed)

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
        "step": 0,
        "data": {"iterator": None, "description": description},
        "tokenizer": spec,
        "versions": {"jax": jax.__version__, "transformers_jax": __version__},
        "source": source or {},
    }
    ckpt = Checkpointer(run_dir, async_save=False)
    try:
        ckpt.save(0, state, meta)
    finally:
        ckpt.close()
    return os.path.join(ckpt_dir, "0")


def fresh_state(params: Any, optimizer: Any, seed: int):
    """``TrainState`` at step 0 around ``params``: what ``train.step.init_state`` builds (same
    RNG split), with the given params instead of a random init."""
    from transformers_jax.train.step import TrainState

    _, rng = jax.random.split(jax.random.key(seed))
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.key_data(rng),
    )


def read_run_meta(run_dir: str, step: int | None = None) -> dict:
    """The meta of checkpoint ``step``, or of the newest intact one (``Checkpointer.pick``)."""
    return _pick(run_dir, step)[1]


def _pick(run_dir: str, step: int | None) -> tuple[int, dict]:
    """The step to load (see ``Checkpointer.pick``) and its meta."""
    ckpt = Checkpointer(run_dir, create=False)
    try:
        step = ckpt.pick(step)
        return step, ckpt.read_meta(step)
    finally:
        ckpt.close()


def load_converted_run(run_dir: str, step: int | None = None):
    """``(model, params, tokenizer, config)`` like ``runs.load_run``, for any run, also one
    whose tokenizer is a Hugging Face one (kind ``huggingface``) or absent (``external``:
    tokenizer None; generate from token ids), or whose model is an encoder-decoder.

    Other runs (our own tokenizers, decoder-only or BERT) go straight through
    ``runs.load_run``.
    """
    from transformers_jax.runs import load_run, run_tokenizer

    step, meta = _pick(run_dir, step)  # then every read below is of the same, intact step
    config = from_dict(ModelConfig, meta["model"])
    if meta["tokenizer"].get("kind") in trainable():  # a tokenizer of ours: a run of ours
        return load_run(run_dir, step)
    from transformers_jax.models import build_model
    from transformers_jax.train.optim import make_optimizer

    train_cfg = from_dict(TrainConfig, meta["train"])
    model = build_model(config)
    shapes = param_shapes(config)
    target = jax.eval_shape(lambda: fresh_state(
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
        make_optimizer(train_cfg), train_cfg.seed,
    ))
    ckpt = Checkpointer(run_dir, create=False)
    try:
        state, meta = ckpt.restore(abstract_like(target), step)
    finally:
        ckpt.close()
    return model, state.params, run_tokenizer(run_dir, meta["tokenizer"]), config
