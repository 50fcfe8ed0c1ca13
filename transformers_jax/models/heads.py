"""Fine-tuning heads on the BERT encoder: sequence and token classification.

Shape legend: B batch, T length, C model width, L labels.

Both classifiers own a ``BertEncoder`` under the same name, ``encoder``, as the masked-LM model
does, so a pre-trained encoder moves over unchanged: ``init_from_mlm`` initialises the head and
copies ``mlm_params["encoder"]`` in (the masked-LM head is dropped).

- ``SequenceClassifier``: the hidden state of the first token (``[CLS]``) -> pooler (dense +
  tanh, BERT's) -> dropout -> classifier, ``[B, L]`` logits.
- ``TokenClassifier``: every hidden state -> dropout -> classifier, ``[B, T, L]`` logits.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.config import ModelConfig
from transformers_jax.models.bert import BertEncoder
from transformers_jax.nn.layers import Dense, dtype_of
from transformers_jax.registry import Registry


def _dense(cfg: ModelConfig, features: int, axes: tuple, name: str) -> Dense:
    return Dense(
        (features,),
        axes,
        use_bias=True,
        std=cfg.init_std,
        dtype=dtype_of(cfg.dtype),
        param_dtype=dtype_of(cfg.param_dtype),
        name=name,
    )


class Pooler(nn.Module):
    """BERT's pooler: ``tanh(dense(h[:, 0]))``, ``[B, T, C] -> [B, C]``.

    Rows are one example each, starting with ``[CLS]`` (a packed row would need the first token
    of every segment instead).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, h_BTC: jax.Array) -> jax.Array:
        cfg = self.config
        return jnp.tanh(_dense(cfg, cfg.d_model, ("embed", "mlp"), "dense")(h_BTC[:, 0]))


class EncoderClassifier(nn.Module):
    """What every classifier shares: ``BertEncoder`` under the masked-LM model's name
    (``encoder``, so that ``init_from_mlm`` can copy a pre-trained one in), then ``classify``
    on its hidden states; float32 logits.

    ``apply`` takes ``deterministic`` and the encoder's other keywords (``token_types``,
    ``positions``, ``segment_ids``, ``prefix_len``), passed on as they are.
    """

    config: ModelConfig
    num_labels: int

    @nn.compact
    def __call__(self, tokens_BT: jax.Array, *, deterministic: bool = True,
                 **inputs) -> jax.Array:
        h_BTC = BertEncoder(self.config, name="encoder")(
            tokens_BT, deterministic=deterministic, **inputs
        )
        return self.classify(h_BTC, deterministic).astype(jnp.float32)

    @nn.nowrap
    def classify(self, h_BTC: jax.Array, deterministic: bool) -> jax.Array:
        """Logits from the hidden states ``[B, T, C]``. It runs inside the compact ``__call__``,
        so it may create submodules; overrides keep ``@nn.nowrap`` (Flax would otherwise wrap
        the method, which would record its output as an intermediate of its own)."""
        raise NotImplementedError


class SequenceClassifier(EncoderClassifier):
    """``tokens [B, T] -> logits [B, num_labels]`` (float32) from the pooled ``[CLS]`` state."""

    @nn.nowrap
    def classify(self, h_BTC: jax.Array, deterministic: bool) -> jax.Array:
        cfg = self.config
        pooled_BC = Pooler(cfg, name="pooler")(h_BTC)
        pooled_BC = nn.Dropout(cfg.dropout)(pooled_BC, deterministic=deterministic)
        return _dense(cfg, self.num_labels, ("embed", None), "classifier")(pooled_BC)


class TokenClassifier(EncoderClassifier):
    """``tokens [B, T] -> logits [B, T, num_labels]`` (float32), one label per token."""

    @nn.nowrap
    def classify(self, h_BTC: jax.Array, deterministic: bool) -> jax.Array:
        cfg = self.config
        h_BTC = nn.Dropout(cfg.dropout)(h_BTC, deterministic=deterministic)
        return _dense(cfg, self.num_labels, ("embed", None), "classifier")(h_BTC)


HEADS: Registry[type[nn.Module]] = Registry("classification head")
HEADS.add("sequence", SequenceClassifier)
HEADS.add("token", TokenClassifier)


def build_classifier(config: ModelConfig, num_labels: int, kind: str = "sequence") -> nn.Module:
    """A classifier on the BERT encoder: ``kind`` is ``sequence`` or ``token``."""
    if num_labels < 1:
        raise ValueError(f"num_labels={num_labels}: must be at least 1")
    return HEADS.get(kind)(config, num_labels)


def _mismatches(expected: Any, given: Any) -> list[str]:
    """Paths where two params trees differ in structure or shape (empty when they agree)."""
    flat_e = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    flat_g = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(given)}
    problems = [f"{p}: missing from the masked-LM encoder" for p in flat_e if p not in flat_g]
    problems += [f"{p}: not in the classifier's encoder" for p in flat_g if p not in flat_e]
    problems += [
        f"{p}: shape {tuple(flat_g[p].shape)} in the masked-LM encoder, "
        f"{tuple(flat_e[p].shape)} in the classifier"
        for p in flat_e
        if p in flat_g and tuple(flat_e[p].shape) != tuple(flat_g[p].shape)
    ]
    return problems


def init_from_mlm(
    classifier: nn.Module,
    mlm_params: Any,
    rng: jax.Array,
    example_tokens: jax.Array,
) -> Any:
    """Initialised classifier params with the pre-trained encoder of ``mlm_params`` copied in.

    ``mlm_params`` is the (unboxed) params tree of a ``BERT`` masked-LM model built from the
    same config; its ``mlm_head`` is dropped and the classifier's pooler and classifier keep
    their fresh initialisation from ``rng``. The encoder arrays are copied, so a training loop
    that donates its state buffers cannot invalidate ``mlm_params``. A structure or shape
    mismatch (another config) is an error that lists the differing paths.
    """
    if "encoder" not in mlm_params:
        raise ValueError(f"mlm_params has no 'encoder' subtree (keys: {sorted(mlm_params)}); "
                         "pass the params of a BERT masked-LM model")
    params = nn.meta.unbox(classifier.init(rng, example_tokens)["params"])
    problems = _mismatches(params["encoder"], mlm_params["encoder"])
    if problems:
        raise ValueError("the masked-LM encoder does not fit the classifier (built from another "
                         "config?): " + "; ".join(problems[:5]))
    return {**params, "encoder": jax.tree.map(jnp.copy, mlm_params["encoder"])}
