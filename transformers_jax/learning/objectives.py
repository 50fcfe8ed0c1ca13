"""Training objectives: a loss function, and how it builds and starts its model.

Shape legend: B batch, T (decoder/model) length, S encoder length, V vocabulary, L labels.

An objective is a loss function ``(model, params, batch, rng, deterministic) -> (loss, metrics)``
registered in ``OBJECTIVES`` by name. Which batch keys the model reads is its family's to say
(``Family.input_keys``, declared beside the module in ``models/``): a loss applies the model
through ``apply_model``, which takes them from the model's family, and ``objective_for`` and
``run_objective`` give the objective bound to a family (``input_keys`` set) for the code that
shapes or shards the inputs. Each family names its default (``gpt`` -> ``lm``, ``bert`` ->
``mlm``, ``encdec`` -> ``seq2seq``). ``learning/step.py``'s ``init_state``, ``make_train_step``
and ``make_eval_step`` take any of them (``objective=``; default ``lm``). An objective with a
``head`` (``sequence_classification``) fine-tunes that classification head on a masked-LM
encoder: ``tjax train --train.objective=NAME`` builds it, reads labelled data and starts it
from a masked-LM run's encoder (``run_objective`` picks and checks a run's objective; loading a
run, ``runs/load.py``, does the same).

The losses on logits are in ``learning/losses.py``; the batches that feed these objectives are
built in ``data/`` (``data/mlm_batches.py`` masked-LM, ``data/seq2seq.py`` encoder-decoder and
prefix-LM pairs, ``data/classification.py`` and ``data/labelled.py`` classification); held-out
evaluation, greedy exact match included, is ``evaluation.py``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax

from transformers_jax.learning.losses import classification_loss, sequence_accuracy, token_metrics
from transformers_jax.models import build_model, family_of
from transformers_jax.models.heads import build_classifier, init_from_mlm
from transformers_jax.registry import FAMILIES, ConfigError, Registry

LossFn = Callable[[nn.Module, Any, dict, "jax.Array | None", bool], tuple[jax.Array, dict]]

# Model inputs --------------------------------------------------------------------------------


def model_inputs(batch: dict, keys: Sequence[str]) -> dict:
    """The keyword inputs among ``keys`` that the batch carries (absent or None: left out)."""
    return {k: batch[k] for k in keys if batch.get(k) is not None}


def input_keys_of(model: nn.Module) -> tuple[str, ...]:
    """The keyword inputs ``model`` reads from a batch: its family's (``Family.input_keys``;
    a classification head reads its encoder family's)."""
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no config: pass the input keys it reads "
                        "to apply_model")
    return family_of(config).input_keys


def apply_model(model: nn.Module, params, batch: dict, keys: Sequence[str] | None = None,
                rng=None, deterministic: bool = True) -> jax.Array:
    """``model.apply`` on ``batch["inputs"]`` and the batch's optional inputs among ``keys``
    (None: those the model's family reads); dropout only when not deterministic (then ``rng``
    is required)."""
    keys = input_keys_of(model) if keys is None else keys
    rngs = None if deterministic or rng is None else {"dropout": rng}
    return model.apply({"params": params}, batch["inputs"], **model_inputs(batch, keys),
                       deterministic=deterministic, rngs=rngs)


# Objectives ----------------------------------------------------------------------------------


def lm_objective(model, params, batch, rng=None, deterministic=True):
    """Next-token cross-entropy (decoder-only; prefix-LM skips the prefix through weights)."""
    logits = apply_model(model, params, batch, None, rng, deterministic)
    return token_metrics(logits, batch["targets"], batch.get("weights"))


def mlm_objective(model, params, batch, rng=None, deterministic=True):
    """Masked-LM cross-entropy and accuracy on the chosen positions only (``weights``)."""
    logits = apply_model(model, params, batch, None, rng, deterministic)
    return token_metrics(logits, batch["targets"], batch["weights"])


def seq2seq_objective(model, params, batch, rng=None, deterministic=True):
    """Teacher-forced target cross-entropy; ``sequence_accuracy`` is the share of rows whose
    every target token is the argmax, which equals greedy exact match (each greedy step then
    sees exactly the teacher-forced prefix)."""
    logits = apply_model(model, params, batch, None, rng, deterministic)
    loss, metrics = token_metrics(logits, batch["targets"], batch["weights"])
    metrics["sequence_accuracy"] = sequence_accuracy(logits, batch["targets"], batch["weights"])
    return loss, metrics


def sequence_classification_objective(model, params, batch, rng=None, deterministic=True):
    """Cross-entropy of ``[B, L]`` logits against integer ``labels [B]``."""
    logits_BL = apply_model(model, params, batch, None, rng, deterministic)
    labels_B = batch["labels"]
    loss, accuracy = classification_loss(logits_BL, labels_B)
    return loss, {"loss": loss, "accuracy": accuracy}


def token_classification_objective(model, params, batch, rng=None, deterministic=True):
    """Per-token cross-entropy of ``[B, T, L]`` logits against ``targets``, ``weights``."""
    logits = apply_model(model, params, batch, None, rng, deterministic)
    return token_metrics(logits, batch["targets"], batch.get("weights"))


@dataclass(frozen=True)
class Objective:
    """A loss function, and how the model it trains is built and started.

    ``input_keys``: the model's keyword inputs from a batch, set when the objective is bound
    to a family (``for_family``; ``objective_for`` and ``run_objective`` bind it). Left None
    (a registry entry as it is), ``inputs`` picks any family's inputs the batch carries and
    ``init_params`` asks the model; the loss always applies the model with its family's."""

    name: str
    loss: LossFn
    input_keys: tuple[str, ...] | None = None
    per_position: bool = False  # its loss is a mean over sequence positions (loss by position)
    # metrics that are means over rows (not tokens): pieces of a batch (devices,
    # micro-batches, row groups) add them weighted by their rows (learning.step.weighted_sums)
    row_metrics: tuple[str, ...] = ()
    # a models.heads HEADS entry: the objective fine-tunes that head on a masked-LM family's
    # encoder, on labelled examples (tjax train --train.objective=NAME --data PATH.jsonl)
    head: str | None = None
    # its targets are later tokens of its own input: a mask that shows them leaks the answer
    predicts_its_input: bool = False

    def for_family(self, family) -> Objective:
        """This objective with ``family``'s model inputs (a ``models.Family``)."""
        return dataclasses.replace(self, input_keys=family.input_keys)

    def inputs(self, batch: dict) -> dict:
        """The keyword inputs of the model among ``batch``'s keys."""
        keys = self.input_keys
        if keys is None:  # unbound: whichever family's inputs the batch carries
            keys = tuple(dict.fromkeys(k for name in FAMILIES.names()
                                       for k in FAMILIES.get(name).input_keys))
        return model_inputs(batch, keys)

    def check(self, config) -> None:
        """Refuse a model config this objective cannot train from the command line."""
        family = FAMILIES.get(config.family)
        heads = OBJECTIVES.names_where(lambda o: o.head is not None)
        if self.head is not None and not family.masked_lm:
            raise ConfigError(f"train.objective={self.name}: the classification heads sit on "
                              f"a masked-LM encoder, not family={config.family}; use "
                              "--family bert or --train.init_from a bert run")
        if self.head is None and family.objective != self.name:
            raise ConfigError(f"train.objective={self.name}: family={config.family} trains "
                              f"{family.objective!r}, or fine-tunes with {', '.join(heads)}")
        if self.predicts_its_input and not config.mask.decodes and not family.recurrent:
            raise ConfigError(
                f"model.mask={config.mask.name}: family={config.family} learns to predict the "
                f"next token ({self.name}), and this mask shows every position the token it "
                "predicts, so the loss falls without learning; use a mask that decodes "
                "(causal, sliding_window or prefix), or --family bert for a masked LM")

    def build(self, config, num_labels: int | None = None) -> nn.Module:
        """The model this objective trains: the family's own, or its ``head`` on the encoder."""
        if self.head is None:
            return build_model(config)
        return build_classifier(config, num_labels, self.head)

    def start_from(self, model: nn.Module, params: Any, source_params: Any, rng: jax.Array,
                   example: dict) -> Any:
        """``model``'s params (fresh: ``params``) taken from another run's ``source_params``: a
        head's encoder from a masked-LM run (``init_from_mlm``; the head starts afresh from
        ``rng``), otherwise the whole tree, which must have the shapes and dtypes of
        ``params``. A misfit is a ``ValueError``."""
        if self.head is not None:
            return init_from_mlm(model, source_params, rng, example["inputs"])
        want, have = (jax.tree.map(lambda x: (x.shape, str(x.dtype)), t)
                      for t in (params, source_params))
        if jax.tree.structure(want) != jax.tree.structure(have) or want != have:
            raise ValueError("its parameters do not have the shapes this model needs")
        return source_params

    def init_params(self, model: nn.Module, rng: jax.Array, batch: dict) -> Any:
        """Fresh (unboxed) parameters for ``model``, shaped by an example batch."""
        keys = input_keys_of(model) if self.input_keys is None else self.input_keys
        variables = model.init(rng, batch["inputs"], **model_inputs(batch, keys))
        return nn.meta.unbox(variables["params"])


OBJECTIVES: Registry[Objective] = Registry("objective")
for _objective in (
    Objective("lm", lm_objective, per_position=True, predicts_its_input=True),
    Objective("mlm", mlm_objective),
    Objective("seq2seq", seq2seq_objective, row_metrics=("sequence_accuracy",)),
    Objective("sequence_classification", sequence_classification_objective, head="sequence"),
    Objective("token_classification", token_classification_objective),
):
    OBJECTIVES.add(_objective.name, _objective)


def objective_for(family: str) -> Objective:
    """The default objective of a model family (its registry entry names it), bound to it."""
    entry = FAMILIES.get(family)
    return OBJECTIVES.get(entry.objective).for_family(entry)


def run_objective(config, name: str | None = None) -> Objective:
    """The objective of a run (``train.objective``; None: the family's own), checked against
    the model config and bound to its family (a head reads its encoder's inputs)."""
    if name is None:
        return objective_for(config.family)
    objective = OBJECTIVES.get(name)
    objective.check(config)
    return objective.for_family(family_of(config))
