"""JAX's persistent compilation cache for the ``tjax`` commands that train or run a model.

A researcher runs the same program many times: every seed of an ablation, every resume, every
``tjax sample`` of a run. XLA compiles it afresh in each new process (the default benchmark
model: 3-4 s on a 2-core CPU; a GPT-2-sized step for a TPU: minutes), unless JAX's persistent
cache holds the executable: then a new process loads it (the same model: under a second).

``tjax train``, ``sample``, ``eval``, ``fill-mask`` and ``sweep`` turn it on, first setting found
wins (``tjax plan`` turns JAX's off: see ``without_persistent_cache``):

1. ``TJAX_COMPILE_CACHE=DIR`` (``off`` turns tjax's cache off);
2. JAX's own setting (``JAX_COMPILATION_CACHE_DIR``, or ``jax_compilation_cache_dir`` set in
   Python): left as it is;
3. ``$XDG_CACHE_HOME/transformers_jax/xla`` (default ``~/.cache/transformers_jax/xla``).

JAX's thresholds stay (only programs that took a second or more to compile are written), and
its cache key covers the program, the JAX and XLA versions, the flags and the devices, so an
entry is never used for another program. In a folder tjax chose, JAX keeps at most
``MAX_BYTES`` and evicts the least recently used entries beyond it (unless
``jax_compilation_cache_max_size`` is set); deleting the folder is always safe. ``tjax bench``
measures compiles: it uses a cache only when told (``--compile-cache DIR``), and then for
every program. A folder that cannot be made is reported and the command compiles without it;
it never stops a run.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping

ENV = "TJAX_COMPILE_CACHE"
OFF = ("off", "none", "0", "false", "")
MAX_BYTES = 4 * 2**30


def default_dir(environ: Mapping[str, str] = os.environ) -> str:
    home = environ.get("HOME") or os.path.expanduser("~")
    base = environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return os.path.join(base, "transformers_jax", "xla")


def chosen_dir(explicit: str | None = None, environ: Mapping[str, str] = os.environ,
               jax_dir: str | None = None) -> str | None:
    """The folder to use (None: no cache of ours), from an explicit choice, then ``ENV``, then
    JAX's own setting ``jax_dir`` (kept as it is), then ``default_dir``. A local folder comes
    back absolute (``~`` expanded), a remote one (``gs://...``) as given."""
    if explicit is None:
        explicit = environ.get(ENV)
        if explicit is None and jax_dir:
            return jax_dir
    if explicit is None:
        return default_dir(environ)
    explicit = explicit.strip()
    if explicit.lower() in OFF:
        return None
    if "://" in explicit:
        return explicit
    return os.path.abspath(os.path.expanduser(explicit))


def use_compile_cache(explicit: str | None = None, *, every_compile: bool = False) -> str | None:
    """Point JAX's persistent cache at ``chosen_dir(explicit)``; returns the folder in use, or
    None. JAX opens its cache at the process's first compile and keeps that folder: called
    later with another one, this warns and keeps JAX's. ``every_compile``: cache even
    sub-second compiles (what ``tjax bench`` times)."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    directory = chosen_dir(explicit, os.environ, current)
    if directory is not None and directory != current and _cache_opened():
        print(f"tjax: warning: JAX's compilation cache is already open at {current} in this "
              f"process; {directory} is not used", file=sys.stderr)
        return current
    if directory is None or directory == current:
        if directory is not None and every_compile:
            _every_compile(jax)
        return directory
    if "://" not in directory:  # gs://... and other remote folders are JAX's to open
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as err:
            print(f"tjax: warning: cannot use {directory} as the compilation cache ({err}); "
                  f"compiling without it (set {ENV} to another folder, or to off)",
                  file=sys.stderr)
            return None
    jax.config.update("jax_compilation_cache_dir", directory)
    if jax.config.jax_compilation_cache_max_size == -1 and _can_evict():
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    if every_compile:
        _every_compile(jax)
    return directory


@contextlib.contextmanager
def without_persistent_cache() -> Iterator[None]:
    """JAX's persistent cache off inside, whatever the environment sets: for ``tjax plan``,
    which compiles for a TPU or GPU it has not got. JAX would write those executables and, on the
    next plan, fail to load each one with a warning (a compile-only client cannot load them)
    and compile it again. Decided at a process's first compile: a process that compiled with
    the cache before keeps using it."""
    import jax

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def _cache_opened() -> bool:
    """Whether JAX has opened its persistent cache in this process (private API, so a JAX
    without it reads as not opened)."""
    try:
        from jax._src import compilation_cache
    except ImportError:
        return False
    return bool(getattr(compilation_cache, "_cache_initialized", False))


def _can_evict() -> bool:
    """JAX evicts old entries only with the ``filelock`` package (a dependency of ours)."""
    try:
        import filelock  # noqa: F401
    except ImportError:
        return False
    return True


def _every_compile(jax) -> None:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
