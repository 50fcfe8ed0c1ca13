"""Experiment tracking: TensorBoard event files (always, with a run directory) and optional
Weights & Biases, fed with the same rows the run writes to ``metrics.jsonl``.

TensorBoard files are written by ``tensorboardX`` (a small pure-Python writer that needs no
TensorFlow) into ``RUN_DIR/tensorboard``; open them with ``tensorboard --logdir RUN_DIR`` (or
``%tensorboard --logdir runs`` in Colab). Each numeric value of a ``train`` or ``eval`` row
becomes the scalar ``{kind}/{name}`` (``train/loss``, ``train/learning_rate``,
``train/grad_norm``, ``train/tokens_per_s``, ``train/mfu``, ``eval/loss``, ...); the run's
configuration is stored as hyper-parameters and as a JSON text summary; text samples go
under ``samples``. Only the process that creates a ``Tracker`` writes: the loop creates one
on process 0 only.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any


def _import_without_torch() -> None:
    """Import tensorboardX without PyTorch. Its writer imports torch whenever it is installed,
    only to accept torch tensors in ``add_embedding``: about a second of CPU in every training
    process (users with PyTorch beside JAX, and the suite). We log Python numbers and text.
    Done here, when the training loop is imported, not later beside the data pipeline's
    threads, which may import torch themselves (Hugging Face ``datasets``)."""
    if "torch" in sys.modules:  # already paid for
        import tensorboardX  # noqa: F401
        return
    sys.modules["torch"] = None  # type: ignore[assignment]  (``import torch`` fails)
    try:
        import tensorboardX  # noqa: F401
        import tensorboardX.summary  # noqa: F401
    finally:
        del sys.modules["torch"]


_import_without_torch()

TENSORBOARD_DIR = "tensorboard"
TRACKED_KINDS = ("train", "eval")


def flatten_config(config: dict, prefix: str = "") -> dict[str, bool | int | float | str]:
    """``{"model": {"d_model": 64}}`` -> ``{"model.d_model": 64}``; values that are not bool,
    int, float or str (None, tuples, lists) become their JSON text, as hyper-parameters need."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{name}."))
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def _scalars(kind: str, values: dict) -> dict[str, float]:
    out = {}
    for key, value in values.items():
        if isinstance(value, bool | int | float) and math.isfinite(float(value)):
            out[f"{kind}/{key}"] = float(value)
    return out


class Tracker:
    """TensorBoard (and W&B when ``wandb_project`` is set) for one run.

    ``config``: nested dict of the run's settings (``{"model": ..., "train": ...}``).
    ``wandb_project``: log the same scalars to Weights & Biases (needs ``pip install wandb``;
    ``WANDB_MODE=offline`` keeps the files in ``RUN_DIR/wandb`` for a later ``wandb sync``).
    """

    def __init__(self, run_dir: str, config: dict, tensorboard: bool = True,
                 wandb_project: str | None = None) -> None:
        self.tb = self.wandb_run = None
        flat = flatten_config(config)
        if tensorboard:
            from tensorboardX import SummaryWriter
            from tensorboardX.summary import hparams

            self.tb = SummaryWriter(logdir=os.path.join(run_dir, TENSORBOARD_DIR))
            # hyper-parameters in this same event directory, so the HParams tab pairs them
            # with this run's eval/loss curve
            for summary in hparams(flat, {"eval/loss": math.nan}):
                self.tb.file_writer.add_summary(summary)
            self.tb.add_text("config", "```\n" + json.dumps(config, indent=1, default=str)
                             + "\n```", 0)
        if wandb_project:
            try:
                import wandb
            except ImportError as err:
                raise ValueError(
                    f"train.wandb_project={wandb_project!r} needs the wandb package, which is "
                    "not installed: pip install wandb (or drop --train.wandb_project)"
                ) from err
            self.wandb_run = wandb.init(project=wandb_project, dir=run_dir, config=flat,
                                        name=os.path.basename(os.path.abspath(run_dir)))

    def log(self, kind: str, step: int, values: dict) -> None:
        """Record a ``metrics.jsonl`` row; only ``train`` and ``eval`` rows become scalars."""
        if kind not in TRACKED_KINDS:
            return
        scalars = _scalars(kind, values)
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, step)
            self.tb.flush()
        if self.wandb_run is not None and scalars:
            self.wandb_run.log(scalars, step=step)

    def text(self, tag: str, step: int, text: str) -> None:
        """A text summary (shown as markdown in TensorBoard's Text tab)."""
        if self.tb is not None:
            self.tb.add_text(tag, text, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
