"""The data of a training run: tokenizer, a resumable training iterator and fixed eval batches.

Text (the default corpus, files, ``tfds:NAME``) goes through the Grain pipeline of
``data/pipeline.py`` (packed documents, per-host shards); ``--task NAME`` trains on a synthetic
task instead. The training iterator's state is saved in every checkpoint, so a resumed run
sees exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from transformers_jax.config import ModelConfig, TrainConfig
from transformers_jax.data.pipeline import (
    make_lm_eval_iterator,
    make_lm_iterator,
    make_task_iterator,
    make_tokenizer,
    take,
)
from transformers_jax.data.tokenizers import Tokenizer, load_tokenizer

TOKENIZER_DIR = "tokenizer"


@dataclass
class RunData:
    tokenizer: Tokenizer
    train: Any  # a Grain DatasetIterator of batches (get_state / set_state)
    eval_batches: list[dict]
    description: str


def add_random_prefix(batch: dict, rng: np.random.Generator) -> dict:
    """Prefix-LM on text: each row gets a prefix of 1..T/2 tokens (per packed document, since
    positions restart) that is attended bidirectionally and carries no loss."""
    B, T = batch["inputs"].shape
    if "prefix_len" in batch:
        return batch
    prefix_len = rng.integers(1, max(T // 2, 1) + 1, size=B).astype(np.int32)
    positions = batch.get("positions", np.broadcast_to(np.arange(T), (B, T)))
    after = (positions + 1 >= prefix_len[:, None]).astype(np.float32)
    weights = batch.get("weights", np.ones((B, T), np.float32)) * after
    return {**batch, "prefix_len": prefix_len, "weights": weights}


class _WithPrefix:
    """Wraps an iterator to add ``prefix_len``; its RNG is a function of the batch count, so
    the state to resume is the inner iterator's plus that count."""

    def __init__(self, inner, seed: int):
        self.inner, self.seed, self.count = inner, seed, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.inner)
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.count])
        self.count += 1
        return add_random_prefix(batch, rng)

    def get_state(self) -> dict:
        return {"inner": self.inner.get_state(), "count": self.count}

    def set_state(self, state: dict) -> None:
        self.inner.set_state(state["inner"])
        self.count = state["count"]


def run_tokenizer(cfg: TrainConfig) -> Tokenizer:
    """The run's tokenizer: restored from the run directory when there is one, else built."""
    saved = os.path.join(cfg.run_dir, TOKENIZER_DIR) if cfg.run_dir else None
    if saved and os.path.isdir(saved):
        return load_tokenizer(saved)
    source = None if cfg.task else cfg.data
    tokenizer = make_tokenizer(cfg.tokenizer, source, cfg.tokenizer_vocab,
                               data_dir=cfg.data_dir, text_key=cfg.text_key,
                               val_fraction=cfg.val_fraction)
    if saved:
        tokenizer.save(saved)
    return tokenizer


def masking_of(cfg: TrainConfig):
    from transformers_jax.data.mlm import MaskingConfig

    return MaskingConfig(rate=cfg.mlm_rate, mask_fraction=cfg.mlm_mask_fraction,
                         random_fraction=cfg.mlm_random_fraction)


def make_run_data(model_cfg: ModelConfig, cfg: TrainConfig, tokenizer: Tokenizer) -> RunData:
    from transformers_jax.models import family_of

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
        common = dict(train_lengths=cfg.train_lengths, fmt=fmt, prefix=prefix and fmt == "decoder",
                      max_len=max_len)
        train = make_task_iterator(cfg.task, tokenizer, cfg.seq_len, cfg.batch_size, cfg.seed,
                                   split="train", test_lengths=cfg.test_lengths, **common)
        # held-out examples at the training lengths (the test split has its own seed stream)
        held_out = make_task_iterator(cfg.task, tokenizer, cfg.seq_len, cfg.batch_size,
                                      cfg.seed, split="test", test_lengths=cfg.train_lengths,
                                      num_epochs=None, **common)
        return RunData(tokenizer, train, take(held_out, cfg.eval_batches),
                       f"task {cfg.task} (lengths {cfg.train_lengths[0]}-"
                       f"{cfg.train_lengths[1]})")
    common = dict(data_dir=cfg.data_dir, text_key=cfg.text_key, val_fraction=cfg.val_fraction,
                  max_len=max_len)
    train = make_lm_iterator(cfg.data, tokenizer, cfg.seq_len, cfg.batch_size, seed=cfg.seed,
                             pack=cfg.pack, **common)
    held_out = make_lm_eval_iterator(cfg.data, tokenizer, cfg.seq_len, cfg.batch_size,
                                     pack=cfg.pack, num_epochs=None, **common)
    eval_batches = take(held_out, cfg.eval_batches)
    if family.masked_lm:  # corrupt 15% of tokens: the masked-LM batches
        from transformers_jax.train.objectives import MaskedBatches, mask_eval_batches

        masking = masking_of(cfg)
        train = MaskedBatches(train, cfg.seed, tokenizer, masking)
        eval_batches = mask_eval_batches(eval_batches, cfg.seed, tokenizer, masking)
    elif prefix:
        train = _WithPrefix(train, cfg.seed)
        rng = np.random.default_rng([cfg.seed & 0xFFFFFFFF, 1 << 30])
        eval_batches = [add_random_prefix(b, rng) for b in eval_batches]
    name = cfg.data or "the default corpus (Python's pydoc topics)"
    return RunData(tokenizer, train, eval_batches,
                   f"{name}, {tokenizer.name} tokens (vocab {tokenizer.vocab_size}), "
                   f"pack={cfg.pack}")
