"""The built-in entries of the config's switch registries: every module that registers one is
imported here, and nowhere else for that purpose. This module sits in the layer above data/,
models/ and nn/, which hold the entries (``pyproject.toml``'s layers contract).

Each registry gets the function below that imports its entries' modules and calls it the first
time it is read (``Registry.fill_from``): importing the package, the command line or
``config.py`` loads no model code until a config names a switch; a ``TrainConfig`` loads only
the tokenizers. The entries' modules import no JAX (their hooks import the maths they call
when the model is built), so neither does building or checking a config. The imports are
plain statements, so the import contracts (``lint-imports``) see each edge from here down to
the entries, and ``tests/test_layout.py`` checks that every module registering a built-in
entry is listed.

The package's ``__init__`` imports this module, so the registries know where their entries
are whichever module of the package is imported first. Adding an entry: its module, and one
import line in its registry's function here.
"""

from __future__ import annotations

from transformers_jax.registry import (
    ATTENTION,
    FAMILIES,
    MASKS,
    MLPS,
    NORM_PLACEMENTS,
    NORMS,
    POSITIONS,
    ROPE_SCALINGS,
    TOKENIZERS,
)


def load_positions() -> None:
    from transformers_jax.nn.positions import (  # noqa: F401  (importing registers them)
        alibi,
        fire,
        kerple,
        learned,
        nope,
        randomized,
        rope,
        sinusoidal,
        t5,
        xpos,
    )


def load_rope_scalings() -> None:
    from transformers_jax.nn.positions import rope_scaling  # noqa: F401


def load_masks() -> None:
    from transformers_jax.nn import mask_kinds  # noqa: F401


def load_attention() -> None:
    from transformers_jax.nn.attention import implementations  # noqa: F401


def load_norms() -> None:  # the norms and where they sit
    from transformers_jax.nn import norms  # noqa: F401


def load_mlps() -> None:
    from transformers_jax.nn import activations  # noqa: F401


def load_families() -> None:
    from transformers_jax.models import family  # noqa: F401


def load_tokenizers() -> None:
    from transformers_jax.data import hf_tokenizer, tokenizers  # noqa: F401


POSITIONS.fill_from(load_positions)
ROPE_SCALINGS.fill_from(load_rope_scalings)
MASKS.fill_from(load_masks)
ATTENTION.fill_from(load_attention)
NORMS.fill_from(load_norms)
NORM_PLACEMENTS.fill_from(load_norms)
MLPS.fill_from(load_mlps)
FAMILIES.fill_from(load_families)
TOKENIZERS.fill_from(load_tokenizers)
