"""Orbax checkpoints of everything that resumes a run: params, optimizer, step, RNG, data
position, tokenizer and the full config.

Layout of a run directory::

    RUN_DIR/checkpoints/<step>/state   the TrainState pytree (orbax StandardSave)
    RUN_DIR/checkpoints/<step>/meta    JSON: model and train config, data position, tokenizer
    RUN_DIR/metrics.jsonl              the log

Orbax writes each step to a temporary directory and renames it only once complete, so a crash
mid-save leaves the previous checkpoint as the latest; ``latest_step`` never returns a
half-written one.

Damage after the commit (a truncated or deleted file: a full disk while copying, a bad sync) is
caught by ``MANIFEST``, the size of every file of a step, written once the step is committed:
``verify(step)`` lists what differs, and ``restore``/``read_meta`` refuse a damaged step with a
``CheckpointDamagedError`` naming the step, the files and the previous good step. A failed write
is a ``CheckpointWriteError``; the previous checkpoints are untouched.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from transformers_jax.config import ModelConfig
from transformers_jax.train.errors import CheckpointDamagedError, CheckpointWriteError

MANIFEST = "tjax_files.json"  # {relative path: size in bytes} of a committed step


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
        self.directory = directory
        self._unlisted: int | None = None  # a step saved whose manifest is not yet written

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start saving (asynchronously); a step already saved is skipped."""
        if step in self.manager.all_steps():
            return
        self._finish()  # the previous save: committed and listed before this one starts
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
        except OSError as err:
            raise self._write_error(step, err) from err
        self._unlisted = step

    def _write_error(self, step: int, err: BaseException) -> CheckpointWriteError:
        kept = [s for s in self.manager.all_steps() if s != step]
        return CheckpointWriteError(
            f"could not write the checkpoint of step {step} to {self.directory}: {err}. The "
            f"run stopped; the earlier checkpoints are intact (latest good: step "
            f"{max(kept) if kept else 'none'}). Free space or fix the directory, then run the "
            "same command again to resume from it"
        )

    def _finish(self) -> None:
        """Wait for the asynchronous save and record its files (the manifest)."""
        step, self._unlisted = self._unlisted, None
        try:
            self.manager.wait_until_finished()
        except OSError as err:
            raise self._write_error(step if step is not None else -1, err) from err
        if step is None or step not in self.manager.all_steps() or jax.process_index():
            return  # one writer of the manifest: process 0, once every host has committed
        root = self._step_dir(step)
        sizes = {os.path.relpath(os.path.join(d, name), root): os.path.getsize(
            os.path.join(d, name)) for d, _, names in os.walk(root) for name in names
            if name != MANIFEST}
        tmp = os.path.join(root, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(sizes, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, MANIFEST))

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def verify(self, step: int) -> list[str]:
        """The damaged files of ``step`` (empty when intact, or when it has no manifest: a
        checkpoint older than manifests, or one whose save was never finished by this code)."""
        root = self._step_dir(step)
        try:
            with open(os.path.join(root, MANIFEST)) as f:
                sizes = json.load(f)
        except FileNotFoundError:
            return []
        except (OSError, ValueError):
            return [f"{MANIFEST} (unreadable)"]
        problems = []
        for rel, size in sorted(sizes.items()):
            path = os.path.join(root, rel)
            if not os.path.exists(path):
                problems.append(f"{rel} (missing)")
            elif os.path.getsize(path) != size:
                problems.append(f"{rel} ({os.path.getsize(path)} bytes, written {size})")
        return problems

    def check(self, step: int) -> None:
        """Raise ``CheckpointDamagedError`` when ``step``'s files are damaged."""
        problems = self.verify(step)
        if problems:
            good = [s for s in self.all_steps() if s < step and not self.verify(s)]
            hint = (f"the previous good checkpoint is step {max(good)} (pass step={max(good)})"
                    if good else "no earlier good checkpoint is left")
            raise CheckpointDamagedError(
                f"the checkpoint of step {step} in {self.directory} is damaged: "
                + ", ".join(problems) + f"; {hint}", step)

    def set_aside(self, step: int) -> str:
        """Move a damaged step out of the checkpoints (kept for inspection) and return where."""
        target = os.path.join(os.path.dirname(self.directory), "damaged_checkpoints",
                              f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(self._step_dir(step), target)
        self.manager.reload()
        return target

    def read_meta(self, step: int | None = None) -> dict:
        step = self._step(step)
        self.check(step)
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restore into the structure (and shardings) of ``abstract_state``.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` (see ``abstract_like``);
        give leaves a ``sharding`` to restore onto another mesh or device count.
        """
        step = self._step(step)
        self.check(step)
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
        elif step not in self.all_steps():
            raise FileNotFoundError(
                f"no checkpoint of step {step} in {self.manager.directory}; it holds steps "
                f"{self.all_steps() or 'none'}: pass one of them (--step), or none for the latest"
            )
        return step

    def wait(self) -> None:
        self._finish()

    def close(self) -> None:
        try:
            self._finish()
        finally:
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
        # compare as JSON holds them: a tuple asked for equals the list a checkpoint stored
        a, b = (_as_json(x.get(key, "<missing>")) for x in (saved, wanted))
        if isinstance(a, dict) and isinstance(b, dict) and a.get("name") != b.get("name"):
            # two different switch entries: their names say it (not every setting)
            out.append(f"{prefix}{key}: checkpoint has {a.get('name')!r}, asked for "
                       f"{b.get('name')!r}")
        elif isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: checkpoint has {a!r}, asked for {b!r}")
    return out


def _as_json(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return value


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
