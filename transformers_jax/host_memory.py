"""Put XLA:CPU's big host buffers on transparent huge pages, so a step stops faulting them in
4 KiB at a time.

XLA:CPU allocates each execution's temporary buffer with ``malloc`` on its own threads (257 MiB
for a config-a training step: 4 layers, width 128, batch 16 x 256) and frees it when the step
ends. glibc serves a block that large with a fresh ``mmap`` (above its mmap threshold, at most
32 MiB), so every step the kernel maps, zeroes and faults in the whole buffer again: on a
2-core AMD EPYC 70,000 minor faults per step and about 30% of the step. With
``glibc.malloc.hugetlb=1`` glibc asks for transparent huge pages on those blocks
(``madvise(MADV_HUGEPAGE)``): 2 MiB per fault, about 500 faults per step, and a 1.4-1.5x
faster step (BENCHMARKS.md section 2b). It needs the kernel's THP mode ``madvise`` or
``always`` (``/sys/kernel/mm/transparent_hugepage/enabled``); under ``never`` it does nothing.

glibc reads its tunables once, when the process starts, so they travel as ``GLIBC_TUNABLES``
in the environment: ``tjax`` and the experiments' entry points re-execute themselves once with
it (``relaunch_with_tunables``); a Python user starts Python with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``. ``TJAX_HOST_MALLOC=system`` turns it off.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = ("glibc.malloc.hugetlb=1",)
OPT_OUT = "TJAX_HOST_MALLOC"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_RELAUNCHED = "TJAX_HOST_MALLOC_RELAUNCHED"


def _is_glibc_linux() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def huge_pages_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or None
    where it cannot be read."""
    try:
        with open(THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def status(environ=None) -> str:
    """What this process runs with, for logs and benchmark JSON: ``"huge pages"``,
    ``"system default"``, ``"system default (TJAX_HOST_MALLOC=system)"`` or ``"not glibc"``.
    ``environ``: the environment to judge (default: this process's, which glibc read at start).
    """
    environ = os.environ if environ is None else environ
    if not _is_glibc_linux():
        return "not glibc"
    present = set(environ.get("GLIBC_TUNABLES", "").split(":"))
    if all(t in present for t in TUNABLES):
        return "huge pages"
    if environ.get(OPT_OUT, "").lower() == "system":
        return f"system default ({OPT_OUT}=system)"
    return "system default"


def environment_with_tunables(environ=None) -> dict[str, str]:
    """``environ`` (default: this process's) with ``TUNABLES`` added to ``GLIBC_TUNABLES``,
    keeping the other tunables there."""
    env = dict(os.environ if environ is None else environ)
    present = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    names = {t.split("=")[0] for t in TUNABLES}
    kept = [t for t in present if t.split("=")[0] not in names]
    env["GLIBC_TUNABLES"] = ":".join([*kept, *TUNABLES])
    return env


def relaunch_with_tunables() -> str:
    """Re-execute this command (``sys.orig_argv``) with ``TUNABLES`` set, unless they are set
    already, the user opted out, or this is not glibc Linux; returns ``status()`` when it does
    not re-execute. Call it only from a program's entry point, never from library code: the
    process is replaced."""
    current = status()
    if (current != "system default" or not getattr(sys, "orig_argv", None)
            or os.environ.get(_RELAUNCHED)):  # glibc ignored them once: do not loop
        return current
    sys.stdout.flush()
    sys.stderr.flush()
    env = environment_with_tunables()
    env[_RELAUNCHED] = "1"
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    return current  # not reached
