"""Names a package exports without importing their modules until first use (PEP 562), so that
importing the package (the CLI's start, a config built from Python) costs nothing it does not
use. Imports nothing of ours."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str],
                 namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for a package's ``__init__``: ``exports`` maps each public
    name to the module that defines it; a name is imported on first use and then kept in the
    package's ``namespace``, so later lookups never reach ``__getattr__``."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
