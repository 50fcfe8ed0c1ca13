"""The metadata every checkpoint carries (``RUN_DIR/checkpoints/<step>/meta``, JSON): what the
run is, how far it got and what it read, so that a resume can continue it exactly, or refuse,
and a loader can rebuild its model.

- ``model``, ``train``: the whole configs (``ModelConfig``, ``TrainConfig``); ``preset``: the
  named model they started from (a record only);
- ``step`` and ``segments``: the invocations that trained up to it (``segments_of``);
- ``data``: each host's iterator position, the data's description, the settings that chose it
  and a fingerprint of its contents; ``tokenizer``: kind, vocabulary, fingerprint
  (``runs/tokenizer.py``);
- ``versions``; a converted run's ``source`` (``runs/write.py``).

``train_differences`` and ``check_same_data`` compare a checkpoint with the run that resumes
it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from transformers_jax import __version__
from transformers_jax.config import ModelConfig, TrainConfig
from transformers_jax.parallel import multihost
from transformers_jax.runs.checkpoint import Checkpointer, config_differences
from transformers_jax.runs.data import DATA_FIELDS, RunData
from transformers_jax.runs.tokenizer import tokenizer_spec


def run_meta(model_cfg: ModelConfig, cfg: TrainConfig, data: RunData, step: int,
             preset: str | None = None, segments: list[dict] | None = None) -> dict:
    """Everything besides arrays that a resumed run or a sampler needs (stored as JSON).
    ``preset``: the named model the config started from (a record only: ``model`` is the
    whole config, which is what a resume compares). ``segments``: the run's invocations up to
    ``step`` (``train.loop``), read back by the next resume. Every process calls it (the data
    positions are gathered from all of them)."""
    position = data.train.get_state()
    return {
        "preset": preset,
        "model": dataclasses.asdict(model_cfg),
        "train": dataclasses.asdict(cfg),
        "step": step,
        "segments": segments or [],
        # Each host reads its own share: every process's position, in process order (JSON is
        # written by process 0 alone); "iterator" is this (process 0's) for older readers.
        "data": {"iterator": position,
                 "iterators": multihost.allgather_json(position),
                 "description": data.description,
                 "spec": {k: getattr(cfg, k) for k in DATA_FIELDS},
                 "fingerprint": data.fingerprint},
        "tokenizer": tokenizer_spec(data.tokenizer),
        "versions": {"jax": jax.__version__, "transformers_jax": __version__},
    }


def read_run_meta(run_dir: str, step: int | None = None) -> dict:
    """The meta of checkpoint ``step``, or of the newest intact one (``Checkpointer.pick``)."""
    ckpt = Checkpointer(run_dir, create=False)
    try:
        return ckpt.read_meta(ckpt.pick(step))
    finally:
        ckpt.close()


# Settings a checkpoint's run may differ in without changing what is trained (steps and
# schedule_steps: train.loop plans what a change means).
RESUME_IGNORES = frozenset({
    "steps", "schedule_steps", "json", "progress", "log_every", "eval_every", "eval_batches",
    "run_dir", "checkpoint_every", "keep_checkpoints", "resume", "skip_nonfinite_steps",
    "coordinator",  # where process 0 listens, not what is trained
    "accept_data_change", "tensorboard", "wandb_project", "profile", *DATA_FIELDS})
# Settings added after checkpoints were first written: an older checkpoint ran with these
# (LoRA off, data read where it lies).
TRAIN_FIELDS_BEFORE = {"concurrent_groups": 1, "objective": None,
                       **{k: dataclasses.asdict(TrainConfig())[k]
                          for k in ("lora", "data_download")}}


def train_differences(saved: dict, cfg: TrainConfig) -> list[str]:
    """What a checkpoint's training settings (``meta["train"]``) and this run's differ in,
    leaving out those that do not change the training (``RESUME_IGNORES``)."""
    return [d for d in config_differences({**TRAIN_FIELDS_BEFORE, **saved},
                                          dataclasses.asdict(cfg))
            if d.split(":")[0] not in RESUME_IGNORES]


def saved_schedule(saved: dict) -> tuple[int, int | None]:
    """``(steps, warmup_steps)`` of the schedule a checkpoint's ``train`` settings ran."""
    return saved.get("schedule_steps") or saved["steps"], saved.get("warmup_steps")


def segments_of(meta: dict) -> list[dict]:
    """The run's segments up to a checkpoint (one per invocation that trained); a checkpoint
    saved before they were recorded gets one segment standing for all of its invocations."""
    if "segments" in meta or not meta["step"]:
        return list(meta.get("segments", []))
    total, warmup = saved_schedule(meta["train"])
    return [{"start": 0, "end": meta["step"], "steps": meta["train"]["steps"],
             "schedule_steps": total, "warmup_steps": total // 10 if warmup is None else warmup,
             "command": None}]


def check_same_data(meta: dict, cfg: TrainConfig, data: RunData,
                    warn: Callable[[str], None]) -> bool:
    """Refuse (``ValueError``) a resume that would read other data or tokenize differently,
    unless ``train.accept_data_change``: then ``warn`` and return True. A checkpoint older than
    these records is resumed with a warning that its data cannot be checked."""
    saved_data, saved_tok = meta.get("data", {}), meta.get("tokenizer", {})
    now_tok = tokenizer_spec(data.tokenizer)
    spec = saved_data.get("spec") or {k: meta["train"][k] for k in DATA_FIELDS
                                       if k in meta.get("train", {})}
    spec = {"bos_per_row": False, "shuffle_rows": 0, **spec}  # saved before these options
    diffs = config_differences(spec, {k: getattr(cfg, k) for k in DATA_FIELDS if k in spec})
    unknown = []
    if saved_data.get("fingerprint") is None:
        unknown.append("the data's contents")
    elif saved_data["fingerprint"] != data.fingerprint:
        # the same --data with other contents is worth saying in words; another --data is
        # already listed above as a setting
        why = " (the same --data, whose contents changed)" if spec.get("data") == cfg.data else ""
        was = saved_data.get("description") or "its data"
        diffs.append(f"data contents: checkpoint read {was} [{saved_data['fingerprint']}], "
                     f"this run reads {data.description} [{data.fingerprint}]{why}")
    for key in ("kind", "vocab_size", "fingerprint"):
        if key not in saved_tok:
            unknown.append(f"the tokenizer's {key}")
        elif saved_tok[key] != now_tok[key]:
            diffs.append(f"tokenizer {key}: checkpoint has {saved_tok[key]!r}, this run has "
                         f"{now_tok[key]!r}")
    if unknown:
        warn(f"the checkpoint in {cfg.run_dir} predates data fingerprints: "
             f"{', '.join(unknown)} cannot be checked")
    if not diffs:
        return False
    text = (f"the checkpoint in {cfg.run_dir} was trained on other data than this run would "
            "read:\n  " + "\n  ".join(diffs))
    if spec["shuffle_rows"] == 0 and cfg.shuffle_rows:  # the default changed under it
        text += ("\n(packed rows are shuffled by default since 2026-12-03; resume a run "
                 "trained without shuffling with --train.shuffle_rows=0)")
    if not cfg.accept_data_change:
        raise ValueError(text + "\nuse the same data and tokenizer, a new --run-dir, or "
                         "--train.accept_data_change=true to continue on the new data")
    warn(text + "\n(accepted: train.accept_data_change=true)")
    return True
