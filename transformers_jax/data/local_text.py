"""Local text as a real tfds dataset: files, folders or globs prepared offline into ArrayRecord.

``prepare_local_text(paths, unit)`` runs the ``tjax_local_text`` builder (a
``tfds.core.GeneratorBasedBuilder`` with ``file_format="array_record"``) into a data directory
keyed by a hash of the inputs (their paths and contents, the unit, the builder version), so a
second run with the same text reuses the prepared files and a changed file builds a new copy.
The result is read back like any catalog dataset: ``tfds.data_source("tjax_local_text/file",
split="train", data_dir=...)``. No TensorFlow is needed.

Units (builder configs): ``file`` gives one document per file, exactly its bytes; ``line`` gives
one document per non-blank line, without its line ending (``\\n`` or ``\\r\\n``). ``paths=None``
gives the embedded default corpus, one document per pydoc topic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import sys
from collections.abc import Iterator, Sequence

import tensorflow_datasets as tfds
from etils import epath

from transformers_jax.data.corpus import default_documents, expand_paths

BUILDER_NAME = "tjax_local_text"
UNITS = ("file", "line")
DATA_DIR_ENV = "TJAX_DATA_DIR"


def default_data_dir() -> str:
    """``$TJAX_DATA_DIR``, else ``~/.cache/transformers_jax/datasets``."""
    return os.environ.get(DATA_DIR_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "transformers_jax", "datasets"
    )


def _lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    for i, line in enumerate(data.split(b"\n")):
        line = line[:-1] if line.endswith(b"\r") else line
        if line.strip():
            yield i, line


class _LocalInfo(tfds.core.DatasetInfo):
    def initialize_from_bucket(self) -> None:
        """Nothing to fetch: tfds looks on GCS for the metadata of a catalog dataset not yet
        prepared, making (and leaving) an empty temporary folder each time; a local text has
        none there."""


class TjaxLocalText(tfds.core.GeneratorBasedBuilder):
    """Documents from local files (or given in memory); one ``train`` split, order preserved."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "First version."}
    BUILDER_CONFIGS = [
        tfds.core.BuilderConfig(name="file", description="one document per file"),
        tfds.core.BuilderConfig(name="line", description="one document per non-blank line"),
    ]

    # tfds looks for the module's source through importlib resources, which fails for an
    # editable install on Python >= 3.9 without the ``importlib_resources`` backport; the path is
    # known, so say it.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    def __init__(
        self,
        *,
        files: Sequence[str] = (),
        documents: Sequence[tuple[str, str | bytes]] | None = None,
        **kwargs,
    ):
        # files/documents are only needed to prepare; reading needs neither.
        self._files = list(files)
        self._documents = documents
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)

    # tfds announces a download ("Downloading and preparing dataset Unknown size ...") and its
    # end; nothing is downloaded here, so one line says what happens instead
    def _log_download_bytes(self) -> None:
        count = len(self._documents) if self._documents is not None else len(self._files)
        kind = "documents" if self._documents is not None else "files"
        print(f"preparing local text once ({count} {kind} -> {self.data_dir}); later runs "
              "reuse it", file=sys.stderr)

    def _log_download_done(self) -> None:
        pass

    def _info(self) -> tfds.core.DatasetInfo:
        return _LocalInfo(
            builder=self,
            description="Local text documents prepared by transformers_jax.",
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "source": tfds.features.Text()}
            ),
            disable_shuffling=True,  # keep the documents in file order
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        return {"train": self._generate_examples()}

    def _raw_documents(self) -> Iterator[tuple[str, bytes]]:
        if self._documents is not None:
            for name, text in self._documents:
                yield name, text.encode("utf-8") if isinstance(text, str) else bytes(text)
        else:
            binary = []
            for path in self._files:
                with open(path, "rb") as f:
                    data = f.read()
                if b"\0" in data[:8192]:  # text has no NUL bytes; images, archives, .pyc do
                    binary.append(path)
                yield path, data
            if binary:
                print(f"note: {len(binary)} of {len(self._files)} files look binary (NUL bytes; "
                      f"e.g. {binary[0]}): they are read as bytes like the text; give a glob "
                      "that leaves them out (--data 'docs/**/*.md') to train on text alone",
                      file=sys.stderr)

    def _generate_examples(self):
        n = 0
        for doc_index, (name, data) in enumerate(self._raw_documents()):
            if self.builder_config.name == "file":
                if data.strip():
                    n += 1
                    yield f"{doc_index:09d}", {"text": data, "source": name}
            else:
                for line_no, line in _lines(data):
                    n += 1
                    yield (
                        f"{doc_index:09d}:{line_no:09d}",
                        {
                            "text": line,
                            "source": f"{name}:{line_no + 1}",
                        },
                    )
        if n == 0:
            raise ValueError("the corpus is empty: no document has any text")


@dataclasses.dataclass(frozen=True)
class PreparedText:
    """Where a prepared local-text dataset lives: read it with ``tfds.data_source``."""

    name: str  # e.g. "tjax_local_text/file"
    data_dir: str
    num_documents: int
    key: str  # the hash of the inputs


@contextlib.contextmanager
def quiet_tfds():
    """Silence tfds progress bars and absl warnings (e.g. "Variant folder ... has no
    dataset_info.json", logged for every not-yet-prepared builder) inside the block."""
    from absl import logging as absl_logging
    from tensorflow_datasets.core.utils import tqdm_utils

    active, verbosity = tqdm_utils._active, absl_logging.get_verbosity()
    tqdm_utils._active = False
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        tqdm_utils._active = active
        absl_logging.set_verbosity(verbosity)


@contextlib.contextmanager
def _file_lock(path: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _inputs_key(unit: str, files: Sequence[str], documents) -> str:
    h = hashlib.blake2b(f"{BUILDER_NAME}|{TjaxLocalText.VERSION}|{unit}".encode(), digest_size=12)

    def add(name: str, data: bytes) -> None:
        for part in (name.encode("utf-8", "surrogateescape"), data):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)

    if documents is not None:
        for name, text in documents:
            add(name, text.encode("utf-8") if isinstance(text, str) else bytes(text))
    else:
        for path in files:
            with open(path, "rb") as f:
                add(os.path.abspath(path), f.read())
    return h.hexdigest()


def prepare_local_text(
    paths: str | Sequence[str] | None = None,
    unit: str = "file",
    data_dir: str | None = None,
    *,
    documents: Sequence[tuple[str, str | bytes]] | None = None,
) -> PreparedText:
    """Prepare (once) and locate the local-text dataset for ``paths``.

    ``paths``: a file, folder (recursive) or glob, or a list of them; None (and no
    ``documents``) means the default corpus. ``documents``: ``(name, text)`` pairs given in
    memory instead of files. The prepared copy goes to ``data_dir`` (default
    ``default_data_dir()``) under ``local_text/<hash>``; an existing copy is reused.
    """
    if unit not in UNITS:
        raise ValueError(f"unit={unit!r} is not known; valid choices: {', '.join(UNITS)}")
    files: list[str] = []
    if documents is None and paths is None:
        documents = default_documents()
    elif documents is None:
        for path in [paths] if isinstance(paths, str) else list(paths):
            found = expand_paths(path)
            if not found:
                raise FileNotFoundError(
                    f"--data {path!r} matched no files; pass a text file, a folder of text "
                    "files or a glob such as 'corpus/*.txt'"
                )
            files.extend(found)
        if not any(os.path.getsize(p) for p in files):
            raise ValueError(
                f"--data {paths!r}: the corpus is empty ({len(files)} file(s), no text)"
            )
    key = _inputs_key(unit, files, documents)
    root = os.path.join(data_dir or default_data_dir(), "local_text", key)
    with quiet_tfds():
        builder = _prepare(files, documents, root, unit, paths)
    n = builder.info.splits["train"].num_examples
    return PreparedText(name=f"{BUILDER_NAME}/{unit}", data_dir=root, num_documents=n, key=key)


def _prepare(files, documents, root: str, unit: str, paths) -> TjaxLocalText:
    builder = TjaxLocalText(files=files, documents=documents, data_dir=root, config=unit)
    if not builder.is_prepared():
        with _file_lock(os.path.join(root, ".lock")):
            builder = TjaxLocalText(files=files, documents=documents, data_dir=root, config=unit)
            if not builder.is_prepared():
                try:
                    # tfds prints its progress to stdout; keep stdout for the program's output
                    with contextlib.redirect_stdout(sys.stderr):
                        builder.download_and_prepare()
                except ValueError as e:
                    if "corpus is empty" in str(e):
                        raise ValueError(
                            f"--data {paths!r}: the corpus is empty: no document has any text "
                            f"(unit={unit!r})"
                        ) from None
                    raise
    return builder
