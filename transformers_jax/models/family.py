"""What a model family is: its module and what the rest of the library needs to know of it.

Each family registers one ``Family`` in ``registry.FAMILIES`` beside its module (``gpt.py``,
``bert.py``, ``encdec.py``, ``lstm.py``). Training, data, sampling, benchmarks and conversion
ask the entry, never the family's name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.config import ConfigError, ModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family.

    ``module``: the Linen module, built as ``module(config)``. ``objective``: the name of its
    default training objective (an ``OBJECTIVES`` entry, ``train/objectives.py``).
    ``input_keys``: the keyword inputs its module reads from a batch besides the tokens
    (``batch["inputs"]``); every objective applies the model with these, so a new family
    declares them here and nowhere else. ``default_mask``: the mask it uses
    unless asked otherwise. ``generates``: how it decodes with a KV cache: ``"self"`` (the
    decoder continues its own tokens), ``"seq2seq"`` (an encoder reads the prompt, a decoder
    writes from ``bos``) or None. ``tasks``: the synthetic-task layout it trains on
    (``"decoder"``, ``"encdec"``) or None when it trains on text only; ``needs_task``: it
    trains on tasks only. ``masked_lm``: its text batches are corrupted for masked-LM.
    ``fills_masks``: ``tjax fill-mask`` works on it. ``recurrent``: it reads its context
    through a recurrent state, not attention (no attention, mask or position switch applies).
    """

    module: type[nn.Module]
    objective: str
    input_keys: tuple[str, ...]
    default_mask: str = "causal"
    generates: str | None = None
    tasks: str | None = "decoder"
    needs_task: bool = False
    masked_lm: bool = False
    fills_masks: bool = False
    cross_attention: bool = False  # a decoder stack that reads an encoder (FLOPs, layers)
    head_transform: bool = False  # a C x C dense before the output matrix (BERT's MLM; FLOPs)
    recurrent: bool = False

    @property
    def continues_prompt(self) -> bool:
        """Its samples continue the prompt's text; a seq2seq model's answer it instead."""
        return self.generates == "self"

    def build(self, config: ModelConfig) -> nn.Module:
        return self.module(config)

    def check(self, config: ModelConfig) -> None:
        """Refuse a config the family cannot train (default: anything goes)."""

    def inputs_for(self, config: ModelConfig, tokens_BT: jax.Array) -> dict[str, Any]:
        """The keyword inputs besides the tokens that running the model on ``tokens_BT``
        needs (an encoder-decoder reads them as its source too; a prefix-LM mask gets a
        one-token prefix)."""
        kwargs: dict[str, Any] = {}
        if config.mask.needs_prefix_len:
            kwargs["prefix_len"] = jnp.ones((tokens_BT.shape[0],), jnp.int32)
        return kwargs

    def example_inputs(self, config: ModelConfig, length: int = 8) -> tuple[jax.Array, dict]:
        """``(tokens [1, length], keyword inputs)`` for ``init``/``apply`` on a dummy batch."""
        tokens = jnp.zeros((1, length), jnp.int32)
        return tokens, self.inputs_for(config, tokens)

    def forward_flops(self, config: ModelConfig, seq_len: int) -> float:
        """Matmul FLOPs per token of one forward pass (2 per multiply-add): every weight
        matmul (the output head and any transform before it included, not the embedding
        lookup) and the two attention matmuls over the full ``seq_len`` keys (PaLM's MFU
        convention: causal masking is not subtracted). An encoder-decoder counts both stacks
        over equally long sequences."""
        C, H, N, D, F, V = (config.d_model, config.n_heads, config.kv_heads,
                            config.dims_per_head, config.ff_dim, config.vocab_size)
        mlp_mats = 3 if config.mlp.gated else 2
        attention = C * H * D + 2 * C * N * D + H * D * C
        per_layer = attention + mlp_mats * C * F
        layers, cross_layers = config.n_layers, 0
        if self.cross_attention:
            cross_layers = config.decoder_layers
            layers += cross_layers
        weight_macs = layers * per_layer + cross_layers * attention + C * V
        if self.head_transform:
            weight_macs += C * C
        attention_macs = (layers + cross_layers) * 2 * seq_len * H * D
        return 2.0 * (weight_macs + attention_macs)


def check_decoder_mask(config: ModelConfig) -> None:
    """A decoder trained by teacher forcing must not see the targets it predicts."""
    if not config.mask.decodes:
        raise ConfigError(
            f"mask={config.mask.name!r}: the {config.family} decoder's self-attention must not "
            "see later targets; use a mask that decodes (causal, sliding_window or prefix)")
