"""Local columnar files (``*.parquet``, ``*.jsonl``, ``*.arrow``, ``*.csv``) as random-access text.

``datasets`` loads the files once into memory-mapped Arrow (cached under the data directory,
so a second run reads the cache); one column is the text. The result is a ``TextSource`` like
a tfds split's, so ``Documents`` pieces it and the Grain pipeline shuffles, shards across
hosts, holds out its tail for evaluation and resumes exactly as it does for any other source.
A Hugging Face dataset downloaded in full (``hf:NAME`` with ``--data.download``) is the same
kind of Arrow table and comes through ``text_source_of`` too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Sequence
from typing import Any

from transformers_jax.data.corpus import expand_paths
from transformers_jax.data.records import (
    MissingPackageError,
    SourceInfo,
    TextSource,
    UnreadableDataError,
    choose_text_field,
)

# file suffix -> the ``datasets`` builder that reads it
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".arrow": "arrow", ".csv": "csv"}


def require_datasets(what: str):
    """The ``datasets`` module, or an error saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise MissingPackageError(
            f"{what} is read with the `datasets` package, which is not installed: "
            "pip install 'transformers-jax[hf-data]' (or pip install datasets)"
        ) from None
    return datasets


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def columnar_files(path: str) -> list[str] | None:
    """The columnar files ``path`` names (a file, folder or glob), or None when it names
    plain text. A folder or glob mixing columnar files with others, or two columnar formats,
    is an error saying how to pick one kind."""
    if not os.path.exists(path) and not any(ch in path for ch in "*?["):
        return None  # not a path at all: the local-text reader reports it
    files = expand_paths(path)
    kinds = {_suffix(f) for f in files}
    columnar = kinds & set(FORMATS)
    if not columnar:
        return None
    if len(kinds) > 1:
        others = sorted(kinds - set(FORMATS)) or sorted(columnar)[1:]
        raise UnreadableDataError(
            f"--data {path!r} holds {', '.join(sorted(columnar))} files and "
            f"{', '.join(k or '(no suffix)' for k in others)} files; read one kind, e.g. --data "
            f"'{path.rstrip('/')}/**/*{sorted(columnar)[0]}' (a mixture of several sources is "
            "'0.5*A,0.5*B')"
        )
    return files


def file_key(files: Sequence[str]) -> str:
    """A hash of the files' paths and contents: what a resume compares."""
    h = hashlib.blake2b(b"columnar|1", digest_size=12)
    for path in files:
        h.update(os.path.abspath(path).encode("utf-8", "surrogateescape") + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def text_column(features: dict[str, Any], what: str, field: str | None) -> str:
    """The column holding the text (``choose_text_field``): string columns are text."""
    kinds = {name: str(getattr(f, "dtype", type(f).__name__)) for name, f in features.items()}
    texts = [n for n, k in kinds.items() if k in ("string", "large_string")]
    return choose_text_field(kinds, texts, what, field)


class ArrowText:
    """Rows of one string column of an Arrow-backed ``datasets.Dataset``: ``[i] -> str``."""

    def __init__(self, dataset, column: str):
        self._column = dataset.select_columns([column])
        self._name = column

    def __len__(self) -> int:
        return len(self._column)

    def __getitem__(self, index: int) -> dict[str, str]:
        value = self._column[int(index)][self._name]
        return {self._name: "" if value is None else value}


def text_source_of(dataset, what: str, field: str | None, info):
    """A ``TextSource`` over a loaded ``datasets.Dataset`` (local files, or a full download)."""
    column = text_column(dict(dataset.features), what, field)
    return TextSource(
        ArrowText(dataset, column), column, dataclasses.replace(info, text_key=column)
    )


@contextlib.contextmanager
def quiet_datasets():
    """No ``datasets`` progress bars inside the block (the console shows the run's own)."""
    datasets = require_datasets("this data")

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def open_columnar(
    path: str,
    files: Sequence[str],
    *,
    data_dir: str | None = None,
    field: str | None = None,
    spec: str | None = None,
):
    """The text column of local columnar ``files`` (one format) as a random-access
    ``TextSource``; ``datasets`` converts them once to Arrow under ``DATA_DIR/columnar``."""
    datasets = require_datasets(f"--data {path!r}")
    from datasets.exceptions import DatasetGenerationError
    from pyarrow import ArrowException

    from transformers_jax.data.local_text import default_data_dir

    builder = FORMATS[_suffix(files[0])]
    cache = os.path.join(data_dir or default_data_dir(), "columnar")
    try:
        with quiet_datasets():
            dataset = datasets.load_dataset(
                builder, data_files=list(files), split="train", cache_dir=cache
            )
    except (DatasetGenerationError, ArrowException, ValueError, OSError) as err:
        cause = err.__cause__ or err
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:300]
        raise UnreadableDataError(
            f"--data {path!r}: cannot read {len(files)} {_suffix(files[0])} file(s) "
            f"({', '.join(files[:3])}{', ...' if len(files) > 3 else ''}) as {builder}: "
            f"{type(cause).__name__}: {first}; check the files are complete and of that format"
        ) from None
    if len(dataset) == 0:
        raise ValueError(f"--data {path!r}: the corpus is empty ({len(files)} file(s), no rows)")
    info = SourceInfo(spec or path, "columnar", path, "train", data_dir, "")
    return text_source_of(dataset, f"--data {path!r}", field, info)
