"""Model families, each a Linen module built from one ``ModelConfig``."""

from __future__ import annotations

import flax.linen as nn

from transformers_jax.models.bert import BERT
from transformers_jax.models.encdec import EncoderDecoder
from transformers_jax.models.gpt import GPT
from transformers_jax.models.lstm import LSTMLM
from transformers_jax.registry import Registry

FAMILIES: Registry[type[nn.Module]] = Registry("model family")
FAMILIES.add("gpt", GPT)
FAMILIES.add("bert", BERT)
FAMILIES.add("encdec", EncoderDecoder)
FAMILIES.add("lstm", LSTMLM)  # recurrent baseline for the context-usage experiment


def build_model(config) -> nn.Module:
    """The Linen module for ``config.family`` (``init``/``apply`` as usual)."""
    return FAMILIES.get(config.family)(config)
