"""What a model family is: its module and what the rest of the library needs to know of it;
and the built-in families (``registry.FAMILIES``), whose modules are ``gpt.py``, ``bert.py``,
``encdec.py`` and ``lstm.py``. Training, data, sampling, benchmarks and conversion ask the
entry, never the family's name.

A config names and checks a family without JAX, so this file imports none at the top: a
built-in family's ``module`` imports its Linen module when a model is built.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from transformers_jax.config import ConfigError, ModelConfig
from transformers_jax.registry import FAMILIES

if TYPE_CHECKING:
    from collections.abc import Callable

    import flax.linen as nn
    import jax


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family.

    ``module``: what builds its Linen module, as ``module(config)``: the module's class, or a
    function that imports the class and builds it (the built-in families, below).
    ``objective``: the name of its default training objective (an ``OBJECTIVES`` entry,
    ``learning/objectives.py``). ``input_keys``: the keyword inputs its module reads from a batch
    besides the tokens (``batch["inputs"]``); every objective applies the model with these, so
    a new family declares them here and nowhere else. ``default_mask``: the mask it uses
    unless asked otherwise. ``generates``: how it decodes with a KV cache: ``"self"`` (the
    decoder continues its own tokens), ``"seq2seq"`` (an encoder reads the prompt, a decoder
    writes from ``bos``) or None. ``tasks``: the synthetic-task layout it trains on
    (``"decoder"``, ``"encdec"``) or None when it trains on text only; ``needs_task``: it
    trains on tasks only. ``masked_lm``: its text batches are corrupted for masked-LM.
    ``fills_masks``: ``tjax fill-mask`` works on it. ``recurrent``: it reads its context
    through a recurrent state, not attention. ``switches``: the config's switches its module
    reads; one it does not read is refused unless left at its default (a user who set it would
    take it for used), and the start line names only these.
    """

    module: type[nn.Module] | Callable[[ModelConfig], nn.Module]
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
    switches: tuple[str, ...] = ("attention", "mask", "position", "norm", "norm_position", "mlp")

    @property
    def continues_prompt(self) -> bool:
        """Its samples continue the prompt's text; a seq2seq model's answer it instead."""
        return self.generates == "self"

    def build(self, config: ModelConfig) -> nn.Module:
        return self.module(config)

    def check(self, config: ModelConfig) -> None:
        """Refuse a config the family cannot train: a switch it does not read, set."""
        for field in dataclasses.fields(ModelConfig):
            name, registry = field.name, field.metadata.get("registry")
            value = getattr(config, name)
            if registry and name not in self.switches and value != registry.get(field.default)():
                raise ConfigError(
                    f"model.{name}={value}: family={config.family} does not read the {name} "
                    f"switch (it reads {', '.join(self.switches) or 'none of them'}); drop it")

    def inputs_for(self, config: ModelConfig, tokens_BT: jax.Array) -> dict[str, Any]:
        """The keyword inputs besides the tokens that running the model on ``tokens_BT``
        needs (an encoder-decoder reads them as its source too; a prefix-LM mask gets a
        one-token prefix)."""
        import jax.numpy as jnp

        kwargs: dict[str, Any] = {}
        if config.mask.needs_prefix_len:
            kwargs["prefix_len"] = jnp.ones((tokens_BT.shape[0],), jnp.int32)
        return kwargs

    def example_inputs(self, config: ModelConfig, length: int = 8) -> tuple[jax.Array, dict]:
        """``(tokens [1, length], keyword inputs)`` for ``init``/``apply`` on a dummy batch."""
        import jax.numpy as jnp

        tokens = jnp.zeros((1, length), jnp.int32)
        return tokens, self.inputs_for(config, tokens)

    def forward_flops(self, config: ModelConfig, seq_len: int, causal_half: bool = False
                      ) -> float:
        """Matmul FLOPs per token of one forward pass (2 per multiply-add): every weight
        matmul (the output head and any transform before it included, not the embedding
        lookup) and the two attention matmuls over the full ``seq_len`` keys (PaLM's MFU
        convention: causal masking is not subtracted). An encoder-decoder counts both stacks
        over equally long sequences.

        ``causal_half``: MaxText's convention instead (since its PR #1988): the self-attention
        of a stack whose mask is causal (``mask.causal``: gpt's causal or sliding-window
        mask, an encoder-decoder's decoder) counts half of its scores and weighted-sum FLOPs,
        as a query sees on average half of the keys. Per token and causal layer, attention is
        then ``2 * T * H * D`` FLOPs instead of ``4 * T * H * D`` (T keys, H heads of D);
        bidirectional and cross-attention stay full, and a window is not modelled further."""
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
        # scores (q.k) and weighted sum (p.v): seq_len * H * D multiply-adds each, per token
        attention_macs = (layers + cross_layers) * 2 * seq_len * H * D
        if causal_half and config.mask.causal:  # the causal self-attention stack: half of it
            causal_layers = cross_layers if self.cross_attention else config.n_layers
            attention_macs -= causal_layers * seq_len * H * D
        return 2.0 * (weight_macs + attention_macs)


def check_decoder_mask(config: ModelConfig) -> None:
    """A decoder trained by teacher forcing must not see the targets it predicts."""
    if not config.mask.decodes:
        raise ConfigError(
            f"mask={config.mask.name!r}: the {config.family} decoder's self-attention must not "
            "see later targets; use a mask that decodes (causal, sliding_window or prefix)")


# The built-in families ------------------------------------------------------------------------


def build_gpt(config: ModelConfig) -> nn.Module:
    from transformers_jax.models.gpt import GPT

    return GPT(config)


# The keyword inputs ``GPT.__call__`` reads from a batch (besides the tokens).
GPT_INPUTS = ("positions", "segment_ids", "prefix_len")

FAMILIES.add("gpt", Family(build_gpt, objective="lm", input_keys=GPT_INPUTS, generates="self"))


def build_bert(config: ModelConfig) -> nn.Module:
    from transformers_jax.models.bert import BERT

    return BERT(config)


# The keyword inputs ``BertEncoder`` reads from a batch (besides the tokens); the
# classification heads (``heads.py``) read the same.
BERT_INPUTS = ("token_types", "positions", "segment_ids", "prefix_len")

FAMILIES.add("bert", Family(build_bert, objective="mlm", input_keys=BERT_INPUTS,
                            default_mask="bidirectional", tasks=None, masked_lm=True,
                            fills_masks=True, head_transform=True))


def build_encdec(config: ModelConfig) -> nn.Module:
    from transformers_jax.models.encdec import EncoderDecoder

    return EncoderDecoder(config)


@dataclasses.dataclass(frozen=True)
class EncDecFamily(Family):
    def check(self, config: ModelConfig) -> None:
        super().check(config)
        check_decoder_mask(config)
        if config.mask.needs_prefix_len:
            raise ConfigError(
                f"mask={config.mask.name!r}: an encoder-decoder's decoder reads its source "
                "through cross-attention (the encoder sees it whole), and its batches carry no "
                "prefix length; use mask=causal (a prefix-LM is --family gpt "
                "--model.mask=prefix)")

    def inputs_for(self, config: ModelConfig, tokens_BT):
        return {**super().inputs_for(config, tokens_BT), "encoder_inputs": tokens_BT}


# The keyword inputs ``EncoderDecoder.__call__`` reads from a batch (besides the decoder's
# tokens): the source and its positions and segments, the target's.
ENCDEC_INPUTS = (
    "encoder_inputs", "positions", "segment_ids", "encoder_positions", "encoder_segment_ids",
    "prefix_len",
)

FAMILIES.add("encdec", EncDecFamily(build_encdec, objective="seq2seq", input_keys=ENCDEC_INPUTS,
                                    generates="seq2seq", tasks="encdec", needs_task=True,
                                    cross_attention=True))


def build_lstm(config: ModelConfig) -> nn.Module:
    from transformers_jax.models.lstm import LSTMLM

    return LSTMLM(config)


class LSTMFamily(Family):
    def forward_flops(self, config: ModelConfig, seq_len: int, causal_half: bool = False
                      ) -> float:
        # no attention, so both conventions agree: four gates, each an input and a recurrent
        # matmul, per layer; then the output head
        return 2.0 * (config.n_layers * 8 * config.d_model**2 + config.d_model * config.vocab_size)


# The recurrent baseline of the context-usage experiment.
# It reads the tokens alone: positions, segments and masks are for attention.
FAMILIES.add("lstm", LSTMFamily(build_lstm, objective="lm", input_keys=(), recurrent=True,
                                switches=()))
