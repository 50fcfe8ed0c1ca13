"""The layout of a run directory: the name of everything a run keeps (no JAX)::

    RUN_DIR/checkpoints/<step>/state   the TrainState pytree (orbax; ``runs/checkpoint.py``)
    RUN_DIR/checkpoints/<step>/meta    JSON: model and train config, data position, tokenizer,
                                       segments, versions (``runs/meta.py``); a converted run's
                                       also its source (``runs/write.py``)
    RUN_DIR/checkpoints/<step>/tjax_files.json   sizes and SHA-256 of the step's files
    RUN_DIR/damaged_checkpoints/       damaged steps set aside by a resume
    RUN_DIR/tokenizer/                 the tokenizer (``runs/tokenizer.py``); none for a
                                       converted run whose tokenizer is external
    RUN_DIR/labels.json                a classifier's class names, id = position
                                       (``runs/labels.py``)
    RUN_DIR/run.lock                   the writer's PID and host (``runs/lock.py``)
    RUN_DIR/metrics.jsonl              the training log (``train/lane.py``)
    RUN_DIR/tensorboard/               TensorBoard events, when enabled (``train/tracking.py``)
    RUN_DIR/README.md, tjax_config.json   what the run is and how to reproduce and use it
                                       (``runs/readme.py``)

``runs/load.py`` restores any of them (trained here, fine-tuned or converted) for sampling,
evaluation and export.
"""

from __future__ import annotations

import json
import os

CHECKPOINTS_DIR = "checkpoints"
DAMAGED_DIR = "damaged_checkpoints"
TOKENIZER_DIR = "tokenizer"
LABELS_FILE = "labels.json"
LOCK_FILE = "run.lock"
METRICS_FILE = "metrics.jsonl"
README_FILE = "README.md"
# {"model": ..., "train": ..., "segments": [...]}: tjax train --config FILE (segments: a record)
CONFIG_FILE = "tjax_config.json"


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), CHECKPOINTS_DIR)


def has_checkpoints(run_dir: str | None) -> bool:
    """Whether ``run_dir`` holds anything in its checkpoints folder (a run begun)."""
    if not run_dir:
        return False
    directory = checkpoint_dir(run_dir)
    return os.path.isdir(directory) and bool(os.listdir(directory))


def newest_meta(run_dir: str | None) -> dict | None:
    """The meta JSON of ``run_dir``'s newest committed checkpoint, read as a file: no orbax
    and no JAX, so a command can read a run's settings before ``jax.distributed`` starts. Its
    files are not checked here (the loop's resume does that); None when there is none."""
    directory = checkpoint_dir(run_dir) if run_dir else ""
    if not os.path.isdir(directory):
        return None
    steps = sorted((int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True)
    for step in steps:
        folder = os.path.join(directory, str(step))
        if not os.path.exists(os.path.join(folder, "commit_success.txt")):
            continue  # a save that did not finish
        try:
            with open(os.path.join(folder, "meta", "metadata")) as f:
                return json.load(f)
        except (OSError, ValueError):
            continue
    return None
