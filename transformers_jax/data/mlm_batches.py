"""Masked-LM batches: ``data/mlm.py``'s corruption applied to token windows and to the text
pipeline's batches, for the ``mlm`` objective (``learning/objectives.py``).

- ``mlm_batch``: random windows of a plain token array, rows framed ``[CLS] ... [SEP]``.
- ``MaskedBatches`` / ``mask_eval_batches``: the training loop's text-pipeline batches turned
  into masked-LM batches (padding and special ids are never chosen).

Every batch is a pure function of (seed, index): the corruption key of batch i is
``mlm_key(seed, i)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from transformers_jax.data.mlm import (
    BERT_MASKING,
    MaskingConfig,
    mask_batch,
    mask_tokens,
    special_ids_of,
)
from transformers_jax.data.resumable import MappedBatches
from transformers_jax.data.tokenizers import ByteTokenizer


def mlm_batch(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    seed: int,
    index: int,
    *,
    tokenizer=None,
    masking: MaskingConfig = BERT_MASKING,
    vocab_size: int | None = None,
) -> dict:
    """Random corpus windows as ``[CLS] w_1 .. w_{T-2} [SEP]``, masked for the MLM loss.

    Returns numpy ``inputs`` (corrupted), ``targets``, ``weights`` (1 on chosen positions) and
    ``token_types`` (zeros: one segment), all ``[B, T]``. A pure function of (seed, index): the
    windows come from numpy's generator seeded with both, the corruption from a JAX key folded
    from both.
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    if seq_len < 3:
        raise ValueError(f"seq_len={seq_len}: an MLM row needs [CLS], a token and [SEP]")
    body = seq_len - 2
    rng = np.random.default_rng([seed & 0xFFFFFFFF, index])
    starts = rng.integers(0, len(tokens) - body + 1, size=batch_size)
    rows = np.empty((batch_size, seq_len), np.int32)
    rows[:, 0] = tokenizer.special["cls"]
    rows[:, -1] = tokenizer.special["sep"]
    rows[:, 1:-1] = np.stack([tokens[s : s + body] for s in starts])
    key = jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), index)
    out = mask_tokens(
        key,
        rows,
        mask_id=int(tokenizer.special["mask"]),
        special_ids=special_ids_of(tokenizer),
        vocab_size=tokenizer.vocab_size if vocab_size is None else vocab_size,
        config=masking,
    )
    batch = {k: np.asarray(v) for k, v in out.items()}
    batch["token_types"] = np.zeros((batch_size, seq_len), np.int32)
    return batch


def mlm_key(seed: int, index: int, stream: int = 0) -> jax.Array:
    """The corruption key of batch ``index``: a pure function of (seed, stream, index)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), stream),
                              index)


class MaskedBatches(MappedBatches):
    """Wraps a batch iterator of the text pipeline (``inputs``, ``segment_ids``, ...) into
    masked-LM batches: ``inputs`` becomes the corrupted tokens, ``targets`` the original ones,
    ``weights`` 1 on the chosen positions (never padding: ``segment_ids == 0``, never a special
    id). The pipeline's next-token ``targets`` and ``weights`` are replaced; positions and
    segment ids pass through, so packed documents stay apart.

    The key of batch i is ``mlm_key(seed, i)``; the state to resume is the inner iterator's
    plus the batch count (``get_state``/``set_state``, like the pipeline's iterators).
    """

    def __init__(self, inner, seed: int, tokenizer, masking: MaskingConfig = BERT_MASKING,
                 vocab_size: int | None = None):
        super().__init__(inner)
        self.seed = seed
        self.tokenizer, self.masking, self.vocab_size = tokenizer, masking, vocab_size

    def transform(self, batch: dict, index: int) -> dict:
        key = mlm_key(self.seed, index)
        return mask_for_mlm(key, batch, self.tokenizer, self.masking, self.vocab_size)


def mask_for_mlm(key: jax.Array, batch: dict, tokenizer, masking: MaskingConfig = BERT_MASKING,
                 vocab_size: int | None = None) -> dict:
    """One text-pipeline batch as a masked-LM batch (numpy arrays, like the pipeline's)."""
    batch = {k: v for k, v in batch.items() if k != "prefix_len"}
    out = mask_batch(key, batch, tokenizer, masking, vocab_size)
    return {k: np.asarray(v) for k, v in out.items()}


def mask_eval_batches(batches: Sequence[dict], seed: int, tokenizer,
                      masking: MaskingConfig = BERT_MASKING,
                      vocab_size: int | None = None) -> list[dict]:
    """Fixed held-out masked-LM batches (their own key stream), the same at every evaluation."""
    return [mask_for_mlm(mlm_key(seed, i, stream=1), b, tokenizer, masking, vocab_size)
            for i, b in enumerate(batches)]
