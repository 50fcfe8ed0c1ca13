"""Skip JAX's probe for a TPU on a host that has none (imports no JAX).

With libtpu installed (the ``tpu`` extra: ``tjax plan`` compiles TPU programs with it from any
host), JAX's default start-up asks libtpu for a TPU chip, and on a host without one libtpu
prints about five lines of errors (``Failed to find host bounds``, ``unexpected worker
hostname``, a source-location trace) before JAX settles on the CPU. They read as a failure and
are not one. Where there is no TPU chip and no GPU plugin, ``JAX_PLATFORMS=cpu`` is what JAX
would choose anyway, and ``tjax plan`` still compiles for a TPU with it.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from collections.abc import Callable, MutableMapping

GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips on the PCI bus
GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
               "jax_rocm7_plugin", "jax_plugins")


def has_tpu_chip(root: str = "/") -> bool:
    """A TPU on this host: a Google device on the PCI bus, or the accelerator device files
    that TPU VMs expose."""
    for vendor in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
        try:
            with open(vendor) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return bool(glob.glob(os.path.join(root, "dev/accel*"))
                or glob.glob(os.path.join(root, "dev/vfio/[0-9]*")))


def skip_absent_tpu(environ: MutableMapping[str, str] | None = None, root: str = "/",
                    find_spec: Callable = importlib.util.find_spec) -> str | None:
    """Set ``JAX_PLATFORMS=cpu`` where JAX would otherwise probe libtpu for a TPU that is not
    there: before JAX is imported, with ``JAX_PLATFORMS`` unset, libtpu installed, no TPU chip
    and no GPU plugin. Returns the value set, or None when it left things alone."""
    environ = os.environ if environ is None else environ
    if ("jax" in sys.modules and environ is os.environ) or environ.get("JAX_PLATFORMS"):
        return None  # too late to matter, or the user's choice
    if find_spec("libtpu") is None or any(find_spec(name) for name in GPU_PLUGINS):
        return None
    if has_tpu_chip(root):
        return None
    environ["JAX_PLATFORMS"] = "cpu"
    return "cpu"
