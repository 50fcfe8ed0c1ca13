"""Orbax checkpoints of everything that resumes a run: params, optimizer, step, RNG, data
position, tokenizer and the full config (``runs/layout.py`` has the whole run directory)::

    RUN_DIR/checkpoints/<step>/state   the TrainState pytree (orbax StandardSave)
    RUN_DIR/checkpoints/<step>/meta    JSON: model and train config, data position, tokenizer

Orbax writes each step to a temporary directory and renames it only once complete, so a crash
mid-save leaves the previous checkpoint as the latest; ``latest_step`` never returns a
half-written one.

Damage after the commit (a truncated, deleted, zeroed or corrupted file: a full disk while
copying, a bad sync, a failing disk) is caught by ``MANIFEST``, the size and SHA-256 of every file
of a step, written once the step is committed: ``verify(step)`` lists what differs, and
``restore``/``read_meta`` refuse a damaged step with a ``CheckpointDamagedError`` naming the step,
the files and the intact steps to load instead. ``pick`` chooses the step to load: the newest
intact one, with a warning, when none was asked for. A failed write is a
``CheckpointWriteError``; the previous checkpoints are untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import orbax.checkpoint as ocp

from transformers_jax.config import ModelConfig
from transformers_jax.errors import (
    CheckpointDamagedError,
    CheckpointWriteError,
    DamagedStepError,
)
from transformers_jax.runs.layout import DAMAGED_DIR, checkpoint_dir

# {"hash": HASH, "files": {relative path: [size in bytes, hex digest]}} of a committed step;
# manifests written before checksums hold {relative path: size} (sizes are checked, not contents)
MANIFEST = "tjax_files.json"
HASH = "sha256"  # hardware-accelerated on current x86 and ARM CPUs: faster there than blake2b


class CheckpointMismatchError(ValueError):
    """A checkpoint was written for a different model than the one asked for."""


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
        self._lister: _Lister | None = None  # writes the last committed step's manifest

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
        """Wait for the asynchronous save, then list its files (the manifest) in the background:
        hashing a big step is a read of it all, which the next training steps need not wait for."""
        step, self._unlisted = self._unlisted, None
        self._join_lister()
        try:
            self.manager.wait_until_finished()
        except OSError as err:
            raise self._write_error(step if step is not None else -1, err) from err
        if step is None or step not in self.manager.all_steps() or jax.process_index():
            return  # one writer of the manifest: process 0, once every host has committed
        self._lister = _Lister(step, self._step_dir(step))

    def _join_lister(self) -> None:
        lister, self._lister = self._lister, None
        if lister is not None and lister.join() is not None:
            raise self._write_error(lister.step, lister.error) from lister.error

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def verify(self, step: int) -> list[str]:
        """The damaged files of ``step``, each with what is wrong (empty when intact, or when it
        has no manifest: a checkpoint older than manifests, or one whose save was never
        finished by this code). Contents are hashed once per process while the files' sizes
        and times stay the same."""
        root = self._step_dir(step)
        try:
            algorithm, listed = read_manifest(root)
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError, AttributeError):
            return [f"{MANIFEST} (unreadable)"]
        stats = _stats(root, listed)
        known = _VERIFIED.get(root)
        if known is not None and known[0] == stats:
            return list(known[1])
        problems = _problems(root, algorithm, listed)
        if _settled(stats):
            _VERIFIED[root] = (stats, problems)
        return problems

    def damage(self, step: int) -> str | None:
        """One line naming ``step``'s damaged files, or None when it is intact."""
        problems = self.verify(step)
        if not problems:
            return None
        return (f"the checkpoint of step {step} in {self.directory} is damaged: "
                + ", ".join(problems))

    def check(self, step: int) -> None:
        """Raise ``CheckpointDamagedError`` when ``step``'s files are damaged."""
        damage = self.damage(step)
        if damage:
            raise CheckpointDamagedError(f"{damage}; {self._instead(step)}", step)

    def intact_steps(self) -> Iterator[int]:
        """The steps whose files are intact, newest first (each checked as it is reached)."""
        return (s for s in sorted(self.all_steps(), reverse=True) if not self.verify(s))

    def _instead(self, step: int) -> str:
        """What to load instead of a damaged ``step``, as the CLI spells it."""
        intact = [s for s in self.intact_steps() if s != step]
        if not intact:
            return ("no intact checkpoint is left: copy the run directory again if it was "
                    "copied, or train afresh with a new --run-dir")
        others = f" (intact steps: {', '.join(map(str, intact))})" if len(intact) > 1 else ""
        return f"load an intact one with --step {intact[0]}{others}"

    def pick(self, step: int | None, warn: Callable[[str], None] | None = None) -> int:
        """The step to load. A ``step`` asked for must be intact (else ``DamagedStepError``,
        a setting to change); with None, the newest intact step, after one warning (once per
        process) naming the damaged newer ones."""
        if step is not None:
            damage = self.damage(self._step(step))
            if damage:
                raise DamagedStepError(f"{damage}; {self._instead(step)}", step)
            return step
        self._step(None)  # at least one complete step
        damaged = []
        for candidate in sorted(self.all_steps(), reverse=True):
            damage = self.damage(candidate)
            if damage is None:
                if damaged:
                    _warn_once(f"{'; '.join(damaged)}; loading step {candidate}, the newest "
                               "intact one", warn or _to_stderr)
                return candidate
            damaged.append(damage)
        raise CheckpointDamagedError(
            f"{'; '.join(damaged)}; nothing intact is left to load: copy the run directory "
            "again if it was copied, or train afresh with a new --run-dir", -1)

    def latest_good(self, warn: Callable[[str], None]) -> int:
        """The newest step whose files are intact, for a resume: damaged newer ones are set
        aside (``set_aside``) with a ``warn``-ing each, so later saves can take their steps."""
        for step in sorted(self.all_steps(), reverse=True):
            damage = self.damage(step)  # sizes, and contents where the save recorded checksums
            if damage is None:
                return step
            where = self.set_aside(step)
            warn(f"{damage}; moved to {where}, resuming from an earlier step")
        raise CheckpointDamagedError(
            f"every checkpoint in {self.directory} is damaged (moved to {DAMAGED_DIR}); "
            "start afresh with a new --run-dir", -1)

    def set_aside(self, step: int) -> str:
        """Move a damaged step out of the checkpoints (kept for inspection) and return where."""
        target = os.path.join(os.path.dirname(self.directory), DAMAGED_DIR,
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
        self._join_lister()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()


class _Lister:
    """Writes a committed step's manifest on a thread of its own; ``join`` returns the error
    that stopped it, if any."""

    def __init__(self, step: int, root: str):
        self.step, self.root, self.error = step, root, None
        # not a daemon: an interpreter exiting without ``close`` still finishes the manifest
        self.thread = threading.Thread(target=self._run, name=f"tjax-manifest-{step}")
        self.thread.start()

    def _run(self) -> None:
        try:
            write_manifest(self.root)
        except OSError as err:
            if os.path.isdir(self.root):  # else removed meanwhile (max_to_keep): nothing to list
                self.error = err

    def join(self) -> OSError | None:
        self.thread.join()
        return self.error


# step directory -> (its files' stats, its problems): a step is hashed once while unchanged
_VERIFIED: dict[str, tuple[tuple, list[str]]] = {}
# A file written this recently could be rewritten within the same timestamp tick, unseen by its
# stats (git's "racily clean" files): such a step is hashed again each time.
_RACY_NS = 2 * 10**9
_WARNED: set[str] = set()  # warnings already given (loading a run reads its meta several times)


def write_manifest(root: str) -> None:
    """List every file of the committed step in ``root``, size and digest, atomically."""
    rels = sorted(os.path.relpath(os.path.join(d, name), root)
                  for d, _, names in os.walk(root) for name in names
                  if name not in (MANIFEST, MANIFEST + ".tmp"))
    sizes = [os.path.getsize(os.path.join(root, rel)) for rel in rels]
    digests = _digests(root, rels, HASH)
    body = {"hash": HASH, "files": {rel: [size, digests[rel]]
                                    for rel, size in zip(rels, sizes, strict=True)}}
    tmp = os.path.join(root, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MANIFEST))


def read_manifest(root: str) -> tuple[str | None, dict[str, tuple[int, str | None]]]:
    """``(hash algorithm, {relative path: (size, digest)})``; the algorithm and digests are None
    in a manifest written before checksums (or with a hash this Python lacks)."""
    with open(os.path.join(root, MANIFEST)) as f:
        body = json.load(f)
    if "files" not in body or not isinstance(body["files"], dict):  # sizes only
        return None, {rel: (int(size), None) for rel, size in body.items()}
    algorithm = body.get("hash")
    if algorithm not in hashlib.algorithms_available:
        algorithm = None
    return algorithm, {rel: (int(size), digest) for rel, (size, digest) in body["files"].items()}


def _digests(root: str, rels: list[str], algorithm: str) -> dict[str, str]:
    """Hex digests of files under ``root``, read in chunks by a few threads at once (hashlib
    lets go of the GIL while it hashes, so big steps are read and hashed in parallel)."""

    def digest(rel: str) -> str:
        with open(os.path.join(root, rel), "rb") as f:
            return hashlib.file_digest(f, algorithm).hexdigest()

    if len(rels) <= 1:
        return {rel: digest(rel) for rel in rels}
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1, len(rels))) as pool:
        return dict(zip(rels, pool.map(digest, rels), strict=True))


def _stats(root: str, listed: dict) -> tuple:
    """What changes when a file is rewritten, truncated or replaced (and the manifest too)."""
    out = []
    for rel in [MANIFEST, *sorted(listed)]:
        try:
            st = os.stat(os.path.join(root, rel))
            out.append((rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
        except FileNotFoundError:
            out.append((rel, None))
    return tuple(out)


def _settled(stats: tuple) -> bool:
    newest = max((s[2] for s in stats if s[1] is not None), default=0)
    return newest < time.time_ns() - _RACY_NS


def _problems(root: str, algorithm: str | None, listed: dict) -> list[str]:
    """Missing or resized files; when there are none, files whose contents differ."""
    problems = []
    for rel, (size, _) in sorted(listed.items()):
        path = os.path.join(root, rel)
        if not os.path.exists(path):
            problems.append(f"{rel} (missing)")
        elif os.path.getsize(path) != size:
            problems.append(f"{rel} ({os.path.getsize(path)} bytes, written {size})")
    if problems or algorithm is None:
        return problems  # a resized file already condemns the step: no need to read it all
    digests = _digests(root, sorted(listed), algorithm)
    return [f"{rel} (the same size, other contents than saved: overwritten or corrupted)"
            for rel, (_, digest) in sorted(listed.items()) if digests[rel] != digest]


def _to_stderr(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def _warn_once(text: str, warn: Callable[[str], None]) -> None:
    if text not in _WARNED:
        _WARNED.add(text)
        warn(text)


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
