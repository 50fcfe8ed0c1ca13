"""One run directory's part of a training invocation (``Lane``): its metrics log, the state it
starts from (a resume, or another run's parameters to fine-tune), its guard, evaluations,
checkpoints and, at the end, its README. ``train`` drives one lane, ``train.seeds`` one per
seed; ``train/lanes.py`` steps them."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from transformers_jax import __version__
from transformers_jax.config import ConfigError, ModelConfig, TrainConfig
from transformers_jax.evaluation import held_out_metrics
from transformers_jax.learning import lora
from transformers_jax.learning.objectives import run_objective
from transformers_jax.learning.step import TrainState
from transformers_jax.models import family_of
from transformers_jax.nn.kvcache import check_decoding
from transformers_jax.parallel import multihost
from transformers_jax.parallel.strategies import ParallelTrainer
from transformers_jax.runs.checkpoint import Checkpointer, abstract_like, check_same_model
from transformers_jax.runs.data import RunData
from transformers_jax.runs.layout import METRICS_FILE
from transformers_jax.runs.load import load_run, lora_base_params
from transformers_jax.runs.meta import (
    check_same_data,
    run_meta,
    segments_of,
    train_differences,
)
from transformers_jax.runs.readme import write_run_readme
from transformers_jax.sample import SamplingConfig, generate
from transformers_jax.train.guard import Guard, NonFiniteError
from transformers_jax.train.setup import RunSetup
from transformers_jax.train.tracking import Tracker

SAMPLE_PROMPT_TOKENS = 32  # the held-out text that the evaluation samples continue
SAMPLE_NEW_TOKENS = 48


def _export_class(model_cfg: ModelConfig) -> str | None:
    """The Hugging Face class the run's README may suggest exporting to (the converter's
    answer), imported only when a README is written."""
    from transformers_jax.convert.api import export_class

    return export_class(model_cfg)


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


def finish(lane: Lane, final_step: int, start_step: int, final: dict) -> dict:
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
