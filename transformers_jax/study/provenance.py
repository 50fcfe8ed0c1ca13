"""Where a sweep's numbers came from: the code (its git commit, whether the checkout had
uncommitted changes, a digest of the package's sources), the library versions and the host.
A sweep records it with every cell and in ``results.json``, and refuses to mix code."""

from __future__ import annotations

import hashlib
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every library that touches a number a sweep reports: training, data and tokens, statistics
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "grain",
             "tensorflow-datasets", "sentencepiece", "tokenizers", "scipy", "transformers-jax")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", os.path.dirname(PACKAGE_DIR), *args],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_digest() -> str:
    """sha256 over the package's Python files (path and bytes): what computes the numbers,
    whether or not the package was installed from a git checkout."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                digest.update(os.path.relpath(path, PACKAGE_DIR).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def code_state() -> dict:
    """``commit`` (None outside a git checkout), ``dirty`` (uncommitted changes to the package
    or its pyproject: edits that change numbers; documents do not count) and
    ``source_sha256``."""
    commit = _git("rev-parse", "HEAD")
    dirty = None
    if commit is not None:
        status = _git("status", "--porcelain", "--", os.path.basename(PACKAGE_DIR),
                      "pyproject.toml")
        dirty = bool(status)
    return {"commit": commit, "dirty": dirty, "source_sha256": source_digest()}


def same_code(a: dict, b: dict) -> bool:
    return a.get("source_sha256") == b.get("source_sha256")


def describe(code: dict) -> str:
    commit = (code.get("commit") or "no git commit")[:12]
    return commit + (" with uncommitted changes" if code.get("dirty") else "")


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def tokenizer_digest(tokenizer) -> str:
    """sha256 over the files ``tokenizer.save`` writes (its vocabulary, model and settings):
    equal digests, the same tokens."""
    import hashlib
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save(folder)
        h = hashlib.sha256()
        for root, _, files in sorted(os.walk(folder)):
            for name in sorted(files):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, folder).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def host() -> dict:
    info = {"hostname": socket.gethostname(), "platform": platform.platform(),
            "cpu_count": os.cpu_count()}
    try:
        import jax

        info["devices"] = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    except Exception as err:  # noqa: BLE001  (a record: never fail a sweep over it)
        info["devices"] = f"unknown ({err})"
    return info
