"""transformers-jax: a readable, switchable JAX/Flax transformer zoo.

The names below load on first use (PEP 562), so importing a light submodule such as
``transformers_jax.backends.cpu_malloc`` does not import JAX: ``tjax`` re-executes itself with
its malloc setting before it pays for JAX's start-up, not after. The switch registries learn
here where their built-in entries are (``builtins.py``), and load them when first read.
Imported before JAX on a host with libtpu and no TPU, it sets ``JAX_PLATFORMS=cpu``
(``backends/tpu_probe.py``): JAX's probe for the absent chip only prints errors.
"""

from __future__ import annotations

from transformers_jax import builtins  # noqa: F401  (gives each registry its built-in entries)
from transformers_jax.backends.tpu_probe import skip_absent_tpu
from transformers_jax.lazy import lazy_exports

skip_absent_tpu()  # before JAX starts (none of the above imports it): no libtpu noise

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "ConfigError": "transformers_jax.config",
    "ModelConfig": "transformers_jax.config",
    "TrainConfig": "transformers_jax.config",
    "build_model": "transformers_jax.models",
    "Rope": "transformers_jax.nn.positions",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("transformers_jax", _EXPORTS, globals())

