"""What a kernel asks about where it runs: the platform compiled for (``pallas`` and ``cudnn``
exist on some only) and, inside ``shard_map``, the mesh axes its values vary over."""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

from transformers_jax.backends import platform_compiled_for, varying_axes

__all__ = ["platform_compiled_for", "vary", "varying_axes"]


def vary(tree: Any, vma: frozenset) -> Any:
    """Mark every leaf as varying over ``vma``: inside ``shard_map`` the branches of a cond
    and the carries of a scan must agree, and fresh zeros vary over nothing."""
    def cast(x):
        missing = tuple(sorted(vma - varying_axes(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree) if vma else tree
