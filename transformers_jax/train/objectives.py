"""Training objectives per model family: a loss function and the batch keys its model reads.

Shape legend: B batch, T (decoder/model) length, S encoder length, V vocabulary, L labels.

An objective is a loss function ``(model, params, batch, rng, deterministic) -> (loss, metrics)``
plus the batch keys its model reads. ``OBJECTIVES`` maps names to them and
``FAMILY_OBJECTIVES`` gives each family its default (``gpt`` -> ``lm``, ``bert`` -> ``mlm``,
``encdec`` -> ``seq2seq``). ``train/step.py``'s ``init_state``, ``make_train_step`` and
``make_eval_step`` take any of them (``objective=``; default ``lm``).

The losses on logits are in ``train/losses.py``; the batches that feed these objectives are
built in ``data/`` (``data/mlm_batches.py`` masked-LM, ``data/seq2seq.py`` encoder-decoder and
prefix-LM pairs, ``data/classification.py`` tfds classification); greedy-decoding evaluation is
in ``train/evaluate.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax

from transformers_jax.registry import FAMILIES, Registry
from transformers_jax.train.losses import classification_loss, sequence_accuracy, token_metrics

LossFn = Callable[[nn.Module, Any, dict, "jax.Array | None", bool], tuple[jax.Array, dict]]

# Model inputs --------------------------------------------------------------------------------

GPT_INPUTS = ("positions", "segment_ids", "prefix_len")
BERT_INPUTS = ("token_types", "positions", "segment_ids", "prefix_len")
ENCDEC_INPUTS = (
    "encoder_inputs", "positions", "segment_ids", "encoder_positions", "encoder_segment_ids",
    "prefix_len",
)


def model_inputs(batch: dict, keys: Sequence[str]) -> dict:
    """The keyword inputs among ``keys`` that the batch carries (absent or None: left out)."""
    return {k: batch[k] for k in keys if batch.get(k) is not None}


def apply_model(model: nn.Module, params, batch: dict, keys: Sequence[str], rng=None,
                deterministic: bool = True) -> jax.Array:
    """``model.apply`` on ``batch["inputs"]`` and the batch's optional inputs among ``keys``;
    dropout only when not deterministic (then ``rng`` is required)."""
    rngs = None if deterministic or rng is None else {"dropout": rng}
    return model.apply({"params": params}, batch["inputs"], **model_inputs(batch, keys),
                       deterministic=deterministic, rngs=rngs)


# Objectives ----------------------------------------------------------------------------------


def lm_objective(model, params, batch, rng=None, deterministic=True):
    """Next-token cross-entropy (decoder-only; prefix-LM skips the prefix through weights)."""
    logits = apply_model(model, params, batch, GPT_INPUTS, rng, deterministic)
    return token_metrics(logits, batch["targets"], batch.get("weights"))


def mlm_objective(model, params, batch, rng=None, deterministic=True):
    """Masked-LM cross-entropy and accuracy on the chosen positions only (``weights``)."""
    logits = apply_model(model, params, batch, BERT_INPUTS, rng, deterministic)
    return token_metrics(logits, batch["targets"], batch["weights"])


def seq2seq_objective(model, params, batch, rng=None, deterministic=True):
    """Teacher-forced target cross-entropy; ``sequence_accuracy`` is the share of rows whose
    every target token is the argmax, which equals greedy exact match (each greedy step then
    sees exactly the teacher-forced prefix)."""
    logits = apply_model(model, params, batch, ENCDEC_INPUTS, rng, deterministic)
    loss, metrics = token_metrics(logits, batch["targets"], batch["weights"])
    metrics["sequence_accuracy"] = sequence_accuracy(logits, batch["targets"], batch["weights"])
    return loss, metrics


def sequence_classification_objective(model, params, batch, rng=None, deterministic=True):
    """Cross-entropy of ``[B, L]`` logits against integer ``labels [B]``."""
    logits_BL = apply_model(model, params, batch, BERT_INPUTS, rng, deterministic)
    labels_B = batch["labels"]
    loss, accuracy = classification_loss(logits_BL, labels_B)
    return loss, {"loss": loss, "accuracy": accuracy}


def token_classification_objective(model, params, batch, rng=None, deterministic=True):
    """Per-token cross-entropy of ``[B, T, L]`` logits against ``targets``, ``weights``."""
    logits = apply_model(model, params, batch, BERT_INPUTS, rng, deterministic)
    return token_metrics(logits, batch["targets"], batch.get("weights"))


@dataclass(frozen=True)
class Objective:
    """A loss function and the model inputs it reads from a batch."""

    name: str
    loss: LossFn
    input_keys: tuple[str, ...]
    per_position: bool = False  # its loss is a mean over sequence positions (loss by position)
    # metrics that are means over rows (not tokens): pieces of a batch (devices,
    # micro-batches, row groups) add them weighted by their rows (train.step.weighted_sums)
    row_metrics: tuple[str, ...] = ()

    def inputs(self, batch: dict) -> dict:
        return model_inputs(batch, self.input_keys)

    def init_params(self, model: nn.Module, rng: jax.Array, batch: dict) -> Any:
        """Fresh (unboxed) parameters for ``model``, shaped by an example batch."""
        variables = model.init(rng, batch["inputs"], **self.inputs(batch))
        return nn.meta.unbox(variables["params"])


OBJECTIVES: Registry[Objective] = Registry("objective")
for _objective in (
    Objective("lm", lm_objective, GPT_INPUTS, per_position=True),
    Objective("mlm", mlm_objective, BERT_INPUTS),
    Objective("seq2seq", seq2seq_objective, ENCDEC_INPUTS, row_metrics=("sequence_accuracy",)),
    Objective("sequence_classification", sequence_classification_objective, BERT_INPUTS),
    Objective("token_classification", token_classification_objective, BERT_INPUTS),
):
    OBJECTIVES.add(_objective.name, _objective)


def objective_for(family: str) -> Objective:
    """The default objective of a model family (its registry entry names it)."""
    return OBJECTIVES.get(FAMILIES.get(family).objective)
