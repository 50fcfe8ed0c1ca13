"""The CPU backend's host setting: XLA:CPU's big host buffers on transparent huge pages, so a
step stops faulting them in 4 KiB at a time. Standard library only: it runs before JAX starts.

XLA:CPU allocates each execution's temporary buffer with ``malloc`` on its own threads (257 MiB
for the training step of a 4-layer, width-128 model at batch 16 x 256) and frees it when the
step ends. glibc serves a block that large with a fresh ``mmap`` (above its mmap threshold, at
most 32 MiB), so every step the kernel maps, zeroes and faults in the whole buffer again: on a
2-core AMD EPYC 70,000 minor faults per step and about 30% of the step. With
``glibc.malloc.hugetlb=1`` glibc asks for transparent huge pages on those blocks
(``madvise(MADV_HUGEPAGE)``): 2 MiB per fault, about 500 faults per step, and that step ran
1.43x faster. It needs glibc 2.35 or later and the kernel's THP mode ``madvise`` (under
``always`` the kernel already does it; under ``never`` nothing can).

The buffer is still mapped, zeroed and faulted in afresh every step, 2 MiB at a time.
``TJAX_HOST_MALLOC=reuse`` keeps it instead: one malloc arena for all threads, big blocks from
the heap rather than ``mmap``, and no trimming, so the next step gets the same pages back with
no fault at all. On a 2-core Intel Xeon, training steps of that small model ran 1.08x (float32)
and 1.05x (bfloat16) faster, GPT-2 small's 1.18x, at the cost of about 1 s more XLA compile (its
threads share the one arena) and memory that stays with the process. Opt-in: the gain depends
on the host and the model, and a long run gains most.

glibc reads its tunables once, when the process starts, so they travel as ``GLIBC_TUNABLES``
in the environment: ``tjax`` and the experiments' entry points re-execute themselves once with
it (``transformers_jax.backends.prepare_host``, which calls ``relaunch_with_tunables`` where
XLA:CPU computes); a Python user starts Python with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
(``REUSE_TUNABLES`` added for the reuse mode). ``TJAX_HOST_MALLOC=system`` turns it off, and a
malloc tunable of ours the user set is left as it is.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = ("glibc.malloc.hugetlb=1",)
# TJAX_HOST_MALLOC=reuse: every thread in one arena (so the big block comes from the heap XLA's
# threads share), never from mmap, and never handed back to the kernel
REUSE_TUNABLES = ("glibc.malloc.arena_max=1", "glibc.malloc.mmap_max=0",
                  "glibc.malloc.trim_threshold=2147483647")
OPT_OUT = "TJAX_HOST_MALLOC"
MODES = ("", "system", "reuse")
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_RELAUNCHED = "TJAX_HOST_MALLOC_RELAUNCHED"
# every variable that decides a process's malloc here: what a harness removes to start a
# worker from glibc's defaults
VARIABLES = ("GLIBC_TUNABLES", OPT_OUT, _RELAUNCHED)


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


def glibc_version() -> tuple[int, ...]:
    """This process's glibc version, ``(2, 39)``; ``()`` where it cannot be read."""
    try:
        return tuple(int(p) for p in platform.libc_ver()[1].split("."))
    except ValueError:
        return ()


def mode(environ=None) -> str:
    """``TJAX_HOST_MALLOC`` of ``environ`` (default: this process's): ``""`` (huge pages),
    ``"system"`` or ``"reuse"``. ValueError for any other value."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(OPT_OUT, "").lower()
    if chosen not in MODES:
        raise ValueError(f"{OPT_OUT}={environ[OPT_OUT]!r}: set it to 'system' to keep glibc's "
                         "malloc defaults, to 'reuse' to keep XLA's freed buffers for the next "
                         "step, or unset it to put XLA's big buffers on huge pages")
    return chosen


def tunables(environ=None) -> tuple[str, ...]:
    """The glibc tunables the mode of ``environ`` asks for (none for ``system``)."""
    chosen = mode(environ)
    return {"": TUNABLES, "reuse": TUNABLES + REUSE_TUNABLES}.get(chosen, ())


def status(environ=None, thp_mode: str | None = "read") -> str:
    """What this process runs with, for logs and benchmark JSON: ``"huge pages"`` (the tunable
    is set and can act), ``"freed blocks reused (TJAX_HOST_MALLOC=reuse)"`` (its
    tunables set), ``"system default"`` (the relaunch would set them), ``"system default
    (why)"`` (it would not: opted out, glibc too old, THP off or already ``always``), ``"user
    setting (...)"`` or ``"not glibc"``. ``environ``: the environment to judge (default: this
    process's, which glibc read at start); ``thp_mode``: the kernel's mode (default: read from
    ``THP_MODE``). Raises ValueError for a ``TJAX_HOST_MALLOC`` outside ``MODES``."""
    environ = os.environ if environ is None else environ
    chosen = mode(environ)
    if not _is_glibc_linux():
        return "not glibc"
    present = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    wanted = tunables(environ)
    if (wanted and all(t in present for t in wanted)) or (chosen == "system" and _label(present)):
        return _label(present)  # (set by hand under "system": glibc applies them all the same)
    names = {t.split("=")[0] for t in wanted or TUNABLES}
    # one of our names at another value is the user's: left alone (a user's arena_max in the
    # default mode is not ours at all); ours at our value, the relaunch completes
    theirs = [t for t in present if t.split("=")[0] in names and t not in wanted]
    if theirs:
        return f"user setting ({':'.join(theirs)})"
    if chosen == "system":
        return f"system default ({OPT_OUT}=system)"
    if chosen == "reuse":  # the arena settings act without huge pages and in older glibc
        return "system default"
    if glibc_version() < (2, 35):
        return f"system default (glibc {platform.libc_ver()[1]} has no malloc.hugetlb)"
    thp = huge_pages_mode() if thp_mode == "read" else thp_mode
    if thp != "madvise":
        return f"system default (transparent huge pages: {thp or 'unknown'})"
    return "system default"


def _label(present: list[str]) -> str | None:
    """What the tunables in ``present`` amount to, whichever mode asked for them."""
    if all(t in present for t in TUNABLES + REUSE_TUNABLES):
        return "freed blocks reused (TJAX_HOST_MALLOC=reuse)"
    return "huge pages" if all(t in present for t in TUNABLES) else None


def environment_with_tunables(environ=None) -> dict[str, str]:
    """``environ`` (default: this process's) with the tunables of its ``TJAX_HOST_MALLOC`` mode
    added to ``GLIBC_TUNABLES`` (replacing the same names, keeping the other tunables there)."""
    env = dict(os.environ if environ is None else environ)
    present = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    wanted = tunables(env)
    names = {t.split("=")[0] for t in wanted}
    kept = [t for t in present if t.split("=")[0] not in names]
    if kept or wanted:
        env["GLIBC_TUNABLES"] = ":".join([*kept, *wanted])
    return env


def relaunch_with_tunables() -> str:
    """Re-execute this command (``sys.orig_argv``) with the mode's ``tunables`` set, unless
    ``status()`` says it would not act or is set (then it returns that). Call it only from a
    program's entry point, never from library code: the process is replaced. ValueError: see
    ``status``."""
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
