"""Errors that stop a training run which was set up correctly (``tjax`` exits with status 1;
a bad setting is a ``ConfigError``/``ValueError``, status 2). Light: no JAX import."""

from __future__ import annotations


class RunFailedError(RuntimeError):
    """The run stopped; the message says why, what was kept and what to try."""


class NonFiniteError(RunFailedError):
    """Training produced a non-finite loss or gradient norm; nothing non-finite was saved."""


class RunDirLockedError(RunFailedError):
    """Another live process is writing the same run directory."""


class CheckpointWriteError(RunFailedError):
    """A checkpoint could not be written (disk full, permissions, ...)."""


class CheckpointDamagedError(RunFailedError):
    """A committed checkpoint's files are missing, resized or hold other contents than saved."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class DamagedStepError(CheckpointDamagedError, ValueError):
    """The checkpoint asked for by its step (``--step``) is damaged: a setting to change (the
    message names the intact steps), so ``tjax`` exits with status 2 like other bad settings."""
