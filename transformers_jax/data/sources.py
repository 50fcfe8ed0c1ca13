"""Text sources by spec: tfds catalog datasets, local text, the default corpus.

A source spec is a string:

- ``None``, ``""`` or ``"default"``: the embedded default corpus (one document per pydoc topic),
  prepared through the local-text tfds builder;
- ``"tfds:NAME"`` (``NAME`` may carry a config and version, ``"imdb_reviews/plain_text:1.0.0"``):
  a tfds catalog dataset, read with ``tfds.data_source`` (ArrayRecord, no TensorFlow); it must
  already be prepared in ``data_dir`` (or ``$TFDS_DATA_DIR``) unless ``download=True``;
- ``"hf:NAME[:CONFIG][@SPLIT]"``: a Hugging Face Hub dataset, streamed (``data/hub.py``), or
  downloaded in full and read like local columnar files when ``download=True``;
- ``"lines:PATH"``: local text with one document per non-blank line;
- a file, folder or glob of ``*.parquet``, ``*.jsonl``, ``*.arrow`` or ``*.csv`` files: one
  document per row, the text column chosen by ``text_key`` (``data/columnar.py``);
- anything else: a file, folder or glob of local text, one document per file.

Mixtures of these (``"0.7*A,0.3*B"``, ``data/mixture.py``) are the pipeline's: they are not one
list of documents.

``open_documents(spec, role)`` returns a random-access ``Documents`` (``len`` and ``[i]``, what
Grain's ``MapDataset.source`` reads) whose items are ``Piece(text: bytes, first, last)``.
Documents are cut into pieces of at most ``max_piece_bytes`` (at line breaks where possible)
when the source has few records, so that a one-file corpus or ``tiny_shakespeare`` (one huge
record per split) can still be shuffled, sharded across hosts and split for evaluation;
``first``/``last`` say whether the piece starts or ends its document (the pipeline adds bos/eos
only there). The held-out ("eval") role uses the dataset's ``validation`` or ``test`` split
when it has one, and otherwise the last ``val_fraction`` of the pieces (which training then
skips).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any

import numpy as np

# the types every source shares, kept in records.py so the sources' own modules can use them
from transformers_jax.data.records import (  # noqa: F401 (names of this module's API)
    DatasetNotPreparedError,
    DataSpecError,
    MissingPackageError,
    Piece,
    SourceInfo,
    TextSource,
    UnknownDatasetError,
    UnknownFieldError,
    UnreadableDataError,
    choose_text_field,
)

KNOWN_TEXT_DATASETS = (
    "tiny_shakespeare",
    "lm1b",
    "imdb_reviews",
    "pg19",
    "scientific_papers",
    "huggingface:wikitext/wikitext-103-raw-v1",
)
ROLES = ("train", "eval")
_SCAN_LIMIT = 10_000  # sources with at most this many records are scanned and cut into pieces


# ----------------------------------------------------------------------------- tfds catalog


def _did_you_mean(message: str) -> str:
    for line in message.splitlines():
        if line.startswith("Did you mean"):
            return " " + line.strip()
    return ""


def _not_prepared_message(name: str, data_dir: str | None, cause: BaseException) -> str:
    if name.startswith("tjax_linux_source"):
        config = name.split("/")[1].split(":")[0] if "/" in name else "CONFIG"
        return (f"{name!r} is not prepared in {data_dir}: run `tjax corpus linux-source "
                f"--config {config}` (with --data-dir {data_dir} when that is not the default)")
    where = data_dir or "the default tfds data_dir (~/tensorflow_datasets or $TFDS_DATA_DIR)"
    return (
        f"tfds dataset {name!r} is not prepared in {where} and it cannot be downloaded here "
        f"({type(cause).__name__}). Prepare it on a machine with network access, in the "
        f"ArrayRecord format that random access needs: `tfds build {name.split('/')[0]} "
        f"--data_dir=DIR --file_format=array_record` (or in Python: tfds.builder({name!r}, "
        "data_dir=DIR, file_format='array_record').download_and_prepare()); then copy DIR "
        "here and pass it with --train.data_dir=DIR (data_dir= in Python) or set "
        "TFDS_DATA_DIR. Where this machine has network access, --train.data_download=true "
        "(download=True) lets tfds download it."
    )


def _text_key(features: Any, name: str, text_key: str | None) -> str:
    """The text feature (``choose_text_field``): ``tfds.features.Text`` ones, though a named
    field of another kind is taken as the user says."""
    import tensorflow_datasets as tfds

    items = dict(features.items()) if hasattr(features, "items") else {}
    kinds = {k: type(f).__name__ for k, f in sorted(items.items())}
    texts = [k for k in kinds if isinstance(items[k], tfds.features.Text)]
    return choose_text_field(kinds, texts, f"tfds dataset {name!r}", text_key,
                             require_text=False)


def _data_dir(name: str, data_dir: str | None) -> str | None:
    """Registers this package's own builders (``tjax_linux_source``, prepared by ``tjax
    corpus``) with tfds, and says where they live when ``data_dir`` is not given: in
    ``local_text.default_data_dir()``, where ``tjax corpus`` puts them."""
    from transformers_jax.data import linux_source
    from transformers_jax.data.local_text import default_data_dir

    if data_dir is None and name.split("/")[0].split(":")[0] == linux_source.BUILDER_NAME:
        return default_data_dir()
    return data_dir


def tfds_builder(name: str, data_dir: str | None):
    """The tfds builder of catalog dataset ``name`` (its ``info``: splits, features, prepared
    version), or an ``UnknownDatasetError`` listing what is known to work."""
    import tensorflow_datasets as tfds

    from transformers_jax.data.local_text import quiet_tfds

    data_dir = _data_dir(name, data_dir)
    try:
        with quiet_tfds():
            return tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as e:
        raise UnknownDatasetError(
            f"tfds dataset {name!r} is not in the catalog.{_did_you_mean(str(e))} Text "
            f"datasets known to work: {', '.join(KNOWN_TEXT_DATASETS)} (any tfds catalog "
            "dataset with a Text feature can be used; some need extra packages or TensorFlow)"
        ) from None


def available_splits(name: str, data_dir: str | None = None) -> list[str]:
    """The splits a prepared tfds dataset records (empty when unknown, e.g. not prepared)."""
    return list(tfds_builder(name, data_dir).info.splits)


def open_tfds(
    name: str,
    split: str = "train",
    *,
    data_dir: str | None = None,
    text_key: str | None = None,
    download: bool = False,
) -> TextSource:
    """A tfds catalog dataset's text, random access through ``tfds.data_source``."""
    import tensorflow_datasets as tfds

    from transformers_jax.data.local_text import quiet_tfds

    data_dir = _data_dir(name, data_dir)
    builder = tfds_builder(name, data_dir)
    key = _text_key(builder.info.features, name, text_key)
    try:
        with quiet_tfds():
            source = tfds.data_source(name, split=split, data_dir=data_dir, download=download)
    except Exception as e:
        if builder.is_prepared():
            splits = list(builder.info.splits)
            if splits and split.split("[")[0] not in splits:
                raise ValueError(
                    f"tfds dataset {name!r} has no split {split!r}; its splits: {', '.join(splits)}"
                ) from e
            raise
        raise DatasetNotPreparedError(_not_prepared_message(name, data_dir, e)) from e
    info = SourceInfo(f"tfds:{name}", "tfds", name, split, data_dir, key)
    return TextSource(source, key, info)


# ----------------------------------------------------------------------------- specs


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    kind: str  # "tfds", "local" (text), "columnar" (parquet/jsonl/arrow/csv files) or "hf"
    name: str | None  # tfds name, the local path (None: default corpus), or the hub dataset
    unit: str = "file"
    files: tuple[str, ...] = ()  # columnar: the files the path names


def parse_spec(spec: str | None, unit: str | None = None) -> SourceSpec:
    """``None``/"default" -> default corpus; "tfds:NAME"; "hf:NAME[:CONFIG][@SPLIT]";
    "lines:PATH"; else a local path (columnar files when every file it names is one)."""
    from transformers_jax.data.columnar import columnar_files
    from transformers_jax.data.mixture import is_mixture

    if spec is None or spec in ("", "default"):
        return SourceSpec("local", None, unit or "file")
    if is_mixture(spec):
        raise DataSpecError(f"--data {spec!r} is a mixture, and this reads one source: name "
                            "one of its parts")
    if spec.startswith("tfds:"):
        name = spec[len("tfds:") :]
        if not name:
            raise UnknownDatasetError(
                f"--data {spec!r}: name a dataset, e.g. tfds:{KNOWN_TEXT_DATASETS[0]}; known "
                f"text datasets: {', '.join(KNOWN_TEXT_DATASETS)}"
            )
        return SourceSpec("tfds", name)
    if spec.startswith("hf:"):
        from transformers_jax.data.hub import parse_hub

        parse_hub(spec)  # checks the spec
        return SourceSpec("hf", spec[len("hf:") :])
    if spec.startswith("lines:"):
        return SourceSpec("local", spec[len("lines:") :], "line")
    files = columnar_files(spec)
    if files is not None:
        return SourceSpec("columnar", spec, "row", tuple(files))
    return SourceSpec("local", spec, unit or "file")


def open_source(
    spec: str | None,
    split: str = "train",
    *,
    data_dir: str | None = None,
    text_key: str | None = None,
    unit: str | None = None,
    download: bool = False,
) -> TextSource:
    """The raw records of one split of ``spec`` (see the module docstring), in stored order.

    Local text is prepared (once, cached by content hash) by the ``tjax_local_text`` builder
    and then read with ``tfds.data_source`` exactly like a catalog dataset.
    """
    parsed = parse_spec(spec, unit)
    if parsed.kind == "tfds":
        return open_tfds(
            parsed.name, split, data_dir=data_dir, text_key=text_key, download=download
        )
    if parsed.kind == "columnar":
        from transformers_jax.data.columnar import open_columnar

        return open_columnar(parsed.name, parsed.files, data_dir=data_dir, field=text_key)
    if parsed.kind == "hf":
        from transformers_jax.data.hub import open_downloaded

        if not download:
            raise ValueError(f"internal: {spec!r} streams; open it with data.hub.open_stream")
        return open_downloaded(spec, split, data_dir=data_dir, field=text_key)
    import tensorflow_datasets as tfds

    from transformers_jax.data.local_text import prepare_local_text, quiet_tfds

    prepared = prepare_local_text(parsed.name, parsed.unit, data_dir)
    with quiet_tfds():
        source = tfds.data_source(prepared.name, split=split, data_dir=prepared.data_dir)
    info = SourceInfo(spec or "default", "local", prepared.name, split, prepared.data_dir, "text")
    return TextSource(source, "text", info)


# ----------------------------------------------------------------------------- pieces


def _cut_points(data: bytes, max_bytes: int) -> list[int]:
    """Cut ``data`` into pieces of at most ``max_bytes``, after a newline when one lies in the
    second half of the window, else at a UTF-8 character boundary."""
    cuts, start, n = [0], 0, len(data)
    while n - start > max_bytes:
        end = start + max_bytes
        nl = data.rfind(b"\n", start + max_bytes // 2, end)
        if nl >= 0:
            end = nl + 1
        else:
            while end > start + 1 and (data[end] & 0xC0) == 0x80:  # inside a character
                end -= 1
        cuts.append(end)
        start = end
    cuts.append(n)
    return cuts


class Documents:
    """Random-access pieces of a ``TextSource``: ``[i] -> Piece(text, first, last)``.

    Sources with at most ``10_000`` records are read once to cut long documents into pieces of
    at most ``max_piece_bytes``; larger sources are used record by record (their documents are
    usually short, and scanning them would take long). ``select`` keeps a contiguous range of
    pieces (the held-out tail, or the training head).
    """

    def __init__(
        self,
        source: TextSource,
        max_piece_bytes: int | None = 8192,
        select: slice | None = None,
    ):
        self.source = source
        self._index: np.ndarray | None = None  # [N, 3] int64: record, start, end
        if max_piece_bytes is not None and len(source) <= _SCAN_LIMIT:
            rows, lengths = [], []
            for r in range(len(source)):
                data = source[r]
                cuts = _cut_points(data, max_piece_bytes)
                rows.extend((r, a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True))
                lengths.append(len(data))
            self._index = np.asarray(rows, np.int64).reshape(-1, 3)
            self._lengths = np.asarray(lengths, np.int64)
        n = len(self._index) if self._index is not None else len(source)
        self._range = range(n)[select] if select is not None else range(n)
        self._cache = threading.local()

    def subset(self, select: slice) -> Documents:
        """The pieces ``select`` picks (indices into this object), sharing the scan."""
        other = copy.copy(self)
        other._range = self._range[select]
        other._cache = threading.local()
        return other

    def __len__(self) -> int:
        return len(self._range)

    def _record(self, r: int) -> bytes:
        cache = self._cache
        if getattr(cache, "r", None) != r:
            cache.r, cache.data = r, self.source[r]
        return cache.data

    def __getitem__(self, index: int) -> Piece:
        i = self._range[index]
        if self._index is None:
            return Piece(self.source[i], True, True)
        r, a, b = (int(v) for v in self._index[i])
        return Piece(self._record(r)[a:b], a == 0, b == self._lengths[r])

    def num_bytes(self) -> int:
        """Total bytes in these pieces (reads them all)."""
        return sum(len(self[i].text) for i in range(len(self)))

    def __repr__(self) -> str:
        return f"Documents({self.source!r}, {len(self)} pieces)"


def open_documents(
    spec: str | None,
    role: str = "train",
    *,
    val_fraction: float = 0.05,
    split: str | None = None,
    data_dir: str | None = None,
    text_key: str | None = None,
    unit: str | None = None,
    download: bool = False,
    max_piece_bytes: int | None = 8192,
) -> Documents:
    """The training (``role="train"``) or held-out (``role="eval"``) documents of ``spec``.

    ``split`` overrides the choice of split (a tfds split string such as ``"test[:10%]"``);
    then no piece is held out.
    """
    if role not in ROLES:
        raise ValueError(f"role={role!r}: valid choices: {', '.join(ROLES)}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}: must be in [0, 1)")
    parsed = parse_spec(spec, unit)
    if parsed.kind == "hf" and not download:
        raise DataSpecError(f"--data {spec!r} is streamed, and this needs random access to its "
                            "documents: add --data.download=true (the split is downloaded "
                            "once), or pass local parquet/jsonl files")
    kw = dict(data_dir=data_dir, text_key=text_key, unit=unit, download=download)
    if split is not None:
        return Documents(open_source(spec, split, **kw), max_piece_bytes)
    train_split = "train"
    if parsed.kind == "hf":
        from transformers_jax.data import hub

        train_split, splits = hub.parse_hub(spec).split or "train", hub.split_names(spec)
        held = next((s for s in ("validation", "test") if s in splits and s != train_split), None)
        if held is not None:
            return Documents(open_source(spec, held if role == "eval" else train_split, **kw),
                             max_piece_bytes)
    if parsed.kind == "tfds" and role == "eval":
        splits = available_splits(parsed.name, data_dir)
        for candidate in ("validation", "test"):
            if not splits or candidate in splits:  # no split list: not prepared, or a mock
                return Documents(open_source(spec, candidate, **kw), max_piece_bytes)
    if parsed.kind == "tfds" and role == "train":
        splits = available_splits(parsed.name, data_dir)
        if not splits or "validation" in splits or "test" in splits:
            return Documents(open_source(spec, "train", **kw), max_piece_bytes)
    # Hold out the last val_fraction of the pieces of the train split.
    docs = Documents(open_source(spec, train_split, **kw), max_piece_bytes)
    n = len(docs)
    n_val = max(1, round(n * val_fraction)) if val_fraction > 0 else 0
    if role == "eval" and n_val == 0:
        raise ValueError(f"{spec!r}: val_fraction=0 leaves no held-out text for evaluation")
    if n - n_val < 1:
        raise ValueError(
            f"{spec!r}: {n} piece(s) of text is too little to hold out {val_fraction:.0%} for "
            "evaluation (a piece is a document, or a part of a long one); use more text, or "
            f"one document per line with --data lines:{parsed.name}"
        )
    return docs.subset(slice(n - n_val, n) if role == "eval" else slice(0, n - n_val))
