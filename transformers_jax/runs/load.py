"""Restore a run in one call: ``model, params, tokenizer, config = load_run(RUN_DIR)``.

Any run directory loads the same way: trained here (any family), fine-tuned with a
classification head, or converted from Hugging Face (any tokenizer, or none). The model is the
one the run's objective trained (``TrainConfig.objective``; a run saved before that field
trained its family's own): a classifier's is its head on the encoder, as wide as the class
names in ``RUN_DIR/labels.json``. ``open_run`` returns the whole ``Run``: the configs, the
objective, the labels and the meta beside the model and params.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax

from transformers_jax.config import ModelConfig, TrainConfig, from_dict
from transformers_jax.data.tokenizers import Tokenizer
from transformers_jax.learning import lora
from transformers_jax.learning.objectives import Objective, run_objective
from transformers_jax.learning.optim import make_optimizer
from transformers_jax.learning.step import TrainState, init_state
from transformers_jax.models import family_of
from transformers_jax.runs.checkpoint import Checkpointer, abstract_like
from transformers_jax.runs.labels import read_labels
from transformers_jax.runs.layout import LABELS_FILE
from transformers_jax.runs.tokenizer import run_tokenizer


@dataclasses.dataclass(frozen=True)
class Run:
    """A restored run (``open_run``)."""

    directory: str
    step: int
    meta: dict  # the checkpoint's (runs/meta.py)
    config: ModelConfig
    train_config: TrainConfig
    objective: Objective  # what the run trained, bound to its family
    labels: tuple[str, ...] | None  # a classifier's class names (id = position)
    model: nn.Module
    params: Any
    tokenizer: Tokenizer | None  # None: converted with a tokenizer of elsewhere (ids only)

    @property
    def classifier(self) -> bool:
        """The model is a classification head (class logits, not tokens)."""
        return self.objective.head is not None

    def refuse_classifier(self, command: str) -> None:
        """Raise ``ValueError`` for a classifier run, which ``command`` (a generating or
        mask-filling one) cannot use."""
        if self.classifier:
            raise ValueError(
                f"{self.directory} holds a {self.objective.name} classifier "
                f"({len(self.labels or ())} labels: {', '.join(self.labels or ())}): a "
                f"classifier does not generate; {command} needs a language model. Use tjax "
                f"eval --run {self.directory} for its held-out loss and accuracy")


def state_target(config: ModelConfig, train_cfg: TrainConfig, objective: Objective,
                 num_labels: int | None = None) -> tuple[nn.Module, TrainState]:
    """``(model, abstract TrainState)``: the model ``objective`` trains and the shapes, dtypes
    and tree of the state a checkpoint of it holds (nothing allocated)."""
    model = lora.wrap(objective.build(config, num_labels), train_cfg.lora)
    tokens, inputs = family_of(config).example_inputs(config, min(8, config.max_len))
    example = {"inputs": tokens, **inputs}
    optimizer = make_optimizer(train_cfg)
    target = jax.eval_shape(lambda: init_state(model, optimizer, train_cfg.seed, example,
                                               objective))
    if train_cfg.lora.enabled:  # a LoRA checkpoint holds the adapters, not the base
        target = lora.adapter_state(target)
    return model, target


def _labels_of(run_dir: str, objective: Objective) -> tuple[str, ...] | None:
    if objective.head is None:
        return None
    labels = read_labels(run_dir)
    if labels is None:
        raise FileNotFoundError(
            f"{run_dir} holds a {objective.name} classifier but not its class names "
            f"({LABELS_FILE}); copy the whole run directory, not only its checkpoints")
    return labels


def open_run(run_dir: str, step: int | None = None, shardings: Any | None = None) -> Run:
    """Restore checkpoint ``step`` of ``run_dir``, or the newest intact one (a damaged newer
    one is skipped with a warning on stderr; a damaged step asked for is refused, naming the
    intact ones).

    ``shardings`` restores straight onto devices (any count: a checkpoint does not remember
    the devices it came from): one ``jax.sharding.Sharding`` for every array, a function from
    each array's ``jax.ShapeDtypeStruct`` to its sharding, or a pytree matching the train state.
    """
    ckpt = Checkpointer(run_dir, create=False)
    try:
        step = ckpt.pick(step)
        meta = ckpt.read_meta(step)
        config = from_dict(ModelConfig, meta["model"])
        train_cfg = from_dict(TrainConfig, meta["train"])
        objective = run_objective(config, train_cfg.objective)
        labels = _labels_of(run_dir, objective)
        model, target = state_target(config, train_cfg, objective, labels and len(labels))
        if isinstance(shardings, jax.sharding.Sharding):
            shardings = jax.tree.map(lambda _, s=shardings: s, target)
        elif callable(shardings):
            shardings = jax.tree.map(shardings, target)
        state, _ = ckpt.restore(abstract_like(target, shardings), step)
    finally:
        ckpt.close()
    params = state.params
    if train_cfg.lora.enabled:  # LoRA: the base run's params with these adapters folded in
        base = lora_base_params(run_dir, meta)
        params = model.merged({lora.BASE: base, lora.LORA: params[lora.LORA]})
        model = model.plain()
    return Run(run_dir, step, meta, config, train_cfg, objective, labels, model, params,
               run_tokenizer(run_dir, meta["tokenizer"]))


def lora_base_params(run_dir: str, meta: dict) -> Any:
    """The params of the base checkpoint a LoRA run's ``meta["lora_base"]`` names."""
    reference = meta.get("lora_base") or {}
    if not reference.get("run"):
        raise ValueError(f"{run_dir} is a LoRA run whose checkpoint names no base run")
    try:
        return open_run(reference["run"], reference["step"]).params
    except (FileNotFoundError, ValueError) as err:
        raise FileNotFoundError(
            f"{run_dir} holds LoRA adapters of {reference['run']} step {reference['step']}, "
            f"which cannot be read ({err}); its adapters need that checkpoint: restore it, or "
            "merge the adapters where it is (tjax merge)") from None


def load_run(run_dir: str, step: int | None = None, shardings: Any | None = None):
    """``(model, params, tokenizer, config)`` of checkpoint ``step`` (default: the newest
    intact one); see ``open_run`` for ``shardings``. ``tokenizer`` is None for a run converted
    with a tokenizer this project cannot load (generate from token ids)."""
    run = open_run(run_dir, step, shardings)
    return run.model, run.params, run.tokenizer, run.config
