"""Keep freed host memory for reuse, so XLA:CPU steps stop page-faulting their buffers.

XLA:CPU allocates each execution's temporary buffer with ``malloc`` on its own threads (257 MiB
for a config-a training step: 4 layers, width 128, batch 16 x 256) and frees it when the step
ends. glibc serves a block that large with a fresh ``mmap`` (its mmap threshold is at most
32 MiB, and a thread's own arena falls back to ``mmap`` whatever the threshold), so every step
the kernel hands out and zeroes about 70,000 new pages. Measured on a 2-core AMD EPYC: 70k minor
faults per step, 205 ms; with one arena, no ``mmap`` and no trimming, the next step reuses the
freed block: 3k faults, 145 ms (BENCHMARKS.md, "Host memory").

The settings must be in place before the process starts threads (glibc fixes its arena limit
when a second thread first allocates, and importing numpy starts one), so they travel as
``GLIBC_TUNABLES`` in the environment: ``tjax`` and the experiments' entry points re-execute
themselves once with them (``relaunch_keeping_freed_memory``); a Python user starts Python with
``GLIBC_TUNABLES=<TUNABLES>`` set. The cost: the process keeps its peak heap instead of
returning freed memory to the system, and its threads share one malloc arena.
``TJAX_HOST_MALLOC=system`` turns it off.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = ("glibc.malloc.arena_max=1", "glibc.malloc.mmap_max=0",
            "glibc.malloc.trim_threshold=2147483647")
OPT_OUT = "TJAX_HOST_MALLOC"
_RELAUNCHED = "TJAX_HOST_MALLOC_RELAUNCHED"


def _is_glibc_linux() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def status(environ=None) -> str:
    """What this process runs with, for logs and benchmark JSON: ``"keeps freed memory"``,
    ``"system default"``, ``"system default (TJAX_HOST_MALLOC=system)"`` or ``"not glibc"``.
    ``environ``: the environment to judge (default: this process's; glibc read the tunables
    from it at start)."""
    environ = os.environ if environ is None else environ
    if not _is_glibc_linux():
        return "not glibc"
    present = set(environ.get("GLIBC_TUNABLES", "").split(":"))
    if all(t in present for t in TUNABLES):
        return "keeps freed memory"
    if environ.get(OPT_OUT, "").lower() == "system":
        return f"system default ({OPT_OUT}=system)"
    return "system default"


def environment_keeping_freed_memory(environ=None) -> dict[str, str]:
    """``environ`` (default: this process's) with ``TUNABLES`` added to ``GLIBC_TUNABLES``,
    keeping any tunables already there."""
    env = dict(os.environ if environ is None else environ)
    present = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    names = {t.split("=")[0] for t in TUNABLES}
    kept = [t for t in present if t.split("=")[0] not in names]
    env["GLIBC_TUNABLES"] = ":".join([*kept, *TUNABLES])
    return env


def relaunch_keeping_freed_memory() -> str:
    """Re-execute this command (``sys.orig_argv``) with the tunables set, unless they are set
    already, the user opted out, or this is not glibc Linux; returns ``status()`` when it does
    not re-execute. Call it only from a program's entry point, never from library code: the
    process is replaced."""
    current = status()
    if (current != "system default" or not getattr(sys, "orig_argv", None)
            or os.environ.get(_RELAUNCHED)):  # glibc ignored them once: do not loop
        return current
    sys.stdout.flush()
    sys.stderr.flush()
    env = environment_keeping_freed_memory()
    env[_RELAUNCHED] = "1"
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    return current  # not reached
