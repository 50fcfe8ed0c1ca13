"""transformers-jax: a readable, switchable JAX/Flax transformer zoo."""

from transformers_jax.config import ConfigError, ModelConfig, TrainConfig
from transformers_jax.models import build_model
from transformers_jax.nn.positions import Rope

__all__ = ["ConfigError", "ModelConfig", "Rope", "TrainConfig", "build_model"]
__version__ = "0.1.0"
