"""What one invocation of ``train`` does to its run, decided before any program exists: the
checkpoint a resume continues and the learning-rate schedule it follows (``plan_segment``),
then the tokenizer, data, model and optimiser it trains (``prepare_run``)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

from transformers_jax.config import ConfigError, ModelConfig, TrainConfig
from transformers_jax.learning import lora
from transformers_jax.learning.objectives import run_objective
from transformers_jax.learning.optim import learning_rate_schedule, make_optimizer
from transformers_jax.runs.checkpoint import Checkpointer
from transformers_jax.runs.data import RunData, make_run_data
from transformers_jax.runs.labels import resumed_labels, write_labels
from transformers_jax.runs.layout import checkpoint_dir
from transformers_jax.runs.meta import (
    saved_schedule,
)
from transformers_jax.runs.tokenizer import source_tokenizer, training_tokenizer


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


@dataclasses.dataclass
class RunSetup:
    """What a run is built from, before any program or state exists (``prepare_run``)."""

    model_cfg: ModelConfig  # the vocabulary resolved
    plan: SegmentPlan  # plan.cfg: the run's config, with its learning-rate schedule
    objective: Any  # learning.objectives.Objective
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
