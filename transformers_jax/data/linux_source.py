"""Debian's Linux kernel source as a research corpus that cannot leak: ``tjax_linux_source``.

The text is the kernel tree in Debian's ``linux-source-6.1`` package, pinned by version and
sha256, so anyone with Debian's package archive (or the ``.deb`` itself) builds the same
corpus. Two domains, one document per file:

- ``docs``: the prose under ``Documentation/`` (``*.rst``, ``*.txt`` and the ``ABI/`` entries);
- ``c``: the C source (``*.c``, ``*.h``) outside ``Documentation/``, ``drivers/`` and ``arch/``
  (the core kernel, file systems, networking, sound, headers, tools); ``drivers/`` and
  ``arch/`` hold five times as much again, largely generated register tables.

Builder configs ``docs``, ``c`` and ``all`` (both). Each file goes to ``train``, ``validation``
or ``test`` by a hash of its path in the tree (2% each held out), so the split does not depend
on the order of the archive or on the other files. Then duplicates are removed across the
splits: files equal up to whitespace keep one copy (a training one where there is one), and a
held-out file whose word 5-gram set has a MinHash Jaccard estimate of at least 0.8 with a
training file (or, for ``test``, a kept ``validation`` file) is dropped. The leak left over is
measured: ``held_out_overlap``, the share of a held-out split's 64-byte windows found verbatim
in ``train``. Everything the build counted is kept in the prepared dataset's
``info.metadata`` (see ``manifest``).

``tjax corpus linux-source`` fetches the package with ``apt-get download``, checks its
sha256 and prepares the dataset; ``--data tfds:tjax_linux_source/docs`` then reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterable, Iterator

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from transformers_jax.data.leak import found_per_text, train_index, window_hashes
from transformers_jax.data.local_text import default_data_dir, quiet_tfds

BUILDER_NAME = "tjax_linux_source"
PACKAGE = "linux-source-6.1"
VERSION = "6.1.176-1"  # bookworm's point release
DEB_SHA256 = "9305d1a151b8e83dcb88aa11361e7b9513f0c252bdf7f5647e4542762d99c094"
TARBALL = "usr/src/linux-source-6.1.tar.xz"  # the kernel tree, inside the package
TARBALL_SHA256 = "78cb82f50374e337d973c32ebf60d16e162589e45032db30f7a0d5295272de5e"

SPLITS = ("train", "validation", "test")
HELD_OUT_PER_10K = {"validation": 200, "test": 200}  # files per 10,000, by path hash
WINDOW = 64  # bytes: held_out_overlap's window
NEAR_DUP_JACCARD = 0.8
SHINGLE_WORDS = 5
NUM_PERM = 128
MAX_FILE_OVERLAP = 0.02  # a held-out file sharing more of its windows with train moves there
DOMAINS = ("docs", "c")
CONFIGS = {"docs": ("docs",), "c": ("c",), "all": DOMAINS}


class ChecksumError(ValueError):
    """A downloaded or given file is not the one pinned by sha256."""


# ----------------------------------------------------------------------------- the source


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sha256(path: str, expected: str, what: str) -> str:
    """The sha256 of ``path``, or a ``ChecksumError`` when it is not ``expected``."""
    got = sha256_file(path)
    if got != expected.lower():
        raise ChecksumError(
            f"{path}: sha256 {got}, expected {expected} ({what}). The file is not the pinned "
            "one: a different version, or a damaged download. Fetch it again, or pass "
            f"--sha256 {got} to build from this file knowingly (its sha256 goes into the "
            "manifest)."
        )
    return got


def download_deb(cache_dir: str, version: str = VERSION) -> str:
    """``apt-get download`` the package into ``cache_dir`` (once) and return its path."""
    path = os.path.join(cache_dir, f"{PACKAGE}_{version}_all.deb")
    if os.path.exists(path):
        return path
    if shutil.which("apt-get") is None:
        raise FileNotFoundError(
            f"apt-get is not on this machine, so {PACKAGE}={version} cannot be fetched from "
            "Debian's package archive here. Download the .deb where apt works (apt-get "
            f"download {PACKAGE}={version}) and pass it with --deb PATH, or pass the kernel "
            "tree's tar.xz with --tarball PATH."
        )
    os.makedirs(cache_dir, exist_ok=True)
    result = subprocess.run(["apt-get", "download", f"{PACKAGE}={version}"], cwd=cache_dir,
                            capture_output=True, text=True)
    if result.returncode != 0 or not os.path.exists(path):
        raise FileNotFoundError(
            f"apt-get download {PACKAGE}={version} failed ({result.stderr.strip()[-400:]}). "
            "Run `apt-get update` first; if Debian's package archive no longer holds this "
            f"version, see `apt-cache policy {PACKAGE}` and pass --version V --sha256 S, or "
            "pass a .deb with --deb PATH."
        )
    return path


def _ar_members(data: bytes) -> Iterator[tuple[str, bytes]]:
    """The members of an ``ar`` archive (a ``.deb`` is one): ``(name, bytes)``."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not a .deb: an ar archive starts with '!<arch>'")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        yield name, data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)  # members are aligned to two bytes


def tarball_from_deb(deb: str, out_dir: str) -> str:
    """Extract the kernel tree's tar.xz from the package ``deb`` into ``out_dir`` (once)."""
    out = os.path.join(out_dir, os.path.basename(deb).removesuffix(".deb") + ".tar.xz")
    if os.path.exists(out):
        return out
    with open(deb, "rb") as f:
        members = dict(_ar_members(f.read()))
    data_name = next((n for n in members if n.startswith("data.tar")), None)
    if data_name is None:
        raise ValueError(f"{deb}: no data.tar member (members: {', '.join(members)})")
    with tarfile.open(fileobj=io.BytesIO(members.pop(data_name)), mode="r:*") as tar:
        member = next((m for m in tar if m.name.lstrip("./") == TARBALL), None)
        if member is None:
            raise ValueError(f"{deb}: no {TARBALL} inside; is it the {PACKAGE} package?")
        os.makedirs(out_dir, exist_ok=True)
        with tar.extractfile(member) as src, open(out + ".tmp", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(out + ".tmp", out)
    return out


# ----------------------------------------------------------------------------- the files


def domain_of(path: str) -> str | None:
    """``docs``, ``c`` or None for a path inside the tree (``kernel/fork.c``)."""
    name = path.rsplit("/", 1)[-1]
    if path.startswith("Documentation/"):
        if name.endswith((".rst", ".txt")) or (path.startswith("Documentation/ABI/")
                                               and "." not in name):
            return "docs"
        return None
    if name.endswith((".c", ".h")) and not path.startswith(("drivers/", "arch/")):
        return "c"
    return None


def split_of(path: str) -> str:
    """The split of a file, by a hash of its path in the tree: stable under any change to
    the other files."""
    bucket = int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "little")
    bucket %= 10_000
    for name in ("validation", "test"):
        if bucket < HELD_OUT_PER_10K[name]:
            return name
        bucket -= HELD_OUT_PER_10K[name]
    return "train"


@dataclasses.dataclass
class SourceFile:
    path: str  # inside the tree, e.g. "kernel/fork.c"
    domain: str
    text: bytes
    split: str = ""

    def __post_init__(self):
        self.split = self.split or split_of(self.path)


def read_tree(tarball: str, domains: Iterable[str], skipped: dict | None = None
              ) -> list[SourceFile]:
    """The files of ``domains`` in the kernel tree ``tarball``, sorted by path. Files that are
    not UTF-8 text, or have no text, are skipped (counted in ``skipped``)."""
    domains, files = set(domains), []
    skipped = {} if skipped is None else skipped
    with tarfile.open(tarball, mode="r|*") as tar:
        for member in tar:
            if not member.isfile() or "/" not in member.name:
                continue
            path = member.name.split("/", 1)[1]
            domain = domain_of(path)
            if domain not in domains:
                continue
            data = tar.extractfile(member).read()
            reason = _unusable(data)
            if reason:
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            files.append(SourceFile(path, domain, data))
    files.sort(key=lambda f: f.path)
    return files


def _unusable(data: bytes) -> str | None:
    if not data.strip():
        return "empty"
    if b"\0" in data:
        return "binary"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "not_utf8"
    return None


# ----------------------------------------------------------------------------- duplicates


def _normalised(text: bytes) -> bytes:
    return b" ".join(text.split())


def _minhash(text: bytes):
    from datasketch import MinHash

    words = text.split()
    n = max(1, len(words) - SHINGLE_WORDS + 1)
    m = MinHash(num_perm=NUM_PERM)
    m.update_batch([b" ".join(words[i : i + SHINGLE_WORDS]) for i in range(n)])
    return m


def deduplicate(files: list[SourceFile]) -> tuple[list[SourceFile], dict]:
    """The files left after removing duplicates across (and exact ones within) the splits,
    and the counts removed.

    Exact: files equal up to whitespace keep one copy, the first by split (train, then
    validation, then test) and path. Near: a validation file whose MinHash Jaccard estimate
    with a training file is at least ``NEAR_DUP_JACCARD`` is dropped, and a test file near a
    training or a kept validation file.
    """
    from datasketch import MinHashLSH

    rank = {s: i for i, s in enumerate(SPLITS)}
    seen: dict[bytes, SourceFile] = {}
    exact = {s: 0 for s in SPLITS}
    for f in sorted(files, key=lambda f: (rank[f.split], f.path)):
        key = hashlib.blake2b(_normalised(f.text), digest_size=16).digest()
        if key in seen:
            exact[f.split] += 1
        else:
            seen[key] = f
    kept = sorted(seen.values(), key=lambda f: (rank[f.split], f.path))
    lsh = MinHashLSH(threshold=NEAR_DUP_JACCARD, num_perm=NUM_PERM)
    near = {s: 0 for s in SPLITS}
    out, hashes = [], {}
    for i, f in enumerate(kept):
        m = _minhash(f.text)
        if f.split != "train" and any(m.jaccard(hashes[k]) >= NEAR_DUP_JACCARD
                                      for k in lsh.query(m)):
            near[f.split] += 1
            continue
        if f.split != "test":  # what later held-out files are compared with
            lsh.insert(i, m)
            hashes[i] = m
        out.append(f)
    out.sort(key=lambda f: f.path)
    return out, {"exact_duplicates_removed": exact, "near_duplicates_removed": near}


def decontaminate(files: list[SourceFile]) -> tuple[list[SourceFile], dict]:
    """Move to ``train`` each held-out file that shares more than ``MAX_FILE_OVERLAP`` of its
    ``WINDOW``-byte windows verbatim with the training files (a passage copied, a table or a
    driver written from another, which a Jaccard of 0.8 does not catch); then measure
    ``held_out_overlap`` per held-out split against the final training files.

    Returns the files (sorted by path) and ``{"moved_to_train": {split: [files, bytes]},
    "held_out_overlap": {split: share}, "held_out_windows": {...}, "found_in_train": {...},
    "held_out_overlap_before_moving": {split: share}}``.
    """
    index = train_index((f.text for f in files if f.split == "train"), WINDOW)
    held = [f for f in files if f.split != "train"]
    windows, found = found_per_text(index, (f.text for f in held), WINDOW)
    before = {s: [0, 0] for s in SPLITS[1:]}  # windows, found: the leak before moving
    moved = {s: [0, 0] for s in SPLITS[1:]}
    for f, n, k in zip(held, windows, found, strict=True):
        before[f.split][0] += int(n)
        before[f.split][1] += int(k)
        if n and k > MAX_FILE_OVERLAP * n:
            moved[f.split][0] += 1
            moved[f.split][1] += len(f.text)
            f.split = "train"
    new = window_hashes((f.text for f in held if f.split == "train"), WINDOW)[0]
    if new.size:
        index = np.sort(np.concatenate([index, new]))  # repeats do not matter to a lookup
    report = {"moved_to_train": moved, "held_out_overlap": {}, "held_out_windows": {},
              "found_in_train": {},
              "held_out_overlap_before_moving": {s: k / n if n else 0.0
                                                 for s, (n, k) in before.items()}}
    for split in SPLITS[1:]:
        windows, found = found_per_text(index, (f.text for f in held if f.split == split),
                                        WINDOW)
        n, k = int(windows.sum()), int(found.sum())
        report["held_out_windows"][split] = n
        report["found_in_train"][split] = k
        report["held_out_overlap"][split] = k / n if n else 0.0
    return sorted(files, key=lambda f: f.path), report


def split_sha256(files: Iterable[SourceFile]) -> str:
    """A split's identity: the sha256 over its files' paths and texts, in order."""
    h = hashlib.sha256()
    for f in files:
        for part in (f.path.encode(), f.text):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


def build_splits(tarball: str, domains: Iterable[str]) -> tuple[dict, dict]:
    """``{split: [SourceFile]}`` of the tree ``tarball`` and the manifest of how they were
    made (counts, bytes, duplicates removed, files moved, ``held_out_overlap``, sha256s)."""
    domains = tuple(domains)
    skipped: dict = {}
    files = read_tree(tarball, domains, skipped)
    read = len(files)
    files, removed = deduplicate(files)
    files, leak = decontaminate(files)
    splits = {s: [f for f in files if f.split == s] for s in SPLITS}
    stats = {
        s: {d: {"files": sum(f.domain == d for f in fs),
                "bytes": sum(len(f.text) for f in fs if f.domain == d)} for d in domains}
        for s, fs in splits.items()
    }
    manifest = {
        "domains": list(domains), "files_read": read, "files_skipped": skipped,
        "splits": stats, **removed,
        "near_duplicate": {"jaccard": NEAR_DUP_JACCARD, "shingle_words": SHINGLE_WORDS,
                           "num_perm": NUM_PERM},
        "max_file_overlap": MAX_FILE_OVERLAP, "window_bytes": WINDOW, **leak,
        "split_sha256": {s: split_sha256(fs) for s, fs in splits.items()},
    }
    return splits, manifest


# ----------------------------------------------------------------------------- the builder


class _Info(tfds.core.DatasetInfo):
    def initialize_from_bucket(self) -> None:
        """Nothing to fetch: not a catalog dataset with metadata on GCS."""


class TjaxLinuxSource(tfds.core.GeneratorBasedBuilder):
    """The kernel tree's documentation and C source, one example per file; see the module."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": f"{PACKAGE} {VERSION}, split by path hash, deduplicated."}
    BUILDER_CONFIGS = [
        tfds.core.BuilderConfig(name=name, description=" and ".join(domains))
        for name, domains in CONFIGS.items()
    ]

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:  # see local_text.TjaxLocalText.code_path
        return epath.Path(__file__)

    def __init__(self, *, tarball: str | None = None, source: dict | None = None, **kwargs):
        # tarball (the kernel tree) and source (what it came from) are needed only to prepare
        self._tarball, self._source = tarball, source or {}
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return _Info(
            builder=self,
            description=__doc__.split("\n\n")[0],
            features=tfds.features.FeaturesDict({
                "text": tfds.features.Text(), "path": tfds.features.Text(),
                "domain": tfds.features.Text()}),
            metadata=tfds.core.MetadataDict(),
            disable_shuffling=True,  # files in path order; the pipeline shuffles
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        if self._tarball is None:
            raise ValueError(f"{BUILDER_NAME} is not prepared: run `tjax corpus linux-source`")
        splits, manifest = build_splits(self._tarball, CONFIGS[self.builder_config.name])
        self.info.metadata.update({"source": self._source, **manifest})
        return {s: self._generate_examples(fs) for s, fs in splits.items()}

    def _generate_examples(self, files: list[SourceFile]):
        for f in files:
            yield f.path, {"text": f.text, "path": f.path, "domain": f.domain}


def manifest(config: str, data_dir: str | None = None) -> dict:
    """What the prepared ``config`` records about itself (``{}`` when it is not prepared)."""
    builder = TjaxLinuxSource(config=config, data_dir=data_dir or default_data_dir())
    if not builder.is_prepared():
        return {}
    return {"dataset": f"{BUILDER_NAME}/{config}", "data_dir": builder.data_dir,
            **dict(builder.info.metadata)}


def prepare(
    config: str = "all",
    data_dir: str | None = None,
    *,
    deb: str | None = None,
    tarball: str | None = None,
    sha256: str | None = None,
    version: str = VERSION,
    cache_dir: str | None = None,
) -> dict:
    """Fetch (``apt-get download``) or take the source, check its sha256, prepare ``config``
    into ``data_dir`` (default ``default_data_dir()``) unless it is there, and return its
    manifest.

    ``deb``: the package file; ``tarball``: the kernel tree's tar.xz itself. ``sha256``
    overrides the pinned sha256 of whichever is given (the ``.deb`` by default).
    """
    if config not in CONFIGS:
        raise ValueError(f"config={config!r}: valid choices: {', '.join(CONFIGS)}")
    data_dir = data_dir or default_data_dir()
    done = manifest(config, data_dir)
    if done:
        return done
    cache_dir = cache_dir or os.path.join(data_dir, "downloads")
    if tarball is not None:
        expected = sha256 or TARBALL_SHA256
        source = {"tarball": os.path.abspath(tarball),
                  "tarball_sha256": check_sha256(tarball, expected, f"{TARBALL} of {PACKAGE} "
                                                 f"{VERSION}" if sha256 is None else "--sha256")}
    else:
        if deb is None:
            deb = download_deb(cache_dir, version)
        pinned = sha256 or (DEB_SHA256 if version == VERSION else None)
        if pinned is None:
            raise ValueError(f"--version {version} has no pinned sha256 (only {VERSION}); pass "
                             f"--sha256 (see `apt-cache show {PACKAGE}={version}`)")
        what = f"{PACKAGE} {VERSION}" if sha256 is None else "--sha256"
        source = {"package": PACKAGE, "version": version, "deb": os.path.basename(deb),
                  "deb_sha256": check_sha256(deb, pinned, what)}
        tarball = tarball_from_deb(deb, cache_dir)
        source["tarball_sha256"] = sha256_file(tarball)
    builder = TjaxLinuxSource(tarball=tarball, source=source, config=config, data_dir=data_dir)
    with quiet_tfds(), contextlib.redirect_stdout(sys.stderr):
        builder.download_and_prepare()
    return manifest(config, data_dir)
