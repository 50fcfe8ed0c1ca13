"""What every text source shares: the errors a ``--data`` spec can raise, a ``Piece`` of a
document, and ``TextSource``, random access to the raw bytes of one split's text. The source
kinds (``sources``, ``columnar``, ``hub``, ``mixture``) build on these."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from transformers_jax.registry import UnknownNameError


class DatasetNotPreparedError(FileNotFoundError):
    """A tfds dataset that is not on local disk while downloading is off or impossible."""


class UnknownDatasetError(UnknownNameError):
    """A dataset, task or source name that does not exist; the message lists valid ones."""


class DataSpecError(UnknownDatasetError):
    """A ``--data`` spec that does not parse (a hub name, a mixture's weights); the message
    shows the form it takes."""


class UnreadableDataError(ValueError):
    """A data file that exists but cannot be read as what its name says it is."""


class MissingPackageError(ValueError):
    """An optional package that this kind of data needs is not installed."""


class UnknownFieldError(UnknownDatasetError):
    """A text field (``--data.field``) that the data does not have; the message lists its
    fields."""


class Piece(NamedTuple):
    text: bytes
    first: bool  # the piece starts its document
    last: bool  # the piece ends its document


@dataclasses.dataclass(frozen=True)
class SourceInfo:
    spec: str
    kind: str  # "tfds", "local", "columnar" or "hf"
    name: str  # tfds name, local path or hub dataset
    split: str
    data_dir: str | None
    text_key: str


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, np.ndarray) and value.dtype.kind in "SO":
        return _as_bytes(value.item())
    raise TypeError(f"expected a text feature (bytes or str), got {type(value).__name__}")


class TextSource:
    """Random access to the raw bytes of each record's text feature."""

    def __init__(self, data_source: Sequence[Any], text_key: str, info: SourceInfo):
        self._source = data_source
        self.text_key = text_key
        self.info = info

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> bytes:
        return _as_bytes(self._source[index][self.text_key])

    def __repr__(self) -> str:
        return f"TextSource({self.info.spec!r}, split={self.info.split!r}, {len(self)} records)"


def choose_text_field(kinds: dict[str, str], texts: Sequence[str], what: str,
                      field: str | None, require_text: bool = True) -> str:
    """The field holding the text, from the fields' kinds (name -> kind) and the names of the
    text ones: ``field`` when given (it must exist and, with ``require_text``, hold text), else
    ``text``, else the only text field; otherwise an error listing the fields."""
    listed = ", ".join(f"{name} ({kind})" for name, kind in kinds.items())
    if field is not None:
        if kinds and field not in kinds:
            raise UnknownFieldError(
                f"--data.field={field!r} is not a field of {what}; its fields: {listed}")
        if require_text and kinds and field not in texts:
            raise UnknownFieldError(
                f"--data.field={field!r} of {what} holds {kinds[field]}, not text; "
                f"its text fields: {', '.join(texts) or 'none'}")
        return field
    if "text" in texts:
        return "text"
    if len(texts) == 1:
        return texts[0]
    raise UnknownFieldError(
        f"{what} has {'no' if not texts else 'several'} text fields "
        f"({', '.join(texts) or 'none'}); choose one with --data.field=NAME (its fields: {listed})")

