"""Seeds trained together: the S seeds of one configuration as one program on one device.

``train_seeds(model_cfg, cfg, seeds=[0, 1, 2], run_dirs=[d0, d1, d2])`` trains every seed as
``train`` would train it alone, ``train(model_cfg, cfg.replace(seed=s, run_dir=d))``: the same
parameters at initialisation, the same batches in the same order, the same dropout draws. The
states are stacked on a leading seed axis and stepped by one jitted program
(``parallel.seeds``: the single-device step mapped over the seeds, ``jax.vmap`` on an
accelerator, ``lax.map`` on XLA:CPU); everything around the step is each run's own
(``train.lane``'s lanes): data iterator, metrics log, evaluation, non-finite guard,
checkpoints and README, in an ordinary run directory.

Shape legend: S seeds, B batch, T length.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
from tqdm import tqdm

from transformers_jax.config import ConfigError, ModelConfig, TrainConfig, check_lengths
from transformers_jax.parallel.mesh import make_mesh
from transformers_jax.parallel.seeds import SeedsTrainer, seed_devices, stack_seeds
from transformers_jax.parallel.strategies import make_trainer
from transformers_jax.runs.lock import RunLock
from transformers_jax.train.lane import Lane, open_lane
from transformers_jax.train.lanes import Program, run_lanes
from transformers_jax.train.setup import a_terminal, plan_segment, prepare_run


def train_seeds(model_cfg: ModelConfig, cfg: TrainConfig, seeds: Sequence[int],
                run_dirs: Sequence[str] | None = None, auto_vocab: bool = False, *,
                preset: str | None = None, command: str | Sequence[str] | None = None,
                on_step: Callable[[int], None] | None = None,
                devices: Sequence[Any] | None = None,
                init_from: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Train ``seeds`` of one configuration together; return each seed's final metrics.

    The contract:

    - Seed ``seeds[i]`` trains as ``train(model_cfg, cfg.replace(seed=seeds[i],
      run_dir=run_dirs[i]), auto_vocab)`` would alone (``cfg.seed`` and ``cfg.run_dir`` are
      replaced): its losses and parameters equal that run's to float tolerance (XLA may round
      the batched products differently; ``tests/test_seeds.py`` states the tolerance).
    - ``run_dirs[i]`` is an ordinary run directory, as ``train`` writes it (checkpoints,
      ``metrics.jsonl``, ``README.md``, ``tjax_config.json`` with that seed and directory, a
      trained tokenizer, a classifier's labels): ``tjax sample``, ``tjax eval`` and
      ``runs.load_run`` read it, and ``tjax train --run-dir D --train.seed=S`` (the same
      other settings; or ``--config D/tjax_config.json``) resumes that seed alone. Each
      directory is locked while training. ``run_dirs=None``: nothing is saved.
    - Resuming: when the directories hold checkpoints, every seed continues from its own, and
      all must be at the same step (a ``ValueError`` naming each directory's step otherwise,
      before anything is built); when all are at ``cfg.steps`` already, nothing is trained and
      each seed's result is ``{"steps": N, "stopped_by": None, "history": []}``.
    - The result: one dict per seed, in ``seeds`` order, as ``train`` returns it; its
      ``tokens_per_s`` and ``mfu`` are that seed's own share (the program trains S times as
      many tokens per step), and ``seeds_together`` is S.
    - Logging, evaluation and checkpoints happen at the same steps for all seeds; a seed whose
      training diverges (``train/guard.py``) stops all of them, with its run directory named.
    - ``on_step(step)``: after each step, as ``train``'s. ``command``: what each run's
      README records as the command that trains it (one string for all, or one per seed).
    - ``init_from``: one run per seed that seed fine-tunes from (``cfg.init_from`` for all
      when not given), e.g. each seed from its own pre-trained run.
    - ``devices``: the devices the seeds spread over, each training its own (a ``seed`` mesh
      axis, ``parallel.seeds``; the number of seeds a multiple of theirs). Default
      (``parallel.seeds.seed_devices``): as many of this host's devices as divide the seeds
      where the backend gains from it (accelerators), the first device alone on the CPU.

    Supported: ``train.strategy=single`` (each seed on one device), any family and
    objective, dropout, gradient accumulation, concurrent row groups, ``init_from``,
    TensorBoard/W&B per run.
    Refused with a ``ConfigError`` naming the option: another strategy (or a mesh), several
    processes (``train.coordinator``): train those seeds one after another with ``train``.
    """
    seeds = [int(s) for s in seeds]
    _check_request(cfg, seeds, run_dirs)
    dirs = list(run_dirs) if run_dirs is not None else [None] * len(seeds)
    starts = list(init_from) if init_from is not None else [cfg.init_from] * len(seeds)
    if len(starts) != len(seeds):
        raise ValueError(f"{len(starts)} init_from runs for {len(seeds)} seeds: give one per "
                         "seed, in the same order")
    cfgs = [cfg.replace(seed=seed, run_dir=run_dir, init_from=start)
            for seed, run_dir, start in zip(seeds, dirs, starts, strict=True)]
    commands = [command] * len(seeds) if command is None or isinstance(command, str) \
        else list(command)
    if len(commands) != len(seeds):
        raise ValueError(f"{len(commands)} commands for {len(seeds)} seeds: give one per seed")
    records = [{"preset": preset, "command": c} for c in commands]
    warnings: list[list[str]] = [[] for _ in cfgs]  # each run's log opens later, locked
    with contextlib.ExitStack() as locks:
        for one, found in zip(cfgs, warnings, strict=True):
            if one.run_dir:
                locks.enter_context(RunLock(one.run_dir, found.append))
        return _train_seeds(model_cfg, cfgs, auto_vocab, warnings, records, on_step, devices)


def _check_request(cfg: TrainConfig, seeds: list[int], run_dirs: Sequence[str] | None) -> None:
    if not seeds:
        raise ValueError("seeds: give at least one seed to train")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds={seeds}: each seed once (a repeated seed would train the same "
                         "run twice)")
    if run_dirs is not None:
        if isinstance(run_dirs, str):
            raise TypeError("run_dirs: a list of directories, one per seed, not one string")
        if len(run_dirs) != len(seeds):
            raise ValueError(f"{len(run_dirs)} run directories for {len(seeds)} seeds: give "
                             "one directory per seed, in the same order")
        if not all(run_dirs):
            raise ValueError(f"run_dirs={list(run_dirs)}: every seed needs its directory (or "
                             "pass run_dirs=None to save nothing)")
        paths = [str(d).rstrip("/") for d in run_dirs]
        if len(set(paths)) != len(paths):
            raise ValueError(f"run_dirs={list(run_dirs)}: each seed needs a directory of its "
                             "own")
    if cfg.strategy != "single":
        raise ConfigError(f"train.strategy={cfg.strategy!r}: seeds train together on one "
                          "device only (train.strategy=single); train the seeds of a "
                          "multi-device run one after another (train.loop.train per seed)")
    if cfg.coordinator is not None or jax.process_count() > 1:
        raise ConfigError("train.coordinator: seeds train together in one process on one "
                          "device; train the seeds of a multi-host run one after another")


def _train_seeds(model_cfg: ModelConfig, cfgs: list[TrainConfig], auto_vocab: bool,
                 warnings: list[list[str]], records: list[dict],
                 on_step: Callable[[int], None] | None,
                 devices: Sequence[Any] | None) -> list[dict[str, Any]]:
    check_lengths(model_cfg, cfgs[0].seq_len)
    plans = [plan_segment(one) for one in cfgs]  # may refuse: before anything is built
    at = [0 if plan.step is None else plan.step for plan in plans]
    if len(set(at)) > 1:
        raise ValueError(
            "the run directories are at different steps ("
            + ", ".join(f"{one.run_dir}: {step}" for one, step in zip(cfgs, at, strict=True))
            + "); seeds trained together continue from the same step: bring each to the same "
            "step alone first (tjax train --run-dir DIR --train.seed=S --steps N), or train "
            "the seeds separately; nothing was trained")
    if at[0] == plans[0].cfg.steps:
        print(f"nothing to train: the {len(cfgs)} runs are at step {at[0]} of "
              f"{cfgs[0].steps}; left as they are", file=sys.stderr)
        return [{"steps": at[0], "stopped_by": None, "history": []} for _ in cfgs]
    setups = [prepare_run(model_cfg, plan, auto_vocab) for plan in plans]
    first = setups[0]
    for setup in setups[1:]:  # the program is built for the first: it must be every seed's
        same_cfg = setup.cfg.replace(seed=first.cfg.seed, run_dir=first.cfg.run_dir,
                                     init_from=first.cfg.init_from)
        if setup.model_cfg != first.model_cfg or same_cfg != first.cfg:
            raise ValueError(
                f"{setup.cfg.run_dir or setup.cfg.seed}: its run resolves another model or "
                f"learning-rate schedule than {first.cfg.run_dir or first.cfg.seed} (a "
                "different tokenizer, or a resume with other --steps); train the seeds "
                "separately")
    devices = list(devices) if devices is not None else seed_devices(len(cfgs), jax.devices())
    trainer = make_trainer("single", first.model, first.optimizer, first.data.eval_batches[0],
                           mesh=make_mesh("data=1", devices=devices[:1]),
                           schedule=first.schedule, grad_accum=first.cfg.grad_accum,
                           objective=first.objective, groups=first.cfg.concurrent_groups)
    stacked = stack_seeds(trainer, len(cfgs), devices=devices)
    fresh = stacked.init([one.seed for one in cfgs])  # each seed's trainer.init_state(seed)
    states = [stacked.unstack(fresh, i) for i in range(len(cfgs))]
    del fresh
    bar = tqdm(total=cfgs[0].steps, desc=f"train {len(cfgs)} seeds",
               disable=not (cfgs[0].progress and a_terminal()), dynamic_ncols=True)
    lanes: list[Lane] = []
    try:
        for setup, found, record in zip(setups, warnings, records, strict=True):
            lanes.append(open_lane(setup, record, bar, found,
                                   label=f"seed {setup.cfg.seed} | "))
        return run_lanes(lanes, seeds_program(stacked), states, bar, on_step)
    finally:
        bar.close()
        for lane in lanes:
            lane.log.close()


def seeds_program(seeds: SeedsTrainer) -> Program:
    """The lanes' states stacked on a leading seed axis, stepped by one program."""
    trainer = seeds.trainer
    return Program(
        trainer,
        place=seeds.stack,
        step=lambda state, batches: seeds.step(state, seeds.place_batch(batches)),
        lane_state=seeds.unstack,
        lane_params=lambda state, i: seeds.unstack(state.params, i),
        lane_metrics=lambda row, i: {k: v[i] for k, v in row.items()},
    )
