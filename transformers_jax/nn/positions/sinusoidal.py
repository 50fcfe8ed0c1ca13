"""``sinusoidal``: the fixed sin/cos table of Vaswani et al. 2017, added to token embeddings;
the table module is in ``sinusoidal_table.py``."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from transformers_jax.config import ConfigError
from transformers_jax.nn.positions.base import PositionScheme
from transformers_jax.registry import POSITIONS

if TYPE_CHECKING:
    import flax.linen as nn


FORMS = ("vaswani", "rms")


@POSITIONS.register("sinusoidal")
@dataclasses.dataclass(frozen=True)
class Sinusoidal(PositionScheme):
    """``form="vaswani"`` (default): as the original transformer (Vaswani et al. 2017, sec.
    3.4), token embeddings times sqrt(d_model) plus the table at amplitude 1, so the fixed
    table keeps its weight as the learned embeddings grow.

    ``form="rms"``: this project's earlier form, no token scaling and the table scaled so each
    component's RMS is ``init_std``. Kept for configs and checkpoints made with it; in the
    length experiment it trained like no positions at all (2.137 vs NoPE 2.174 nats), because
    the token embeddings soon outgrow a fixed table of RMS 0.02."""

    form: str = "vaswani"

    def check(self, config: Any) -> None:
        if self.form not in FORMS:
            raise ConfigError(f"position.form={self.form!r}: valid choices: vaswani (tokens "
                              "times sqrt(d_model) plus the unit table, as the paper), rms "
                              "(table at the token embeddings' init RMS, no scaling)")
        if config.d_model % 2:
            raise ConfigError(f"d_model={config.d_model!r}: sinusoidal positions need an even "
                              "d_model (pairs of sin and cos)")

    def token_scale(self, config: Any) -> float:
        return math.sqrt(config.d_model) if self.form == "vaswani" else 1.0

    def embedding(self, config: Any) -> nn.Module:
        from transformers_jax.nn.positions.sinusoidal_table import SinusoidalTable

        if self.form == "vaswani":
            scale = 1.0
        else:
            scale = config.init_std * math.sqrt(2.0)  # sin and cos have RMS 1/sqrt(2)
        return SinusoidalTable(config.d_model, scale, config.dtype)
