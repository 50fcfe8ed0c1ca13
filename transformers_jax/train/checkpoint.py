"""Orbax checkpoints of everything that resumes a run: params, optimizer, step, RNG, data
position, tokenizer and the full config.

Layout of a run directory::

    RUN_DIR/checkpoints/<step>/state   the TrainState pytree (orbax StandardSave)
    RUN_DIR/checkpoints/<step>/meta    JSON: model and train config, data position, tokenizer
    RUN_DIR/metrics.jsonl              the log

Orbax writes each step to a temporary directory and renames it only once complete, so a crash
mid-save leaves the previous checkpoint as the latest; ``latest_step`` never returns a
half-written one.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from transformers_jax.config import ModelConfig


class CheckpointMismatchError(ValueError):
    """A checkpoint was written for a different model than the one asked for."""


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), "checkpoints")


class Checkpointer:
    """A thin wrapper over ``ocp.CheckpointManager`` with our two items, ``state`` and ``meta``."""

    def __init__(self, run_dir: str, *, max_to_keep: int = 3, async_save: bool = True,
                 create: bool = True):
        directory = checkpoint_dir(run_dir)
        if not create and not os.path.isdir(directory):
            raise FileNotFoundError(
                f"no checkpoints in {run_dir!r} (expected {directory}); train with "
                f"--run-dir {run_dir} first, or check the path"
            )
        self.manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=create, enable_async_checkpointing=async_save
            ),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start saving (asynchronously); a step already saved is skipped."""
        if step in self.manager.all_steps():
            return
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def read_meta(self, step: int | None = None) -> dict:
        step = self._step(step)
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restore into the structure (and shardings) of ``abstract_state``.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` (see ``abstract_like``);
        give leaves a ``sharding`` to restore onto another mesh or device count.
        """
        step = self._step(step)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], restored["meta"]

    def _step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(
                    f"no complete checkpoint in {self.manager.directory}: the run saved "
                    "nothing yet (or every save was interrupted)"
                )
        return step

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree: Any, shardings: Any | None = None) -> Any:
    """ShapeDtypeStructs of ``tree`` (optionally with new shardings): a restore target."""
    if shardings is None:
        return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def config_differences(saved: dict, wanted: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two (nested) config dicts."""
    out = []
    for key in sorted(set(saved) | set(wanted)):
        a, b = saved.get(key, "<missing>"), wanted.get(key, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict) and a.get("name") != b.get("name"):
            # two different switch entries: their names say it (not every setting)
            out.append(f"{prefix}{key}: checkpoint has {a.get('name')!r}, asked for "
                       f"{b.get('name')!r}")
        elif isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: checkpoint has {a!r}, asked for {b!r}")
    return out


def check_same_model(saved_model: dict, wanted: ModelConfig, where: str) -> None:
    """Refuse to resume a checkpoint of another model. A config saved before the switches
    carried their settings is migrated first (``ModelConfig.migrate``), so it compares by
    what it means, not by its old layout."""
    diffs = config_differences(ModelConfig.from_dict(saved_model).to_dict(), wanted.to_dict())
    if diffs:
        raise CheckpointMismatchError(
            f"the checkpoint in {where} was written for a different model:\n  "
            + "\n  ".join(diffs)
            + "\nuse the same --model settings, or a new --run-dir to start afresh"
        )
