"""A batch iterator that transforms each batch of another and resumes with it.

The training loop saves the data iterator's ``get_state()`` in every checkpoint and hands it
back through ``set_state`` on resume (Grain's ``DatasetIterator`` protocol). A wrapper that
changes each batch (masked-LM corruption, random prefixes) must therefore forward that state,
and its own randomness must be a function of the batch count alone, so a resumed run sees
exactly the batches the uninterrupted one would have. ``MappedBatches`` is that wrapper: a
subclass only says how batch ``index`` is transformed.
"""

from __future__ import annotations

from typing import Any


class MappedBatches:
    """``transform(batch, index)`` of each batch of ``inner`` (``index`` counts from 0).

    The state to resume is the inner iterator's plus the count of batches taken,
    ``{"inner": ..., "count": ...}``.
    """

    def __init__(self, inner: Any):
        self.inner, self.count = inner, 0

    def transform(self, batch: dict, index: int) -> dict:
        raise NotImplementedError

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.inner)
        index = self.count
        self.count += 1
        return self.transform(batch, index)

    def get_state(self) -> dict:
        return {"inner": self.inner.get_state(), "count": self.count}

    def set_state(self, state: dict) -> None:
        self.inner.set_state(state["inner"])
        self.count = state["count"]
