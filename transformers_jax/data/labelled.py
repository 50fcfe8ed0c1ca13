"""Local labelled examples for classification fine-tuning: JSONL or CSV rows with a text and a
label, read whole into memory.

``read_labelled(path)`` returns the texts and the raw labels; ``label_names`` turns the labels
into class names (ids are list positions): whole numbers keep their value as the id, any other
labels are sorted and numbered. ``split_rows`` holds out a share of the rows, and
``LabelledBatches`` draws training batches in seeded epochs, resumable by its batch count. Rows
become ``data/classification.py`` batches (``[CLS] text [SEP]``).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Callable, Sequence

import numpy as np

from transformers_jax.data.classification import ClassificationSource, classification_batch
from transformers_jax.registry import Registry

Rows = list[dict]
# file extension -> reader(path) -> (rows, the columns the file has)
LABELLED_FORMATS: Registry[Callable[[str], tuple[Rows, list[str]]]] = Registry(
    "labelled data format (file extension)")


@LABELLED_FORMATS.register(".jsonl")
def _read_jsonl(path: str) -> tuple[Rows, list[str]]:
    rows, columns = [], {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {number}: expected a JSON object like "
                                 '{"text": ..., "label": ...}')
            rows.append(row)
            columns.update(dict.fromkeys(row))
    return rows, list(columns)


LABELLED_FORMATS.add(".ndjson", _read_jsonl)


def _csv_reader(delimiter: str) -> Callable[[str], tuple[Rows, list[str]]]:
    def read(path: str) -> tuple[Rows, list[str]]:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, delimiter=delimiter)
            return list(reader), list(reader.fieldnames or [])

    return read


LABELLED_FORMATS.add(".csv", _csv_reader(","))
LABELLED_FORMATS.add(".tsv", _csv_reader("\t"))


def read_labelled(path: str, text_key: str = "text",
                  label_key: str = "label") -> tuple[list[tuple[str, ...]], list[str]]:
    """``(texts, labels)`` of every row of a JSONL or CSV file (the header names the columns).

    ``text_key`` may name two columns, ``"premise,hypothesis"`` (a sentence pair). Labels are
    returned as strings (a JSON ``1`` and a CSV ``1`` are the same class). A missing column is
    an error that lists the file's columns.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"labelled data {path!r}: no such file")
    rows, columns = LABELLED_FORMATS.get(os.path.splitext(path)[1].lower())(path)
    keys = tuple(k.strip() for k in text_key.split(","))
    for key in (*keys, label_key):
        if key not in columns:
            raise ValueError(f"{path} has no column {key!r}; its columns: "
                             f"{', '.join(map(str, columns)) or 'none'} (choose them with "
                             "--train.text_key and --train.label_key)")
    texts, labels = [], []
    for number, row in enumerate(rows, 1):
        missing = [k for k in (*keys, label_key) if row.get(k) in (None, "")]
        if missing:
            raise ValueError(f"{path}, row {number}: no value for {', '.join(missing)}")
        texts.append(tuple(str(row[k]) for k in keys))
        label = str(row[label_key]).strip()
        labels.append(str(int(label)) if label.isdigit() else label)  # "01" is class 1
    return texts, labels


def label_names(labels: Sequence[str], known: Sequence[str] | None = None) -> list[str]:
    """Class names, the id of each being its position. Whole-number labels keep their value
    (``0..max``); others are sorted. ``known``: the names a run saved (resuming), which every
    label must be among. Fewer than two classes is an error."""
    distinct = sorted(set(labels))
    if known is not None:
        unknown = [x for x in distinct if x not in known]
        if unknown:
            raise ValueError(f"labels {unknown[:5]} are not among the run's saved labels "
                             f"{list(known)}; fine-tune them in a new --run-dir")
        return list(known)
    if len(distinct) < 2:
        raise ValueError(f"the data has {len(distinct)} class ({distinct}); classification "
                         "needs at least two labels")
    if all(x.isdigit() for x in distinct):
        return [str(i) for i in range(max(int(x) for x in distinct) + 1)]
    return distinct


def split_rows(count: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train rows, held-out rows)``: a seeded shuffle, the held-out share taken first (at
    least one row each)."""
    if count < 2:
        raise ValueError(f"{count} labelled example(s): need at least two (one to hold out)")
    order = np.random.default_rng([seed & 0xFFFFFFFF, 1]).permutation(count)
    held = min(count - 1, max(1, round(count * val_fraction)))
    return order[held:], order[:held]


def file_fingerprint(path: str) -> str:
    with open(path, "rb") as f:
        return "labelled:" + hashlib.blake2b(f.read(), digest_size=8).hexdigest()


def as_source(texts: list[tuple[str, ...]], ids: np.ndarray, num_labels: int):
    """The rows as a random-access ``ClassificationSource`` (what the batch encoder reads)."""
    n_texts = len(texts[0])
    rows = [{**{f"text{j}": t[j] for j in range(n_texts)}, "label": int(i)}
            for t, i in zip(texts, ids, strict=True)]
    return ClassificationSource(rows, tuple(f"text{j}" for j in range(n_texts)), "label",
                                num_labels)


class LabelledBatches:
    """Training batches of ``rows`` (indices into ``source``): each epoch a new seeded order,
    batch ``i`` a pure function of (seed, i); the state to resume is the batch count."""

    def __init__(self, source: ClassificationSource, rows: np.ndarray, batch_size: int,
                 seq_len: int, seed: int, tokenizer):
        self.source, self.rows, self.batch_size = source, np.asarray(rows), batch_size
        self.seq_len, self.seed, self.tokenizer, self.count = seq_len, seed, tokenizer, 0

    def rows_of(self, index: int) -> np.ndarray:
        positions = index * self.batch_size + np.arange(self.batch_size)
        epochs, offsets = np.divmod(positions, len(self.rows))
        out = np.empty(self.batch_size, np.int64)
        for epoch in np.unique(epochs):
            order = np.random.default_rng([self.seed & 0xFFFFFFFF, 2, int(epoch)]).permutation(
                len(self.rows))
            out[epochs == epoch] = self.rows[order[offsets[epochs == epoch]]]
        return out

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = classification_batch(self.source, self.rows_of(self.count), self.seq_len,
                                     self.tokenizer)
        self.count += 1
        return batch

    def get_state(self) -> dict:
        return {"count": self.count}

    def set_state(self, state: dict) -> None:
        self.count = int(state["count"])


def held_out_batches(source: ClassificationSource, rows: np.ndarray, batch_size: int,
                     seq_len: int, max_batches: int, tokenizer) -> list[dict]:
    """The held-out rows in order, as at most ``max_batches`` batches; the last is filled by
    starting the rows again (every batch has ``batch_size`` rows)."""
    count = min(max_batches, -(-len(rows) // batch_size))
    taken = np.resize(np.asarray(rows), count * batch_size)
    return [classification_batch(source, taken[i * batch_size:(i + 1) * batch_size], seq_len,
                                 tokenizer) for i in range(count)]
