"""transformers-jax: a readable, switchable JAX/Flax transformer zoo."""

from transformers_jax.config import ConfigError, ModelConfig, RopeConfig, TrainConfig
from transformers_jax.models import build_model

__all__ = ["ConfigError", "ModelConfig", "RopeConfig", "TrainConfig", "build_model"]
__version__ = "0.1.0"
