"""Prefix-LM batches for a decoder-only model with ``mask=prefix``: the prefix is attended
bidirectionally and carries no loss.

- ``prefix_lm_batch``: (source ids, target ids) pairs (``data/seq2seq.py``'s ``task_pairs``)
  as one row each, ``[bos] src [sep] tgt [eos]``, the prefix covering ``[bos] src [sep]``.
- ``add_random_prefix`` / ``PrefixBatches``: the text pipeline's batches with a random prefix
  per row (resumable: the prefix of batch i is a function of (seed, i)).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from transformers_jax.data.resumable import MappedBatches
from transformers_jax.data.tokenizers import ByteTokenizer


def prefix_lm_batch(pairs: Sequence[tuple], seq_len: int, tokenizer=None) -> dict:
    """Decoder-only conditional rows ``[bos] src [sep] tgt [eos] pad..`` for ``mask=prefix``.

    ``inputs`` is the row without its last token, ``targets`` the row shifted left; the prefix
    ``[bos] src [sep]`` (``prefix_len``) is seen bidirectionally and carries no loss: ``weights``
    is 1 exactly on the targets ``tgt eos``. ``segment_ids`` is 0 on padding.
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    sp = tokenizer.special
    B = len(pairs)
    rows = np.full((B, seq_len + 1), sp["pad"], np.int32)
    prefix_len = np.zeros(B, np.int32)
    ends = np.zeros(B, np.int32)
    for i, (src, tgt) in enumerate(pairs):
        row = [sp["bos"], *src, sp["sep"], *tgt, sp["eos"]]
        if len(row) > seq_len + 1:
            raise ValueError(f"example {i} needs {len(row) - 1} positions; seq_len={seq_len}")
        rows[i, : len(row)] = row
        prefix_len[i] = len(src) + 2
        ends[i] = len(row) - 1  # inputs t < ends are real
    t = np.arange(seq_len)[None]
    return {
        "inputs": rows[:, :-1],
        "targets": rows[:, 1:],
        # target t is row[t + 1]: in the answer when t + 1 >= prefix_len, real when t < ends
        "weights": ((t + 1 >= prefix_len[:, None]) & (t < ends[:, None])).astype(np.float32),
        "segment_ids": (t < ends[:, None]).astype(np.int32),
        "prefix_len": prefix_len,
    }


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


class PrefixBatches(MappedBatches):
    """Wraps an iterator to add ``prefix_len``; its RNG is a function of the batch count, so
    the state to resume is the inner iterator's plus that count."""

    def __init__(self, inner, seed: int):
        super().__init__(inner)
        self.seed = seed

    def transform(self, batch: dict, index: int) -> dict:
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, index])
        return add_random_prefix(batch, rng)


def eval_prefix_batches(batches: Sequence[dict], seed: int) -> list[dict]:
    """Fixed held-out prefix-LM batches (their own generator), the same at every evaluation."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, 1 << 30])
    return [add_random_prefix(b, rng) for b in batches]
