"""Model families, each a Linen module built from one ``ModelConfig`` and registered with
what the rest of the library needs to know of it (``family.py``). Adding one: its file here
and one import line in ``load_families`` of ``transformers_jax/builtins.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers_jax.models.family import Family
from transformers_jax.registry import FAMILIES

if TYPE_CHECKING:
    import flax.linen as nn


def family_of(config) -> Family:
    """The registered ``Family`` of ``config.family``."""
    return FAMILIES.get(config.family)


def build_model(config) -> nn.Module:
    """The Linen module for ``config.family`` (``init``/``apply`` as usual)."""
    return family_of(config).build(config)


__all__ = ["FAMILIES", "Family", "build_model", "family_of"]
