"""A classifier run's class names, ``RUN_DIR/labels.json`` (``{"labels": [...], "data": PATH}``;
a label's id is its position). Written when fine-tuning starts; read back by a resume (the ids
stay the same, whatever the data holds then) and by loading the run (the head's width)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from transformers_jax.runs.layout import LABELS_FILE, has_checkpoints


def read_labels(run_dir: str) -> tuple[str, ...] | None:
    """The class names the run saved, or None when it saved none."""
    path = os.path.join(run_dir, LABELS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return tuple(json.load(f)["labels"])


def resumed_labels(run_dir: str | None) -> tuple[str, ...] | None:
    """The class names a training run must keep: those saved by a run with checkpoints (before
    its first checkpoint the data may still change); None otherwise."""
    return read_labels(run_dir) if run_dir and has_checkpoints(run_dir) else None


def write_labels(run_dir: str, labels: Sequence[str], data: str | None) -> None:
    """Save the class names (atomically) with the data they came from."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LABELS_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"labels": list(labels), "data": data}, f, indent=1)
    os.replace(path + ".tmp", path)
