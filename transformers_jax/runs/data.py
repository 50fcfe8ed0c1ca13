"""The data of a training run: tokenizer, a resumable training iterator and fixed eval batches.

Text (the default corpus, files, ``tfds:NAME``) goes through the Grain pipeline of
``data/pipeline.py`` (packed documents, per-host shards); ``--task NAME`` trains on a synthetic
task instead, and a classification objective on labelled examples. The training iterator's
state is saved in every checkpoint, so a resumed run sees exactly the batches the
uninterrupted one would have. It sits with the run directory's modules because what it
reads is part of a run's record (``meta.py`` compares ``DATA_FIELDS`` on resume, evaluation
rebuilds the eval batches), but it reads no run directory itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from transformers_jax.config import ModelConfig, TrainConfig
from transformers_jax.data import labelled
from transformers_jax.data.mixture import describe as describe_mixture
from transformers_jax.data.mixture import is_mixture, parse_mixture
from transformers_jax.data.mlm import MaskingConfig
from transformers_jax.data.mlm_batches import MaskedBatches, mask_eval_batches
from transformers_jax.data.pipeline import (
    make_lm_eval_iterator,
    make_lm_iterator,
    make_task_iterator,
    take,
)
from transformers_jax.data.prefix_lm import PrefixBatches, eval_prefix_batches
from transformers_jax.data.synthetic import FORMATS, longest_fitting_length
from transformers_jax.data.tokenizers import Tokenizer, require_special
from transformers_jax.models import family_of

# The TrainConfig fields that choose what the run reads: a resume that changes one reads other
# data (refused unless train.accept_data_change).
DATA_FIELDS = ("data", "data_dir", "text_key", "tokenizer", "tokenizer_vocab", "pack", "task",
               "train_lengths", "val_fraction", "bos_per_row", "shuffle_rows", "label_key",
               "data_download")


@dataclass
class RunData:
    tokenizer: Tokenizer
    train: Any  # a Grain DatasetIterator of batches (get_state / set_state)
    eval_batches: list[dict]
    description: str
    fingerprint: str | None = None  # of the data's contents (see data_fingerprint)
    labels: tuple[str, ...] | None = None  # class names of labelled data (id = position)


def data_fingerprint(cfg: TrainConfig) -> str:
    """What the run reads, by content: the hash of the local text (files or the default corpus,
    the key its prepared tfds copy is stored under) or of local columnar files, a tfds catalog
    dataset's name and prepared version, a hub dataset's spec (a stream has no version to
    read offline), each part of a mixture with its weight, or the synthetic task (generated
    from the spec and seed)."""
    if cfg.task:
        return f"task:{cfg.task}"
    if cfg.data and is_mixture(cfg.data):
        return " + ".join(f"{part.weight:g}*[{source_fingerprint(part.spec, cfg)}]"
                          for part in parse_mixture(cfg.data))
    return source_fingerprint(cfg.data, cfg)


def source_fingerprint(spec: str | None, cfg: TrainConfig) -> str:
    """``data_fingerprint`` of one source."""
    from transformers_jax.data.columnar import file_key
    from transformers_jax.data.local_text import prepare_local_text
    from transformers_jax.data.sources import parse_spec, tfds_builder

    parsed = parse_spec(spec)
    if parsed.kind == "tfds":
        return f"tfds:{parsed.name} version {tfds_builder(parsed.name, cfg.data_dir).info.version}"
    if parsed.kind == "hf":
        return f"hf:{parsed.name}" + (" downloaded" if cfg.data_download else " streamed")
    if parsed.kind == "columnar":
        return "columnar:" + file_key(parsed.files)
    return "local-text:" + prepare_local_text(parsed.name, parsed.unit, cfg.data_dir).key


def data_name(cfg: TrainConfig) -> str:
    """How the run README names its text: the spec, a mixture with its proportions."""
    if cfg.data and is_mixture(cfg.data):
        return describe_mixture(parse_mixture(cfg.data))
    name = cfg.data or "the default corpus (Python's pydoc topics)"
    if cfg.data and cfg.data.startswith("hf:"):
        name += " (downloaded)" if cfg.data_download else " (streamed)"
    return name


def masking_of(cfg: TrainConfig) -> MaskingConfig:
    return MaskingConfig(rate=cfg.mlm_rate, mask_fraction=cfg.mlm_mask_fraction,
                         random_fraction=cfg.mlm_random_fraction)


_DEFAULT_TASK_LENGTHS = next(f.default for f in dataclasses.fields(TrainConfig)
                             if f.name == "train_lengths")


def task_lengths(model_cfg: ModelConfig, cfg: TrainConfig) -> tuple[int, int]:
    """The task lengths a run trains on: ``train.train_lengths``, except that the default
    range ends at the longest length whose rows fit ``seq_len`` (20 passkey filler words take
    140 tokens), so ``--task NAME`` works as it is for every task. Lengths asked for are kept:
    the pipeline refuses them with the fix if they cannot fit."""
    if tuple(cfg.train_lengths) != _DEFAULT_TASK_LENGTHS:
        return tuple(cfg.train_lengths)
    longest = longest_fitting_length(cfg.task, family_of(model_cfg).tasks, cfg.train_lengths,
                                     cfg.seq_len)
    return (cfg.train_lengths[0], longest or cfg.train_lengths[1])


def make_eval_batches(model_cfg: ModelConfig, cfg: TrainConfig, tokenizer: Tokenizer,
                      split: str | None = None) -> list[dict]:
    """The run's fixed held-out batches (``cfg.eval_batches`` of them, ``cfg.seq_len`` long):
    what the training loop evaluates on, and ``tjax eval`` by default. ``split``: another
    split of a tfds dataset to read instead of the held-out one (text data only)."""
    family = family_of(model_cfg)
    max_len = model_cfg.position.max_length(model_cfg)
    prefix = model_cfg.mask.needs_prefix_len
    if cfg.task:
        if split is not None:
            raise ValueError(f"split={split!r}: a synthetic task (task={cfg.task}) has only "
                             "its held-out examples; drop the split")
        fmt = family.tasks
        # held-out examples at the training lengths (the test split has its own seed stream)
        lengths = task_lengths(model_cfg, cfg)
        held_out = make_task_iterator(cfg.task, tokenizer, cfg.seq_len, cfg.batch_size,
                                      cfg.seed, split="test", test_lengths=lengths,
                                      num_epochs=None, train_lengths=lengths, fmt=fmt,
                                      prefix=prefix and FORMATS[fmt].takes_prefix, max_len=max_len)
        return take(held_out, cfg.eval_batches)
    held_out = make_lm_eval_iterator(cfg.data, tokenizer, cfg.seq_len, cfg.batch_size,
                                     pack=cfg.pack, bos_per_row=cfg.bos_per_row,
                                     num_epochs=None, data_dir=cfg.data_dir,
                                     text_key=cfg.text_key, val_fraction=cfg.val_fraction,
                                     download=cfg.data_download, max_len=max_len,
                                     **({"split": split} if split else {}))
    eval_batches = take(held_out, cfg.eval_batches)
    if family.masked_lm:
        require_special(tokenizer, "mask", f"family={model_cfg.family} (a masked LM)")
        return mask_eval_batches(eval_batches, cfg.seed, tokenizer, masking_of(cfg))
    if prefix:
        return eval_prefix_batches(eval_batches, cfg.seed)
    return eval_batches


def make_run_data(model_cfg: ModelConfig, cfg: TrainConfig, tokenizer: Tokenizer,
                  objective=None, labels: Sequence[str] | None = None) -> RunData:
    """The run's data: text, a synthetic task, or (an objective with a classification
    ``head``) labelled examples, whose class names are ``labels`` when given (a resumed run's)."""
    if objective is not None and objective.head is not None:
        return labelled_run_data(cfg, tokenizer, labels)
    family = family_of(model_cfg)
    max_len = model_cfg.position.max_length(model_cfg)
    prefix = model_cfg.mask.needs_prefix_len
    if family.needs_task and not cfg.task:
        raise ValueError(f"family={model_cfg.family} trains on a sequence-to-sequence task: "
                         "pass --task reverse (or copy, sort, addition, ...)")
    if family.tasks is None and cfg.task:
        raise ValueError(f"family={model_cfg.family} trains on text: drop --task (tasks are "
                         "for the families that generate)")
    if cfg.task:
        fmt = family.tasks
        lengths = task_lengths(model_cfg, cfg)
        common = dict(train_lengths=lengths, fmt=fmt, max_len=max_len,
                      prefix=prefix and FORMATS[fmt].takes_prefix)
        train = make_task_iterator(cfg.task, tokenizer, cfg.seq_len, cfg.batch_size, cfg.seed,
                                   split="train", test_lengths=cfg.test_lengths, **common)
        return RunData(tokenizer, train, make_eval_batches(model_cfg, cfg, tokenizer),
                       f"task {cfg.task} (lengths {lengths[0]}-{lengths[1]}"
                       + (f", the most that fit seq_len={cfg.seq_len}"
                          if lengths != tuple(cfg.train_lengths) else "") + ")",
                       data_fingerprint(cfg))
    if family.masked_lm:  # before reading any text
        require_special(tokenizer, "mask", f"family={model_cfg.family} (a masked LM)")
    common = dict(data_dir=cfg.data_dir, text_key=cfg.text_key, val_fraction=cfg.val_fraction,
                  download=cfg.data_download, max_len=max_len)
    train = make_lm_iterator(cfg.data, tokenizer, cfg.seq_len, cfg.batch_size, seed=cfg.seed,
                             pack=cfg.pack, bos_per_row=cfg.bos_per_row,
                             shuffle_rows=cfg.shuffle_rows, **common)
    eval_batches = make_eval_batches(model_cfg, cfg, tokenizer)
    if family.masked_lm:  # corrupt 15% of tokens: the masked-LM batches
        train = MaskedBatches(train, cfg.seed, tokenizer, masking_of(cfg))
    elif prefix:
        train = PrefixBatches(train, cfg.seed)
    name = data_name(cfg)
    return RunData(tokenizer, train, eval_batches,
                   f"{name}, {tokenizer.name} tokens (vocab {tokenizer.vocab_size}), "
                   f"pack={cfg.pack}" + (", bos every row" if cfg.bos_per_row else "")
                   + (f", rows shuffled in windows of {cfg.shuffle_rows}"
                      if cfg.shuffle_rows > 1 else ""),
                   data_fingerprint(cfg))


def _labelled(cfg: TrainConfig, labels: Sequence[str] | None):
    """``(source, class names, row count)`` of the labelled file ``cfg.data``."""
    if not cfg.data:
        raise ValueError("classification trains on labelled examples: pass --data PATH.jsonl "
                         '(rows {"text": ..., "label": ...}) or PATH.csv (a text,label header)')
    texts, raw = labelled.read_labelled(cfg.data, cfg.text_key or "text", cfg.label_key)
    names = labelled.label_names(raw, labels)
    index = {name: i for i, name in enumerate(names)}
    source = labelled.as_source(texts, np.array([index[x] for x in raw]), len(names))
    return source, names, len(texts)


def labelled_run_data(cfg: TrainConfig, tokenizer: Tokenizer,
                      labels: Sequence[str] | None = None) -> RunData:
    """Labelled examples from the JSONL/CSV file ``cfg.data`` (columns ``cfg.text_key``,
    default ``text``, and ``cfg.label_key``): seeded training batches and a held-out share
    (``cfg.val_fraction``). ``labels``: the class names to keep (a resumed run's, saved in
    ``RUN_DIR/labels.json``; every label of the data must be among them); None: named from
    the data (``data.labelled.label_names``), returned in ``RunData.labels`` for the run to
    save."""
    source, names, count = _labelled(cfg, labels)
    train_rows, held_rows = labelled.split_rows(count, cfg.val_fraction, cfg.seed)
    train = labelled.LabelledBatches(source, train_rows, cfg.batch_size, cfg.seq_len, cfg.seed,
                                     tokenizer)
    eval_batches = labelled.held_out_batches(source, held_rows, cfg.batch_size, cfg.seq_len,
                                             cfg.eval_batches, tokenizer)
    description = (f"{cfg.data}: {count} labelled examples ({len(held_rows)} held out), "
                   f"{len(names)} classes, {tokenizer.name} tokens")
    return RunData(tokenizer, train, eval_batches, description,
                   labelled.file_fingerprint(cfg.data), tuple(names))


def labelled_eval_batches(cfg: TrainConfig, tokenizer: Tokenizer, labels: Sequence[str],
                          whole: bool = False) -> tuple[list[dict], int]:
    """``(batches, examples)`` to evaluate a classifier on: the held-out rows of ``cfg.data``
    its training evaluated (the same split), or with ``whole`` every row of the file, as at
    most ``cfg.eval_batches`` batches; ``examples``: the distinct rows they hold (the last
    batch is filled by repeating rows)."""
    source, _, count = _labelled(cfg, labels)
    rows = (np.arange(count) if whole
            else labelled.split_rows(count, cfg.val_fraction, cfg.seed)[1])
    batches = labelled.held_out_batches(source, rows, cfg.batch_size, cfg.seq_len,
                                        cfg.eval_batches, tokenizer)
    return batches, min(len(rows), len(batches) * cfg.batch_size)
