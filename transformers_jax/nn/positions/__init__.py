"""Every positional scheme, one file each, registered in ``registry.POSITIONS``; the Flax module
a scheme builds sits beside it (``t5_bias.py`` beside ``t5.py``: see ``base.py``).

Adding a scheme: a new file here with a ``PositionScheme`` subclass (its settings as dataclass
fields, the hooks of ``base.py`` it needs) decorated with ``@POSITIONS.register("name")``, and
one import line in ``load_positions`` of ``transformers_jax/builtins.py``. The property tests
(``tests/test_positions_new.py`` and the model tests) cover it as soon as it is registered.

The names below load on first use: the registry imports a scheme's file, and so this package,
while a config is built, which imports no JAX.
"""

from __future__ import annotations

from transformers_jax.lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    "POSITIONS": "transformers_jax.registry",
    "ROPE_SCALINGS": "transformers_jax.registry",
    "AlibiBias": "transformers_jax.nn.positions.alibi_bias",
    "alibi_slopes": "transformers_jax.nn.positions.alibi_bias",
    "PositionScheme": "transformers_jax.nn.positions.base",
    "distance_BQK": "transformers_jax.nn.positions.base",
    "FireBias": "transformers_jax.nn.positions.fire_bias",
    "Rope": "transformers_jax.nn.positions.rope",
    "apply_rope": "transformers_jax.nn.positions.rope",
    "rope_frequencies": "transformers_jax.nn.positions.rope",
    "sinusoidal_embedding": "transformers_jax.nn.positions.sinusoidal_table",
    "T5RelativeBias": "transformers_jax.nn.positions.t5_bias",
    "t5_relative_bucket": "transformers_jax.nn.positions.t5_bias",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("transformers_jax.nn.positions", _EXPORTS, globals())
