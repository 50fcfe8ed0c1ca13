"""``transformers_jax.loop.train``, the name the README's Python API gives the training loop,
which lives in ``train/loop.py``."""

from transformers_jax.train.loop import train

__all__ = ["train"]
