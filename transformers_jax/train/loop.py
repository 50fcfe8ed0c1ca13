"""The training loop behind ``tjax train``: data, jit-compiled steps, eval, logging, metrics.

The top of ``train/``: it runs the steps of ``learning/step.py`` (through the strategy of
``parallel/`` that places them on the mesh), evaluates through ``evaluation.py``, and keeps
the run in its directory through ``runs/`` (checkpoints, metadata, lock, README).

``train`` plans the segment and builds the run (``train/setup.py``), opens its ``Lane``
(``train/lane.py``: its log, start, evaluations, checkpoints and README) and steps it through
its strategy's trainer (``train/lanes.py``); ``train.seeds.train_seeds`` steps one lane per
seed through one program.

``train(..., on_step=callback)`` calls ``callback(step)`` after every step, once that step's
checkpoint (when one is due) has been started: tests inject faults there (a crash after step
N: ``tests/crash_train.py``), and a notebook can watch a run."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from transformers_jax.config import ConfigError, ModelConfig, TrainConfig, check_lengths
from transformers_jax.learning.flops import given_peak
from transformers_jax.learning.objectives import run_objective
from transformers_jax.parallel import multihost
from transformers_jax.parallel.strategies import make_trainer
from transformers_jax.runs.lock import RunLock
from transformers_jax.train.lane import open_lane
from transformers_jax.train.lanes import run_lanes, solo_program
from transformers_jax.train.setup import a_terminal, plan_segment, prepare_run


def train(model_cfg: ModelConfig, cfg: TrainConfig, auto_vocab: bool = False, *,
          preset: str | None = None, command: str | None = None,
          on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train on ``cfg.data`` (or the default corpus, or ``cfg.task``); return final metrics.

    ``auto_vocab``: set ``model_cfg.vocab_size`` from the tokenizer (the CLI does this unless
    ``--model.vocab_size`` is given); otherwise a vocabulary smaller than the tokenizer's fails.
    ``preset``/``command``: the named model the config started from and the command line, for
    the run's records (``RUN_DIR/README.md``, the checkpoint's metadata); they change nothing
    else. A resume compares the whole model config, however it was given.

    With ``cfg.run_dir`` the run is checkpointed every ``checkpoint_every`` steps, at the end
    and on SIGTERM/SIGINT, and a later call with the same run directory resumes exactly.
    The run directory is locked for the run (``runs/lock.py``; process 0 only), and a
    non-finite loss or gradient stops the run (``train/guard.py``) before anything
    non-finite is saved.

    ``on_step(step)``: called after each step (numbered from 1), once its checkpoint, when
    one is due, has been started, on every process: the hook where tests inject faults.
    """
    if cfg.coordinator is not None:  # before any other JAX call
        multihost.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id)
    records = {"preset": preset, "command": command}
    if not (cfg.run_dir and multihost.is_main_process()):
        return _train(model_cfg, cfg, auto_vocab, records=records, on_step=on_step)
    warnings: list[str] = []  # the log opens later, under the lock
    with RunLock(cfg.run_dir, warnings.append):
        return _train(model_cfg, cfg, auto_vocab, warnings, records=records, on_step=on_step)


def _train(model_cfg: ModelConfig, cfg: TrainConfig, auto_vocab: bool,
           early_warnings: tuple[str, ...] | list[str] = (), *,
           records: dict | None = None,
           on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    check_lengths(model_cfg, cfg.seq_len)
    run_objective(model_cfg, cfg.objective).check(model_cfg)  # before any work
    refusal = model_cfg.attention.platform_refusal(jax.default_backend(), model_cfg)
    if refusal:
        raise ConfigError(refusal)
    given_peak()  # a bad TJAX_PEAK_FLOPS refused before any work
    plan = plan_segment(cfg)  # may refuse: before anything is built or written
    if plan.step is not None and plan.step == plan.cfg.steps:
        if multihost.is_main_process():
            print(f"nothing to train: {cfg.run_dir} is at step {plan.step} of {cfg.steps} "
                  f"(give --steps above {plan.step} to continue it); left as it is",
                  file=sys.stderr)
        return {"steps": plan.step, "stopped_by": None, "history": []}
    setup = prepare_run(model_cfg, plan, auto_vocab)
    cfg = setup.cfg
    # The strategy (single device, pmap, shard_map, jit over a mesh) owns placement; batches
    # arrive as this host's rows. Shapes come from an eval batch: no training batch is used up.
    example = {k: np.concatenate([v] * jax.process_count()) for k, v in
               setup.data.eval_batches[0].items()}
    trainer = make_trainer(cfg.strategy, setup.model, setup.optimizer, example, mesh=cfg.mesh,
                           schedule=setup.schedule, grad_accum=cfg.grad_accum,
                           objective=setup.objective,
                           groups=cfg.concurrent_groups,
                           context_attention=cfg.context_attention)
    state = trainer.unreplicate(trainer.init_state(cfg.seed))  # host view, saved as is

    main = multihost.is_main_process()  # every process trains and saves; one of them talks
    bar = tqdm(total=cfg.steps, desc="train", disable=not (cfg.progress and main and a_terminal()),
               dynamic_ncols=True)
    lane = open_lane(setup, records or {}, bar, early_warnings, talks=main)
    try:
        return run_lanes([lane], solo_program(trainer), [state], bar, on_step)[0]
    finally:
        bar.close()
        lane.log.close()
