"""The training loop behind ``tjax train``: data, jit-compiled steps, eval, logging, metrics.

The top of ``train/``: it runs the steps of ``train/step.py`` (through the strategy of
``parallel/`` that places them on the mesh), evaluates through ``evaluation.py``, and keeps
the run in its directory through ``runs/`` (checkpoints, metadata, lock, README). The rest of
``train/`` sits below ``parallel/`` and ``runs/``, which build on it (import-linter's layers in
``pyproject.toml``).

A run's bookkeeping is a ``Lane`` (its data, log, evaluation, guard, checkpoints, README) and
the step that moves its state is a ``Program``: ``train`` drives one lane through its
strategy's trainer (``solo_program``); ``train.seeds.train_seeds`` drives one lane per seed
through one program whose state stacks them all (``run_lanes`` serves both).

``train(..., on_step=callback)`` calls ``callback(step)`` after every step, once that step's
checkpoint (when one is due) has been started: tests inject faults there (a crash after step
N: ``tests/crash_train.py``), and a notebook can watch a run."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from transformers_jax import __version__
from transformers_jax.config import ConfigError, ModelConfig, TrainConfig, check_lengths
from transformers_jax.evaluation import held_out_metrics, mean_metrics
from transformers_jax.models import family_of
from transformers_jax.nn.kvcache import check_decoding
from transformers_jax.nn.layers import count_params
from transformers_jax.parallel import multihost
from transformers_jax.parallel.strategies import ParallelTrainer, make_trainer
from transformers_jax.runs.checkpoint import Checkpointer, abstract_like, check_same_model
from transformers_jax.runs.labels import resumed_labels, write_labels
from transformers_jax.runs.layout import METRICS_FILE, checkpoint_dir
from transformers_jax.runs.load import load_run, lora_base_params
from transformers_jax.runs.lock import RunLock
from transformers_jax.runs.meta import (
    check_same_data,
    run_meta,
    saved_schedule,
    segments_of,
    train_differences,
)
from transformers_jax.runs.readme import write_run_readme
from transformers_jax.runs.tokenizer import source_tokenizer, training_tokenizer
from transformers_jax.sample import SamplingConfig, generate
from transformers_jax.train import lora
from transformers_jax.train.data import RunData, make_run_data
from transformers_jax.train.flops import device_peak, flops_per_token, given_peak
from transformers_jax.train.guard import Guard, NonFiniteError
from transformers_jax.train.objectives import run_objective
from transformers_jax.train.optim import learning_rate_schedule, make_optimizer
from transformers_jax.train.profile import StepProfiler
from transformers_jax.train.step import TrainState
from transformers_jax.train.tracking import Tracker

SAMPLE_PROMPT_TOKENS = 32  # the held-out text that the evaluation samples continue
SAMPLE_NEW_TOKENS = 48


def _export_class(model_cfg: ModelConfig) -> str | None:
    """The Hugging Face class the run's README may suggest exporting to (the converter's
    answer), imported only when a README is written."""
    from transformers_jax.convert.api import export_class

    return export_class(model_cfg)


def _window_metrics(rows: list[dict]) -> dict[str, float]:
    """Means over the window's applied (finite) steps, plus the count of skipped ones."""
    good = [r for r in rows if not int(r.get("nonfinite", 0))] or rows
    values = mean_metrics([{k: v for k, v in r.items() if k != "nonfinite"} for r in good])
    skipped = sum(int(r.get("nonfinite", 0)) for r in rows)
    return {**values, "skipped": skipped} if skipped else values


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


class MetricsLog:
    """Console lines (through tqdm, so the bar stays intact), an optional JSONL file and an
    optional ``Tracker`` (TensorBoard, W&B) that sees the same rows. ``label``: put before each
    console line (``seed 1 | ``: which of the seeds trained together speaks)."""

    def __init__(self, run_dir: str | None, bar: tqdm | None, quiet: bool = False,
                 tracker: Tracker | None = None, label: str = ""):
        self.bar, self.quiet, self.tracker, self.label = bar, quiet, tracker, label
        self.file = None
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            self.file = open(os.path.join(run_dir, METRICS_FILE), "a")  # noqa: SIM115

    def write(self, kind: str, step: int, values: dict[str, float], text: str) -> None:
        if self.file:
            self.file.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
            self.file.flush()
        if self.tracker is not None:
            self.tracker.log(kind, step, values)
        if not self.quiet:
            (self.bar.write if self.bar is not None else print)(self.label + text,
                                                                 file=sys.stderr)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tracker is not None:
            self.tracker.close()


class StopSignals:
    """Turn SIGTERM/SIGINT (TPU preemption, Ctrl-C) into a request to save and stop cleanly.

    One process: a Python handler notes the signal. Several processes must stop after the same
    step, each saving its shards of one checkpoint; a signal reaches one host, or reaches hosts
    at different steps. So SIGTERM is left to JAX's preemption service (it tells every process
    and picks one step for all), and Ctrl-C is handed to it as a SIGTERM to this process.
    ``at(step)``, called once per step, says whether to stop after it and why.
    """

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict = {}
        self._agreed = multihost.agrees_on_stops()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            signals = (signal.SIGINT,) if self._agreed else (signal.SIGTERM, signal.SIGINT)
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        if self._agreed:  # through the preemption service, so that every process stops
            os.kill(os.getpid(), signal.SIGTERM)

    def at(self, step: int) -> str | None:
        if not self._agreed:
            return self.requested
        if not multihost.stop_agreed(step):
            return None
        return self.requested or "SIGTERM (on this or another process)"

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    """What one invocation of ``train`` does to its run (``plan_segment``)."""

    cfg: TrainConfig  # this invocation's config, with the run's learning-rate schedule
    step: int | None  # the checkpoint a resume continues from; None: a fresh run
    notes: list[tuple[str, str]]  # (kind, text) logged after the resume line


def a_terminal() -> bool:
    """stderr is a terminal: a progress bar redraws itself there; in a redirected log its
    frames would pile up on one line (30 KB for 200 steps), and the log lines suffice."""
    return sys.stderr.isatty()


def plan_segment(cfg: TrainConfig) -> SegmentPlan:
    """Before anything is built or written: the checkpoint a resume continues and the
    learning-rate schedule this invocation follows.

    The learning-rate schedule belongs to the run. A resume with another ``--steps`` keeps the
    checkpoint's schedule (``schedule_steps`` is set to its length, so the saved config
    reproduces the rates): the cosine goes on to its end and later steps run at its floor.
    ``--train.schedule_steps=N`` replaces it with the schedule of an N-step run, a change of
    rate at the resumed step that is logged as a warning. ``--steps`` below the checkpoint's
    step raises ``ValueError``; ``--steps`` equal to it trains nothing (``train`` returns
    without writing)."""
    fresh = SegmentPlan(cfg, None, [])
    if not (cfg.run_dir and cfg.resume and os.path.isdir(checkpoint_dir(cfg.run_dir))):
        return fresh
    ckpt = Checkpointer(cfg.run_dir, create=False)
    try:  # the step _resume will take: the newest intact one (none: _resume says so)
        good = next(ckpt.intact_steps(), None)
        meta = None if good is None else ckpt.read_meta(good)
    finally:
        ckpt.close()
    if meta is None:
        return fresh
    step, saved = int(meta["step"]), meta.get("train", {})
    if step == 0:  # nothing trained yet (a converted run): this invocation plans the schedule
        return SegmentPlan(cfg, 0, [])
    old_total, old_warmup = saved_schedule(saved)
    if cfg.steps < step:
        raise ValueError(
            f"{cfg.run_dir} is at step {step}, past --steps {cfg.steps}: a run cannot be "
            "shortened, and nothing was trained or written. Give --steps above "
            f"{step} to continue it (its learning-rate schedule spans {old_total} steps), or a "
            f"new --run-dir to train {cfg.steps} steps afresh (with --train.init_from="
            f"{cfg.run_dir} to start from this run's parameters)")
    old_lr = learning_rate_schedule(cfg.replace(schedule_steps=old_total,
                                                warmup_steps=old_warmup))
    notes = []
    if cfg.schedule_steps is None and old_total != cfg.steps:
        cfg = cfg.replace(schedule_steps=old_total)
        if cfg.steps != saved.get("steps"):
            kept = (f"--steps {cfg.steps}: the run keeps its learning-rate schedule (warm-up "
                    f"{cfg.warmup}, cosine over {old_total} steps)")
            if cfg.steps > old_total:
                kept += (f"; steps {max(step, old_total) + 1}-{cfg.steps} run at its final "
                         f"rate {float(old_lr(old_total)):.2e}")
            else:
                kept += (f" and stops at step {cfg.steps} at rate "
                         f"{float(old_lr(cfg.steps - 1)):.2e}, before the schedule ends")
            notes.append(("schedule", kept + f". To plan the rate over N steps instead, add "
                          f"--train.schedule_steps=N (the rate at step {step + 1} changes)"))
    elif cfg.schedule_total != old_total:
        notes.append(("warning", f"--train.schedule_steps={cfg.schedule_total}: the learning-"
                      f"rate schedule changes from {old_total} to {cfg.schedule_total} steps; "
                      f"the rate at step {step + 1} goes from {float(old_lr(step)):.2e} to "
                      f"{float(learning_rate_schedule(cfg)(step)):.2e}"))
    return SegmentPlan(cfg, step, notes)


def _warner(log: MetricsLog) -> Callable[[str], None]:
    """``warn(text)``: a warning row of the log (message and console line alike)."""
    return lambda text: log.write("warning", 0, {"message": text}, text)


def _resume(ckpt: Checkpointer, state: TrainState, data: RunData, model_cfg, cfg, log,
            shardings=None):
    step = ckpt.latest_good(_warner(log))  # damaged newer steps set aside, with a warning
    meta = ckpt.read_meta(step)
    check_same_model(meta["model"], model_cfg, cfg.run_dir)
    diffs = train_differences(meta["train"], cfg)
    data_changed = check_same_data(meta, cfg, data, _warner(log))
    if diffs:
        log.write("warning", 0, {}, "resuming with different training settings (the run "
                  "will not match an uninterrupted one):\n  " + "\n  ".join(diffs))
    if cfg.lora.enabled:  # the checkpoint holds the adapters; the base is the base run's
        target = lora.adapter_state(abstract_like(state, shardings))
        state, _ = ckpt.restore(target, step)
        state = lora.with_base(state, lora_base_params(cfg.run_dir, meta))
    else:
        state, _ = ckpt.restore(abstract_like(state, shardings), step)  # onto this run's devices
    iterator = meta["data"].get("iterator")
    iterators = meta["data"].get("iterators") or []
    if len(iterators) == jax.process_count():  # this host's own position (multi-host)
        iterator = iterators[jax.process_index()]
    if iterator is not None:  # None: a converted checkpoint, no data yet
        try:
            data.train.set_state(iterator)  # continue with the next batch
        except ValueError:
            if not data_changed:
                raise
            log.write("warning", 0, {"message": "new data from its start"}, "the new data is "
                      "read from its start (the saved position belongs to the old data)")
    log.write("resume", int(state.step), {}, f"resumed from {cfg.run_dir} at step "
              f"{int(state.step)}")
    return state, meta


def _init_from(cfg: TrainConfig, model_cfg: ModelConfig, data: RunData, state: TrainState,
               optimizer, log) -> TrainState:
    """Fine-tuning: start from the parameters of the run ``cfg.init_from`` names (any
    position scaling, context length or training settings), as the objective takes them
    (the whole model, or a masked-LM encoder under a classification head), with a fresh
    optimizer and step 0. The model fields that differ from that run's are logged."""
    run_dir = cfg.init_from
    _, source, _, source_cfg = load_run(run_dir)
    changes = _model_changes(dataclasses.asdict(source_cfg), dataclasses.asdict(model_cfg))
    differs = f"model differs from {run_dir}: " + (", ".join(changes) or "nothing")
    objective = run_objective(model_cfg, cfg.objective)  # as _train built the model
    model = objective.build(model_cfg, data.labels and len(data.labels))
    lora_on = cfg.lora.enabled  # the base from the run, the adapters as initialised
    try:
        params = objective.start_from(model, state.params[lora.BASE] if lora_on else state.params,
                                      source, jax.random.key(cfg.seed), data.eval_batches[0])
    except ValueError as err:
        raise ValueError(f"cannot initialise from {run_dir}: {err}; fine-tuning keeps the "
                         f"architecture ({differs})") from None
    log.write("init", 0, {"changes": changes}, f"initialised parameters from {run_dir}; "
              f"{differs}")
    if lora_on:
        params = {lora.BASE: params, lora.LORA: state.params[lora.LORA]}
    return state.replace(params=params, opt_state=optimizer.init(params))


def _newest_checkpoint(run_dir: str) -> dict:
    """``{"run": absolute RUN_DIR, "step": its newest intact step}``: what init_from read."""
    ckpt = Checkpointer(run_dir, create=False)
    try:
        return {"run": os.path.abspath(run_dir), "step": ckpt.pick(None)}
    finally:
        ckpt.close()


def _model_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``field old -> new`` for each model field that differs (a switch's own settings as
    ``switch.field`` while its entry is the same)."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict) and a.get("name") == b.get("name"):
            out += _model_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            a, b = (x.get("name") if isinstance(x, dict) else x for x in (a, b))
            out.append(f"{prefix}{key} {a!r} -> {b!r}")
    return out


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


@dataclasses.dataclass
class RunSetup:
    """What a run is built from, before any program or state exists (``prepare_run``)."""

    model_cfg: ModelConfig  # the vocabulary resolved
    plan: SegmentPlan  # plan.cfg: the run's config, with its learning-rate schedule
    objective: Any  # train.objectives.Objective
    data: RunData
    model: Any  # the flax module the objective trains
    optimizer: Any
    schedule: Callable

    @property
    def cfg(self) -> TrainConfig:
        return self.plan.cfg


def prepare_run(model_cfg: ModelConfig, plan: SegmentPlan, auto_vocab: bool) -> RunSetup:
    """The tokenizer, data, model and optimizer of the run ``plan`` continues or starts
    (``plan_segment``); a classifier's labels are written into a new run directory.
    ``auto_vocab``: the model's vocabulary follows the tokenizer's (else a smaller one fails)."""
    cfg = plan.cfg
    if cfg.lora.enabled and cfg.init_from is None:  # (tjax plan may size LoRA without one)
        raise ConfigError(f"train.lora.rank={cfg.lora.rank}: LoRA adapts a trained or converted "
                          "model; give it with --train.init_from=RUN (e.g. a run written by "
                          "tjax convert)")
    objective = run_objective(model_cfg, cfg.objective)
    tokenizer = source_tokenizer(cfg) or training_tokenizer(cfg)
    if auto_vocab:
        model_cfg = model_cfg.replace(vocab_size=tokenizer.vocab_size)
    elif model_cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the {tokenizer.name} "
            f"tokenizer's {tokenizer.vocab_size} ids; set model.vocab_size>="
            f"{tokenizer.vocab_size} (or leave it unset to follow the tokenizer)"
        )
    known = resumed_labels(cfg.run_dir)  # a classifier keeps the class ids it has trained
    data = make_run_data(model_cfg, cfg, tokenizer, objective, known)
    if data.labels and cfg.run_dir and known is None:
        write_labels(cfg.run_dir, data.labels, cfg.data)
    model = lora.wrap(objective.build(model_cfg, data.labels and len(data.labels)), cfg.lora)
    return RunSetup(model_cfg, plan, objective, data, model, make_optimizer(cfg),
                    learning_rate_schedule(cfg))


@dataclasses.dataclass(frozen=True)
class Program:
    """How ``run_lanes`` steps its lanes' states: one state through a strategy's trainer
    (``solo_program``), or the states of several seeds stacked on a leading axis and stepped
    as one program (``train.seeds``)."""

    trainer: ParallelTrainer  # its eval step, state shardings and mesh serve every lane
    place: Callable[[list[TrainState]], Any]  # the lanes' host states -> the program's state
    step: Callable[[Any, list[dict]], tuple[Any, dict]]  # (state, one host batch per lane)
    lane_state: Callable[[Any, int], TrainState]  # lane i's state, one copy of each array
    lane_params: Callable[[Any, int], Any]  # lane i's params as trainer.eval_step takes them
    lane_metrics: Callable[[dict, int], dict]  # lane i's values of a step's fetched metrics


def solo_program(trainer: ParallelTrainer) -> Program:
    """One run through ``trainer``'s strategy: ``train``'s program."""
    return Program(
        trainer,
        place=lambda states: trainer.place_state(states[0]),
        step=lambda state, batches: trainer.step(state, trainer.place_batch(batches[0],
                                                                            local=True)),
        lane_state=lambda state, _: trainer.unreplicate(state),
        lane_params=lambda state, _: state.params,
        lane_metrics=lambda row, _: row,
    )


@dataclasses.dataclass
class Lane:
    """One run directory's part of a training invocation (``train`` steps one, ``train_seeds``
    one per seed): its config and data, its log, checkpoints and guard, and what it reports.
    ``open_lane`` makes one; ``run_lanes`` drives them."""

    setup: RunSetup
    log: MetricsLog
    records: dict  # preset, command: the run's records
    sampler: Callable | None = None  # params -> markdown of a greedy sample (with a tracker)
    ckpt: Checkpointer | None = None
    before: list[dict] = dataclasses.field(default_factory=list)  # earlier segments
    history: list[dict] = dataclasses.field(default_factory=list)
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    guard: Guard | None = None
    eval_batches: list[dict] = dataclasses.field(default_factory=list)  # placed
    lora_base: dict | None = None  # a LoRA run's base checkpoint: {"run": DIR, "step": N}
    started: str = ""  # when this invocation's segment began

    @property
    def cfg(self) -> TrainConfig:
        return self.setup.cfg

    @property
    def data(self) -> RunData:
        return self.setup.data

    def start(self, state: TrainState, trainer: ParallelTrainer) -> TrainState:
        """Open the checkpoints; the state a resume restores (or ``init_from`` fine-tunes
        from), else ``state``; the guard and the placed eval batches."""
        cfg, setup, log = self.cfg, self.setup, self.log
        self.guard = Guard(cfg.skip_nonfinite_steps,
                           lambda step, text: log.write("warning", step, {"message": text}, text))
        self.eval_batches = [trainer.place_batch(b, local=True) for b in self.data.eval_batches]
        if cfg.run_dir:
            self.ckpt = Checkpointer(cfg.run_dir, max_to_keep=cfg.keep_checkpoints)
        if self.ckpt is not None and cfg.resume and self.ckpt.latest_step() is not None:
            state, saved = _resume(self.ckpt, state, self.data, setup.model_cfg, cfg, log,
                                   trainer.state_shardings)
            self.lora_base = saved.get("lora_base")
            self.before = segments_of(saved)
            for kind, text in setup.plan.notes:  # what a changed step count does to the schedule
                log.write(kind, int(state.step), {"message": text}, text)
            if self.records.get("preset") is None:  # resumed without --preset (e.g. --config):
                self.records = {**self.records, "preset": saved.get("preset")}  # same record
        elif cfg.init_from:
            state = _init_from(cfg, setup.model_cfg, self.data, state, setup.optimizer, log)
            if cfg.lora.enabled:
                self.lora_base = _newest_checkpoint(cfg.init_from)
        return state

    def segments(self, start: int, end: int) -> list[dict]:
        """The run's record up to step ``end``: earlier segments and this one."""
        cfg = self.cfg
        return [*self.before, {"start": start, "end": end, "steps": cfg.steps,
                               "schedule_steps": cfg.schedule_total,
                               "warmup_steps": cfg.warmup, "command": self.records.get("command"),
                               "started": self.started}]

    def save(self, step: int, start: int, state: TrainState) -> None:
        """Checkpoint ``state`` (one copy of each array) unless it holds a non-finite value."""
        if self.ckpt is None:
            return
        if not bool(_all_finite((state.params, state.opt_state))):
            raise NonFiniteError(f"the state after step {step} holds non-finite values although "
                                 "every loss and gradient norm was finite; not saved (the "
                                 "latest checkpoint is the last good one)")
        meta = run_meta(self.setup.model_cfg, self.cfg, self.data, step,
                        self.records.get("preset"), self.segments(start, step))
        if self.cfg.lora.enabled:  # the adapters only, and the base they adapt
            state, meta = lora.adapter_state(state), {**meta, "lora_base": self.lora_base}
        self.ckpt.save(step, state, meta)

    def evaluate(self, step: int, eval_step: Callable, params: Any,
                 host_params: Callable[[], Any]) -> None:
        self.last_eval = held_out_metrics(eval_step, params, self.eval_batches)
        last, data = self.last_eval, self.data
        self.log.write(
            "eval", step, last,
            f"step {step:>6} | eval loss {last['loss']:.4f}"
            # bits per byte of text: not for a label's loss, nor a task's answer tokens
            + ("" if data.labels or self.cfg.task else
               f" ({last['loss'] / math.log(2):.3f} bits/{data.tokenizer.unit})")
            + (f", accuracy {last['accuracy']:.3f}" if "accuracy" in last else "")
            + (f", sequence accuracy {last['sequence_accuracy']:.3f}"
               if "sequence_accuracy" in last else ""),
        )
        if self.sampler is not None:
            params = lora.plain_params(self.setup.model, host_params())
            self.log.tracker.text("samples", step, self.sampler(params))


def open_lane(setup: RunSetup, records: dict, bar: tqdm | None,
              early_warnings: tuple[str, ...] | list[str] = (), *, talks: bool = True,
              label: str = "") -> Lane:
    """A lane for ``setup``'s run: its metrics log (and TensorBoard/W&B tracker) opened, the
    ``early_warnings`` (e.g. the lock's) written into it. ``talks``: this process logs (the
    main one)."""
    cfg = setup.cfg
    tracker = None
    if cfg.run_dir and talks and (cfg.tensorboard or cfg.wandb_project):
        tracker = Tracker(cfg.run_dir, {"model": dataclasses.asdict(setup.model_cfg),
                                        "train": dataclasses.asdict(cfg)},
                          tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project)
    log = MetricsLog(cfg.run_dir if talks else None, bar if cfg.progress else None,
                     quiet=not talks, tracker=tracker, label=label)
    for text in early_warnings:
        log.write("warning", 0, {"message": text}, text)
    try:
        sampler = (_make_sampler(lora.plain_model(setup.model), setup.model_cfg, setup.data)
                   if tracker is not None else None)
    except BaseException:
        log.close()
        raise
    return Lane(setup, log, records, sampler)


def _make_sampler(model, model_cfg: ModelConfig, data: RunData):
    """``sampler(params) -> markdown`` of a short greedy continuation of a fixed held-out
    prompt, for the text samples logged at each evaluation; None for a family that does not
    generate, a model that cannot decode with a KV cache (a mask, positions or kernel that
    refuse it: a preview is not worth a failed run), or a multi-host run (the samples are
    decoded on process 0 alone, which cannot see every shard of the parameters there)."""
    family = family_of(model_cfg)
    if not family.generates or jax.process_count() > 1:
        return None
    try:
        check_decoding(model_cfg)
    except ConfigError:
        return None
    tokenizer = data.tokenizer
    batch = data.eval_batches[0]
    row = np.asarray(batch.get("encoder_inputs", batch["inputs"]))[0]
    specials = set(tokenizer.special.values())
    prompt = [int(t) for t in row if int(t) not in specials][:SAMPLE_PROMPT_TOKENS]
    limit = model_cfg.position.max_length(model_cfg)
    new = SAMPLE_NEW_TOKENS if limit is None else min(SAMPLE_NEW_TOKENS, limit - len(prompt))
    if not prompt or new <= 0:
        return None
    sampling = SamplingConfig(max_new_tokens=new, temperature=0.0,
                              stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id,
                              bos_id=tokenizer.bos_id)

    def sampler(params) -> str:
        out = generate(model, params, [prompt], sampling)[0]
        return (f"**prompt** (held-out): `{tokenizer.decode(prompt)!r}`\n\n"
                f"**greedy continuation**: `{tokenizer.decode(out)!r}`")

    return sampler




def run_lanes(lanes: list[Lane], program: Program, states: list[TrainState], bar: tqdm,
              on_step: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Train the lanes together from step 0 (``states``: their fresh states) or from their
    checkpoints, to ``cfg.steps``, through ``program``; each lane logs, evaluates, checkpoints
    and reports as a run of its own. The lanes share every setting but the seed and the run
    directory, so they log, evaluate and save at the same steps; they must start at the same
    step (``ValueError`` otherwise). Returns each lane's final metrics (``train``'s)."""
    trainer = program.trainer
    cfg, model_cfg = lanes[0].cfg, lanes[0].setup.model_cfg
    n_params = count_params(states[0].params)
    # LoRA: the model's own parameters frozen, the adapters trained (named on the start line)
    n_trainable = lora.trainable_count(states[0].params)
    trains = (f" ({n_trainable:,} trainable: LoRA rank {cfg.lora.rank} on "
              f"{','.join(cfg.lora.targets)}, {n_params - n_trainable:,} frozen)"
              if cfg.lora.enabled else "")
    flops = flops_per_token(model_cfg, cfg.seq_len)
    flops_causal = flops_per_token(model_cfg, cfg.seq_len, causal_half=True)  # MaxText's count
    peak, peak_source = device_peak("bfloat16" if model_cfg.dtype == "bfloat16" else "float32")
    if cfg.strategy != "single":  # the whole mesh works on each step
        peak, peak_source = peak * trainer.mesh.size, f"{peak_source}, x{trainer.mesh.size}"
    tokens_per_step = cfg.batch_size * cfg.seq_len  # each lane's
    # one trace of the program (all lanes), in the first lane's run directory
    profiler = StepProfiler(cfg.profile, cfg.run_dir,
                            lambda step, text, values: lanes[0].log.write("profile", step,
                                                                          values, text))

    try:
        states = [lane.start(state, trainer) for lane, state in zip(lanes, states, strict=True)]
        starts = [int(state.step) for state in states]
        if len(set(starts)) > 1:
            raise ValueError(
                "the runs are at different steps ("
                + ", ".join(f"{lane.cfg.run_dir}: {s}" for lane, s in zip(lanes, starts,
                                                                            strict=True))
                + "); runs trained together start from the same step: continue each alone "
                "(train) to the same step first, or train them separately")
        start_step = starts[0]
        state = program.place(states)
        del states
        bar.update(start_step)
        if skipped := profiler.skipped(start_step):  # a resume past the window
            lanes[0].log.write("profile", start_step, {}, skipped)
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        for lane in lanes:
            lane.started = started
            lane.log.write(
                "start",
                start_step,
                {"params": n_params, "trainable_params": n_trainable, "flops_per_token": flops,
                 "flops_per_token_causal_half": flops_causal, "peak_flops": peak},
                f"{model_cfg.family}: {n_params / 1e6:.2f}M params{trains}"
                + "".join(f", {name}={getattr(model_cfg, name)}"
                          for name in ("attention", "mask", "position")
                          if name in family_of(model_cfg).switches)
                + f"; data: {lane.data.description}; peak {peak / 1e9:.0f} GFLOP/s ({peak_source})"
                + (f"; seed {lane.cfg.seed}, one of {len(lanes)} trained together"
                   if len(lanes) > 1 else ""),
            )
        # (step, metrics, each lane's data position before the batch): not yet checked
        pending: list[tuple[int, dict, list]] = []

        def check_pending() -> None:
            rows = jax.device_get([metrics for _, metrics, _ in pending])
            for (step, _, positions), row in zip(pending, rows, strict=True):
                for i, lane in enumerate(lanes):
                    with _naming(lanes, lane):
                        lane.guard.check(step, program.lane_metrics(row, i), positions[i])
            pending.clear()

        def save(step: int, state) -> None:
            if all(lane.ckpt is None for lane in lanes):
                return
            check_pending()  # a diverged step raises here: nothing non-finite is ever saved
            for i, lane in enumerate(lanes):
                with _naming(lanes, lane):
                    lane.save(step, start_step, program.lane_state(state, i))

        window: list[dict] = []
        compile_s = 0.0
        timed_s, timed_steps = 0.0, 0
        stopping = None
        t_window = time.perf_counter()
        with StopSignals() as stop:
            for step in range(start_step, cfg.steps):
                # where each batch is: for spike warnings
                positions = [lane.data.train.get_state() for lane in lanes]
                batches = [next(lane.data.train) for lane in lanes]
                start = time.perf_counter()
                with profiler.step(step):
                    state, metrics = program.step(state, batches)
                profiler.after(step, state)
                first = step == start_step
                if first:  # the first call compiles; keep it out of the throughput figures
                    jax.block_until_ready(state)
                    compile_s = time.perf_counter() - start
                    t_window = time.perf_counter()
                if window:  # keep one step in flight, so the bar tracks finished steps
                    jax.block_until_ready(window[-1]["loss"])
                window.append(metrics)
                pending.append((step + 1, metrics, positions))
                bar.update(1)

                stopping = stop.at(step + 1)  # read once: a signal may land at any line below
                done = step + 1 == cfg.steps or stopping is not None
                if (step + 1) % cfg.log_every == 0 or done:
                    rows = jax.device_get(window)  # waits for the queued steps
                    check_pending()  # raises on a non-finite step past the skip budget
                    elapsed = time.perf_counter() - t_window
                    steps_timed = len(rows) - (1 if step + 1 - len(rows) == start_step else 0)
                    timed_s, timed_steps = timed_s + elapsed, timed_steps + steps_timed
                    tps = (steps_timed * tokens_per_step / elapsed
                           if steps_timed and elapsed else 0.0)
                    for i, lane in enumerate(lanes):
                        values = {**_window_metrics([program.lane_metrics(r, i) for r in rows]),
                                  "tokens_per_s": tps, "mfu": tps * flops / peak,
                                  "mfu_causal_half": tps * flops_causal / peak}
                        lane.history.append({"step": step + 1, **values})
                        lane.log.write(
                            "train",
                            step + 1,
                            values,
                            f"step {step + 1:>6} | loss {values['loss']:.4f} | lr "
                            f"{values['learning_rate']:.2e} | {tps:,.0f} tokens/s | MFU "
                            f"{100 * values['mfu']:.1f}%",
                        )
                    loss = sum(lane.history[-1]["loss"] for lane in lanes) / len(lanes)
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps * len(lanes):,.0f}")
                    window, t_window = [], time.perf_counter()

                if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                    jax.block_until_ready(state)  # queued train steps count as training time
                    t_eval = time.perf_counter()
                    for i, lane in enumerate(lanes):
                        lane.evaluate(step + 1, trainer.eval_step, program.lane_params(state, i),
                                      lambda i=i, s=state: program.lane_state(s, i).params)
                    t_window += time.perf_counter() - t_eval  # eval time is not training throughput

                if (step + 1) % cfg.checkpoint_every == 0 or done:
                    save(step + 1, state)
                if on_step is not None:
                    on_step(step + 1)
                if stopping:
                    for lane in lanes:
                        lane.log.write("stop", step + 1, {}, f"{stopping}: saved step {step + 1}, "
                                       "stopping; run the same command again to resume")
                    break
        profiler.close(state)  # a run that ended or stopped inside the profile window
        final_step = int(program.lane_state(state, 0).step)
        tokens_per_s = timed_steps * tokens_per_step / timed_s if timed_s else 0.0
        return [_finish(lane, final_step, start_step, {
            "steps": final_step,
            "params": n_params,
            "train_loss": lane.history[-1]["loss"] if lane.history else None,
            "eval_loss": lane.last_eval.get("loss"),
            "eval_accuracy": lane.last_eval.get("accuracy"),
            "tokens_per_s": tokens_per_s,
            "tokens_per_step": tokens_per_step,
            "mfu": tokens_per_s * flops / peak,
            # causal attention counted at half its full-context FLOPs (MaxText's convention)
            "mfu_causal_half": tokens_per_s * flops_causal / peak,
            "flops_per_token": flops,
            "flops_per_token_causal_half": flops_causal,
            "peak_flops": peak,
            "peak_source": peak_source,
            "compile_s": compile_s,
            "device": jax.devices()[0].device_kind,
            **({"seeds_together": len(lanes)} if len(lanes) > 1 else {}),
            "stopped_by": stopping if final_step < cfg.steps else None,
            "history": lane.history,
        }) for lane in lanes]
    finally:
        profiler.close()  # a run that failed inside the profile window
        for lane in lanes:
            if lane.ckpt is not None:
                lane.ckpt.close()  # waits for the last asynchronous save (the last good one)


@contextlib.contextmanager
def _naming(lanes: list[Lane], lane: Lane):
    """A ``NonFiniteError`` of one of several lanes names its run."""
    try:
        yield
    except NonFiniteError as err:
        if len(lanes) == 1:
            raise
        name = lane.cfg.run_dir or f"seed {lane.cfg.seed}"
        raise NonFiniteError(f"{name}: {err}") from None


def _finish(lane: Lane, final_step: int, start_step: int, final: dict) -> dict:
    """Log a lane's final metrics and write its run's README; returns them."""
    cfg = lane.cfg
    summary = (f"done: step {final_step}, {final['tokens_per_s']:,.0f} tokens/s, MFU "
               f"{100 * final['mfu']:.1f}%, first step (compile) {final['compile_s']:.1f}s")
    if final["eval_loss"] is not None:
        summary += f", eval loss {final['eval_loss']:.4f}"
    summary += (f"; checkpoint in {cfg.run_dir}" if cfg.run_dir
                else "; nothing saved (no --run-dir)")
    lane.log.write("final", final_step, {k: v for k, v in final.items() if k != "history"},
                   summary)
    if cfg.run_dir and multihost.is_main_process() and final_step > start_step:
        data = lane.data
        write_run_readme(cfg.run_dir, lane.setup.model_cfg, cfg, final,
                         data_description=data.description, tokenizer=data.tokenizer.name,
                         version=__version__, segments=lane.segments(start_step, final_step),
                         labels=data.labels, preset=lane.records.get("preset"),
                         command=lane.records.get("command"),
                         hf_class=None if cfg.lora.enabled else _export_class(lane.setup.model_cfg))
    return final
