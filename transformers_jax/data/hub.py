"""Hugging Face Hub datasets: ``hf:NAME[:CONFIG][@SPLIT]``, streamed unless a download is asked.

Streaming (the default) reads records as they arrive and never stores the dataset: the
source is a ``datasets.IterableDataset`` wrapped as a Grain ``IterDataset`` whose state is the
stream's own position (``state_dict()`` / ``load_state_dict()``), so a resumed run continues
with exactly the next record. Each host reads its own share (``split_dataset_by_node``: whole
files when their count divides by the hosts, else every n-th record). A stream is read in its
stored order: a shuffle buffer would not come back on resume, so the rows are mixed by the
pipeline's own row shuffle (``--train.shuffle_rows``) instead.

The held-out text is the dataset's ``validation`` (else ``test``) split when the hub lists
one, else the first ``HELD_OUT_RECORDS`` records of the training split, which training skips.

With a download (``--data.download=true``) ``datasets`` fetches the split once into its Arrow
cache and the records are random access, like local parquet files.

Every request goes through ``load_dataset`` here, the one seam a test replaces to check the
arguments without network, or to stream local files instead.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import grain

from transformers_jax.data.hub_offline import offline_unless_reachable
from transformers_jax.data.records import (
    DatasetNotPreparedError,
    DataSpecError,
    Piece,
    SourceInfo,
    UnknownDatasetError,
)

HELD_OUT_RECORDS = 1000  # records held out of a stream whose dataset has no held-out split
_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_FORM = "hf:NAME[:CONFIG][@SPLIT], e.g. hf:wikitext:wikitext-103-raw-v1@train"


@dataclasses.dataclass(frozen=True)
class HubSpec:
    name: str  # "owner/dataset" or "dataset"
    config: str | None
    split: str | None  # None: "train"


def parse_hub(spec: str) -> HubSpec:
    """``hf:NAME[:CONFIG][@SPLIT]`` -> its parts, or a ``DataSpecError`` showing the form."""
    body = spec[len("hf:") :]
    head, at, split = body.partition("@")
    name, colon, config = head.partition(":")
    bad = (
        "no dataset name"
        if not name
        else f"{name!r} is not a hub dataset name (owner/name or name)"
        if not _NAME.match(name)
        else "an empty config after ':'"
        if colon and not config
        else "an empty split after '@'"
        if at and not split
        else None
    )
    if bad:
        raise DataSpecError(f"--data {spec!r}: {bad}; write {_FORM}")
    return HubSpec(name, config or None, split or None)


def request(
    spec: str, split: str | None = None, *, streaming: bool = True, cache_dir: str | None = None
) -> dict[str, Any]:
    """The keyword arguments of the ``datasets.load_dataset`` call that reads ``split`` (default:
    the spec's, else ``train``) of ``spec``: streamed, or downloaded into ``cache_dir``."""
    hub = parse_hub(spec)
    kwargs: dict[str, Any] = {
        "path": hub.name,
        "split": split or hub.split or "train",
        "streaming": streaming,
    }
    if hub.config is not None:
        kwargs["name"] = hub.config
    if not streaming and cache_dir is not None:
        kwargs["cache_dir"] = cache_dir
    return kwargs


def load_dataset(**kwargs):
    """``datasets.load_dataset(**kwargs)``: the one call that reaches the hub (the seam tests
    replace). Errors become one line naming the dataset and the fix."""
    from transformers_jax.data.columnar import quiet_datasets, require_datasets

    what = f"hf:{kwargs['path']}" + (f":{kwargs['name']}" if "name" in kwargs else "")
    datasets = require_datasets(f"--data {what}")
    offline_unless_reachable()  # a dataset not cached then fails at once, not after retries

    try:
        with quiet_datasets():
            return datasets.load_dataset(**kwargs)
    except datasets.exceptions.DatasetNotFoundError as err:
        raise UnknownDatasetError(
            f"--data {what}: the hub has no such dataset, or it is gated or private "
            f"({str(err).splitlines()[0][:200]}); check the name on huggingface.co/datasets "
            "(log in with `hf auth login` for a gated one)"
        ) from None
    except ValueError as err:  # an unknown config or split: datasets lists the valid ones
        raise UnknownDatasetError(f"--data {what}: {str(err).splitlines()[0][:400]}") from None
    except (ConnectionError, OSError) as err:
        raise DatasetNotPreparedError(
            f"--data {what}: the hub cannot be reached ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200] if str(err) else 'no detail'}); streaming needs "
            "network access. Offline, download the dataset elsewhere and pass its parquet or "
            "jsonl files as --data PATH"
        ) from None


def split_names(spec: str) -> list[str]:
    """The splits the hub lists for ``spec`` (empty when it cannot say)."""
    from transformers_jax.data.columnar import require_datasets

    datasets = require_datasets(f"--data {spec}")

    hub = parse_hub(spec)
    offline_unless_reachable()
    try:
        return list(datasets.get_dataset_split_names(hub.name, hub.config))
    except Exception:  # offline, or no metadata: the caller holds records out instead
        return []


def held_out_plan(spec: str, role: str) -> tuple[str, int | None, int | None]:
    """``(split, take, skip)``: what ``role`` ("train" or "eval") reads of ``spec``'s stream.
    Eval reads ``validation`` (else ``test``) when the hub lists it; otherwise both roles read
    the training split, eval its first ``HELD_OUT_RECORDS`` records and training the rest."""
    train_split = parse_hub(spec).split or "train"
    listed = split_names(spec)
    held = next((s for s in ("validation", "test") if s in listed and s != train_split), None)
    if held is not None:
        return (held, None, None) if role == "eval" else (train_split, None, None)
    return (
        (train_split, HELD_OUT_RECORDS, None)
        if role == "eval"
        else (train_split, None, HELD_OUT_RECORDS)
    )


def _features(stream) -> dict[str, Any]:
    features = stream.features
    if features is None:  # no metadata: datasets infers them from the first records
        features = stream._resolve_features().features
    return dict(features)


def stream_opener(
    source,
    *,
    field: str | None,
    shard: tuple[int, int],
    take: int | None = None,
    skip: int | None = None,
    what: str | None = None,
) -> tuple[Callable[[], Any], str]:
    """``(open, column)``: ``open()`` makes this host's ``IterableDataset`` afresh (one
    column, the held-out records taken or skipped, the host's share); ``source`` is a
    ``load_dataset`` request (a dict) or a ready ``IterableDataset``."""
    from transformers_jax.data.columnar import text_column

    def base():
        return load_dataset(**source) if isinstance(source, dict) else source

    probe = base()
    column = text_column(_features(probe), what or repr(probe), field)

    def open_stream():
        stream = base().select_columns([column])
        if take is not None:
            stream = stream.take(take)
        if skip is not None:
            stream = stream.skip(skip)
        index, count = shard
        if count > 1:
            from datasets.distributed import split_dataset_by_node

            stream = split_dataset_by_node(stream, rank=index, world_size=count)
        return stream

    return open_stream, column


class StreamDataset(grain.IterDataset):
    """The records of a stream as ``Piece``s, repeated ``num_epochs`` times (None: forever);
    resumable at the stream's own position."""

    def __init__(
        self,
        open_stream: Callable[[], Any],
        column: str,
        num_epochs: int | None = None,
        what: str = "the stream",
    ):
        super().__init__()
        self._open, self._column, self._epochs, self._what = open_stream, column, num_epochs, what

    def __iter__(self) -> grain.DatasetIterator:
        return _StreamIterator(self._open, self._column, self._epochs, self._what)

    def __str__(self) -> str:
        return f"StreamDataset({self._what})"


class _StreamIterator(grain.DatasetIterator):
    def __init__(self, open_stream, column: str, num_epochs: int | None, what: str):
        super().__init__()
        self._open, self._column, self._epochs, self._what = open_stream, column, num_epochs, what
        self._stream, self._it, self._epoch, self._read = open_stream(), None, 0, 0

    def __next__(self) -> Piece:
        while True:
            if self._it is None:
                self._it = iter(self._stream)
            try:
                text = next(self._it)[self._column]
            except StopIteration:
                if self._read == 0:
                    raise ValueError(
                        f"{self._what}: the stream has no text in this share "
                        "(no record, or only empty ones)"
                    ) from None
                if self._epochs is not None and self._epoch + 1 >= self._epochs:
                    raise
                self._stream, self._it, self._epoch, self._read = (
                    self._open(),
                    None,
                    self._epoch + 1,
                    0,
                )
                continue
            self._read += 1
            if text:
                return Piece(
                    text.encode("utf-8") if isinstance(text, str) else bytes(text), True, True
                )

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "read": self._read, "stream": self._stream.state_dict()}

    def set_state(self, state: dict[str, Any]) -> None:
        self._stream, self._it = self._open(), None
        self._stream.load_state_dict(state["stream"])
        self._epoch, self._read = int(state["epoch"]), int(state["read"])


def open_downloaded(
    spec: str, split: str, *, data_dir: str | None = None, field: str | None = None
):
    """``split`` of ``spec`` downloaded in full into ``DATA_DIR/hub`` (once; later runs read
    the cache), random access like local parquet files."""
    import os

    from transformers_jax.data.columnar import text_source_of
    from transformers_jax.data.local_text import default_data_dir

    cache = os.path.join(data_dir or default_data_dir(), "hub")
    dataset = load_dataset(**request(spec, split, streaming=False, cache_dir=cache))
    info = SourceInfo(spec, "hf", parse_hub(spec).name, split, data_dir, "")
    return text_source_of(dataset, f"--data {spec}", field, info)
