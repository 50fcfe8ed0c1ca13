"""tfds classification data (``imdb_reviews``, ``glue/sst2``...) for the
``sequence_classification`` objective, read by random access through ``tfds.data_source``
(no TensorFlow): ``load_classification`` opens a split, ``classification_batch`` and
``classification_batch_at`` encode rows as ``[CLS] a [SEP] (b [SEP])`` batches.

Shape legend: B batch, T length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from transformers_jax.data.tokenizers import ByteTokenizer


@dataclass(frozen=True)
class ClassificationSource:
    """A random-access tfds split with the features to read: text (one or a pair) and label."""

    source: Any  # tfds data source: len(), source[i] -> dict of features
    text_keys: tuple[str, ...]
    label_key: str
    num_labels: int

    def __len__(self) -> int:
        return len(self.source)


def load_classification(
    name: str = "imdb_reviews",
    split: str = "train",
    *,
    text_key: str | tuple[str, str] | None = None,
    label_key: str = "label",
    data_dir: str | None = None,
) -> ClassificationSource:
    """A tfds classification split read through ``tfds.data_source`` (no TensorFlow).

    ``text_key`` defaults to the dataset's only ``Text`` feature (``text`` for imdb_reviews,
    ``sentence`` for glue/sst2); give a pair, e.g. ``("premise", "hypothesis")``, for sentence
    pairs (then token types 0 and 1). The label must be a ``ClassLabel``. The dataset must be
    prepared in ``data_dir`` (or downloadable); builders that need TensorFlow to prepare
    (glue) must have been prepared elsewhere.
    """
    import tensorflow_datasets as tfds

    source = tfds.data_source(name, split=split, data_dir=data_dir)
    features = source.dataset_info.features
    if text_key is None:
        texts = [k for k, f in features.items() if type(f).__name__ == "Text"]
        if len(texts) != 1:
            raise ValueError(f"{name}: text features {texts}; pass text_key= (one name or a "
                             "pair for sentence-pair tasks)")
        text_key = texts[0]
    text_keys = (text_key,) if isinstance(text_key, str) else tuple(text_key)
    for key in (*text_keys, label_key):
        if key not in features:
            raise ValueError(f"{name} has no feature {key!r}; features: {list(features)}")
    num_labels = getattr(features[label_key], "num_classes", None)
    if not num_labels:
        raise ValueError(f"{name}: feature {label_key!r} is not a ClassLabel")
    return ClassificationSource(source, text_keys, label_key, int(num_labels))


def encode_classification_example(texts: Sequence[str | bytes], seq_len: int,
                                  tokenizer=None) -> tuple[np.ndarray, np.ndarray]:
    """``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]`` truncated to seq_len (the longer text
    loses tokens first) and padded; returns (ids, token types), both ``[seq_len]``."""
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    sp = tokenizer.special
    parts = [list(tokenizer.encode(t)) for t in texts]
    budget = seq_len - 1 - len(parts)
    if budget < 0:
        raise ValueError(f"seq_len={seq_len} cannot hold [CLS] and {len(parts)} [SEP]")
    while sum(len(p) for p in parts) > budget:
        max(parts, key=len).pop()
    ids, types = [sp["cls"]], [0]
    for j, part in enumerate(parts):
        ids += [*part, sp["sep"]]
        types += [j] * (len(part) + 1)
    out_ids = np.full(seq_len, sp["pad"], np.int32)
    out_types = np.zeros(seq_len, np.int32)
    out_ids[: len(ids)], out_types[: len(types)] = ids, types
    return out_ids, out_types


def classification_batch(data: ClassificationSource, indices: Sequence[int], seq_len: int,
                         tokenizer=None) -> dict:
    """Rows ``indices`` of ``data`` as a classifier batch: ``inputs``, ``token_types``,
    ``segment_ids`` (1 real, 0 padding) ``[B, T]`` and ``labels`` ``[B]``."""
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    ids, types, labels = [], [], []
    for i in indices:
        example = data.source[int(i)]
        row, row_types = encode_classification_example(
            [example[k] for k in data.text_keys], seq_len, tokenizer
        )
        ids.append(row)
        types.append(row_types)
        labels.append(int(example[data.label_key]))
    inputs = np.stack(ids)
    return {
        "inputs": inputs,
        "token_types": np.stack(types),
        "segment_ids": (inputs != tokenizer.pad_id).astype(np.int32),
        "labels": np.asarray(labels, np.int32),
    }


def classification_batch_at(data: ClassificationSource, batch_size: int, seq_len: int, seed: int,
                            index: int, tokenizer=None) -> dict:
    """Batch ``index`` of random rows (with replacement), a pure function of (seed, index)."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, index])
    return classification_batch(data, rng.integers(0, len(data), size=batch_size), seq_len,
                                tokenizer)
