"""Several training processes on one host, each on its own cores: small models leave cores
idle, and two runs pinned to one of 2 cores each trained about 1.2x faster than two sharing
both (their XLA thread pools stop handing work across cores)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np


def own_cores() -> list[int]:
    """The cores this process may run on (empty where the platform cannot say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def worker_cores(workers: int) -> list[list[int]]:
    """This process's cores split into ``workers`` contiguous groups, one per worker (its XLA
    then sizes its thread pool to them); none pinned (empty groups) with fewer cores than
    workers."""
    cores = own_cores()
    if len(cores) < workers:
        return [[] for _ in range(workers)]
    return [group.tolist() for group in np.array_split(cores, workers)]


def pinned(command: list[str], cores: list[int]) -> list[str]:
    """``command`` run on ``cores`` only: a fresh Python (no threads yet, unlike this process,
    where a fork's ``preexec_fn`` could deadlock) sets its affinity and execs ``command``."""
    if not cores:
        return command
    start = ("import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); "
             "os.execv(sys.argv[2], sys.argv[2:])")
    return [sys.executable, "-c", start, ",".join(map(str, cores)), *command]


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``"i/n"`` (``--shard``: this process takes items i, i + n, i + 2n, ...) as ``(i, n)``."""
    if text is None:
        return None
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise ValueError(f"--shard {text!r}: expected i/n with 0 <= i < n, e.g. 0/2")
    return index, count


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value (``--opt V`` or ``--opt=V``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def run_shards(command: list[str], cores: list[list[int]]) -> list[str]:
    """``command --shard i/n`` in one process per group of ``cores`` (n groups), at once;
    returns once all have ended, as the failed ones (``"i/n (exit c)"``). Stopped early (Ctrl-C,
    an error), it stops them too: no worker goes on training on its own."""
    n = len(cores)
    procs = [subprocess.Popen(pinned([*command, f"--shard={i}/{n}"], group))
             for i, group in enumerate(cores)]
    try:
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
    return [f"{i}/{n} (exit {c})" for i, c in enumerate(codes) if c]
