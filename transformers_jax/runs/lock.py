"""One writer per run directory: ``RUN_DIR/run.lock``.

The holder keeps an exclusive ``fcntl.flock`` on the file for as long as it runs and writes its
PID and hostname into it. The kernel drops the flock when the process ends in any way (exit,
exception, SIGKILL), so a second ``tjax train`` on the same directory fails at once naming the
holder, and a lock file left by a killed run is taken over (with a warning naming the dead
PID). The file is emptied, not removed, at release: removing it would let a third process lock
a new file while a second one still holds the old one.

Multi-host runs: only process 0 takes the lock (the others write only their shards of the
checkpoints, which orbax coordinates); a second multi-host job on the same directory is
stopped by process 0's lock. On a shared filesystem whose ``flock`` does not reach other hosts
(some FUSE mounts), the lock guards one host only.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable

from transformers_jax.config import ConfigError
from transformers_jax.errors import RunDirLockedError
from transformers_jax.runs.layout import LOCK_FILE

__all__ = ["LOCK_FILE", "RunDirLockedError", "RunLock"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class RunLock:
    """``with RunLock(run_dir, warn): ...`` or ``acquire()`` / ``release()``."""

    def __init__(self, run_dir: str, warn: Callable[[str], None] | None = None):
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.warn = warn or (lambda text: None)
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        run_dir = os.path.dirname(self.path)
        if os.path.exists(run_dir) and not os.path.isdir(run_dir):  # makedirs: [Errno 17]
            raise ConfigError(f"train.run_dir={run_dir}: a file, and a run directory is a "
                              "folder; give a new path (or an existing run's folder to "
                              "continue it)")
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = self._read()
            raise RunDirLockedError(
                f"{os.path.dirname(self.path)} is in use by process {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')} (since {holder.get('since', '?')}); one run "
                "directory has one writer: wait for that run, stop it, or pass another --run-dir"
            ) from None
        old = self._read(fd)
        if old.get("pid") is not None:  # we hold the flock, so its writer is gone
            pid, host = int(old["pid"]), old.get("host")
            dead = host == socket.gethostname() and not _pid_alive(pid)
            self.warn(f"taking over the stale lock of process {pid} on {host}: "
                      + ("it is not running" if dead else "it no longer holds the lock")
                      + " (killed or preempted)")
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def _read(self, fd: int | None = None) -> dict:
        try:
            if fd is None:
                with open(self.path, "rb") as f:
                    data = f.read()
            else:
                data = os.pread(fd, 4096, 0)
            return json.loads(data) if data.strip() else {}
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
