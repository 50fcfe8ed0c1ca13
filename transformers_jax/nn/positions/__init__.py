"""Every positional scheme, one file each, registered in ``registry.POSITIONS``.

Adding a scheme: a new file here with a ``PositionScheme`` subclass (its settings as dataclass
fields, the hooks of ``base.py`` it needs) decorated with ``@POSITIONS.register("name")``, and
one import line in ``load_positions`` of ``transformers_jax/builtins.py``. The property tests
(``tests/test_positions_new.py`` and the model tests) cover it as soon as it is registered.
"""

from transformers_jax.nn.positions.alibi import AlibiBias, alibi_slopes
from transformers_jax.nn.positions.base import PositionScheme, distance_BQK
from transformers_jax.nn.positions.fire import FireBias
from transformers_jax.nn.positions.rope import Rope, apply_rope, rope_frequencies
from transformers_jax.nn.positions.sinusoidal import sinusoidal_embedding
from transformers_jax.nn.positions.t5 import T5RelativeBias, t5_relative_bucket
from transformers_jax.registry import POSITIONS, ROPE_SCALINGS

__all__ = [
    "POSITIONS", "ROPE_SCALINGS", "AlibiBias", "FireBias", "PositionScheme", "Rope",
    "T5RelativeBias", "alibi_slopes", "apply_rope", "distance_BQK", "rope_frequencies",
    "sinusoidal_embedding", "t5_relative_bucket",
]
