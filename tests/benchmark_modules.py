"""A script of ``benchmarks/`` (a folder of scripts, not a package) loaded as a module, for the
tests of its functions."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def load_benchmark(name: str):
    """``benchmarks/NAME.py`` as the module ``benchmarks_NAME``, entered in ``sys.modules``
    (its dataclasses look their module up while being defined)."""
    path = os.path.join(BENCHMARKS, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
