"""Train / held-out splits drawn alike: random documents (or chunks) fixed by a seed.

The training loop's own split holds out the *last* pieces of a corpus, which for the default
corpus (pydoc topics in alphabetical order) is a different kind of text from the rest. Here
every unit (a document, or a chunk of at most 8 KiB when the corpus has fewer than
``MIN_DOCUMENTS`` documents, e.g. one-file tiny Shakespeare) is drawn at random, by ``seed``,
into the held-out set until it holds ``heldout_bytes`` (at most ``max_fraction`` of the
corpus). The training units are written to a folder of text files (one document per file,
consecutive training chunks of a document merged back into one), which is what the runs
train on (``TrainConfig.data``); the held-out text stays in memory for evaluation.

tfds catalog datasets that have a ``validation`` or ``test`` split already hold out text drawn
like the training split: those are used as they are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import sys
import tempfile

import numpy as np

from transformers_jax.data.leak import overlap  # noqa: F401  (sweep.plan reads it here)
from transformers_jax.data.sources import Documents, open_documents, open_source, parse_spec

MIN_DOCUMENTS = 100  # below this many documents, split by chunks
CHUNK_BYTES = 8192


def cache_root() -> str:
    return os.environ.get("TJAX_SPLIT_CACHE", os.path.join(tempfile.gettempdir(), "tjax_splits"))


@dataclasses.dataclass(frozen=True)
class Split:
    corpus: str  # the --data spec ("default" for the embedded corpus)
    sha256: str  # of the corpus bytes (local), or of the held-out text (tfds)
    seed: int
    unit: str  # "document", "chunk" or "tfds split"
    train_data: str  # what TrainConfig.data reads
    heldout: tuple[bytes, ...]
    train_units: int
    train_bytes: int
    # what a tfds dataset records about itself (``info.metadata``): for the research corpus
    # its source package and sha256s, duplicates removed and ``held_out_overlap`` per split
    dataset_metadata: dict | None = None

    def meta(self) -> dict:
        """What a result JSON records about its data."""
        out = {"corpus": self.corpus, "sha256": self.sha256, "split_seed": self.seed,
               "split_unit": self.unit, "train_units": self.train_units,
               "train_bytes": self.train_bytes, "heldout_units": len(self.heldout),
               "heldout_bytes": sum(len(t) for t in self.heldout)}
        if self.dataset_metadata:
            out["dataset_metadata"] = self.dataset_metadata
        return out

    def train_texts(self, max_bytes: int | None = None) -> list[bytes]:
        """The training text (for the n-gram baselines), at most ``max_bytes`` of it."""
        docs = open_documents(self.train_data, "train", val_fraction=0.0, max_piece_bytes=None)
        out, total = [], 0
        for i in range(len(docs)):
            out.append(docs[i].text)
            total += len(out[-1])
            if max_bytes is not None and total >= max_bytes:
                break
        return out


def environment() -> dict:
    """Versions a result depends on."""
    import jax

    return {"python": sys.version.split()[0], "jax": jax.__version__,
            "numpy": np.__version__, "platform": sys.platform}


def write_documents(folder: str, texts) -> None:
    """Write ``texts`` as one file each into ``folder`` (a folder ``TrainConfig.data`` reads),
    unless it exists: written under a temporary name, then renamed, so a reader never sees it
    half written."""
    if os.path.isdir(folder):
        return
    tmp = folder + f".tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    for k, text in enumerate(texts):
        with open(os.path.join(tmp, f"{k:06d}.txt"), "wb") as f:
            f.write(text)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process wrote the same folder first: same contents, keep it
        if not os.path.isdir(folder):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def make_split(spec: str | None, seed: int = 0, heldout_bytes: int = 200_000,
               max_fraction: float = 0.25, root: str | None = None) -> Split:
    """The split of ``spec`` for ``seed``: its training text is written once under ``root``
    (default ``cache_root()``), then read from there."""
    if not 0 < max_fraction < 1:
        raise ValueError(f"max_fraction={max_fraction}: must be in (0, 1)")
    parsed = parse_spec(spec)
    name = spec or "default"
    if parsed.kind == "tfds":
        held = open_documents(spec, "eval")
        if held.source.info.split != "train":  # a real validation/test split
            texts, total = [], 0
            for i in range(len(held)):
                texts.append(held[i].text)
                total += len(texts[-1])
                if total >= heldout_bytes:
                    break
            digest = hashlib.sha256(b"".join(texts)).hexdigest()
            return Split(name, digest, seed, f"tfds split {held.source.info.split}", spec,
                         tuple(texts), -1, -1, _dataset_metadata(held.source.info))
    source = open_source(spec, "train")
    records = [source[r] for r in range(len(source))]
    digest = hashlib.sha256()
    for r in records:
        digest.update(hashlib.sha256(r).digest())
    sha = digest.hexdigest()
    if len(records) >= MIN_DOCUMENTS:
        unit = "document"
        pieces = [(r, 0, len(data)) for r, data in enumerate(records)]
    else:
        unit = "chunk"
        docs = Documents(source, CHUNK_BYTES)
        pieces = [tuple(int(v) for v in row) for row in docs._index]
    sizes = np.array([b - a for _, a, b in pieces])
    budget = min(heldout_bytes, max_fraction * sizes.sum())
    order = np.random.default_rng(seed).permutation(len(pieces))
    held_mask = np.zeros(len(pieces), bool)
    total = 0
    for i in order:
        if total >= budget:
            break
        if total + sizes[i] > budget and total > 0:
            continue  # a smaller unit may still fit
        held_mask[i] = True
        total += sizes[i]
    if held_mask.all():
        raise ValueError(f"{name!r} is too small to hold out text and still train")
    held_idx = sorted(np.flatnonzero(held_mask))
    heldout = tuple(records[pieces[i][0]][pieces[i][1] : pieces[i][2]] for i in held_idx)
    folder = os.path.join(root or cache_root(),
                          f"{sha[:16]}-{unit}-seed{seed}-held{int(budget)}")
    files = _train_files(records, pieces, held_mask)
    write_documents(folder, files)
    return Split(name, sha, seed, unit, folder, heldout, len(files), sum(map(len, files)))


def _dataset_metadata(info) -> dict | None:
    """The tfds builder's own ``info.metadata`` as plain JSON values (None when it has none,
    as most catalog datasets)."""
    import json

    from transformers_jax.data.sources import tfds_builder

    metadata = tfds_builder(info.name, info.data_dir).info.metadata
    if not metadata:
        return None
    return json.loads(json.dumps(dict(metadata), default=str))


def _train_files(records, pieces, held_mask) -> list[bytes]:
    """Training text per file: runs of consecutive training pieces of one record, merged."""
    files, current, last = [], [], None
    for i, (r, a, b) in enumerate(pieces):
        if held_mask[i]:
            if current:
                files.append(b"".join(current))
            current, last = [], None
            continue
        if last is not None and last != r and current:
            files.append(b"".join(current))
            current = []
        current.append(records[r][a:b])
        last = r
    if current:
        files.append(b"".join(current))
    return [f for f in files if f.strip()]
