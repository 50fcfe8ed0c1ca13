"""The kernel-source research corpus (tjax_linux_source) on a tiny fake package: checksum,
split by path, duplicates across the splits, the leak measure, and reading it as --data."""

import io
import itertools
import json
import shutil
import tarfile

import numpy as np
import pytest

from transformers_jax import cli
from transformers_jax.data import linux_source as ls
from transformers_jax.data.leak import overlap
from transformers_jax.data.sources import DatasetNotPreparedError, open_documents

ROOT = "linux-source-6.1/"


def _words(seed: int, n: int) -> bytes:
    rng = np.random.default_rng(seed)
    letters = rng.integers(97, 123, size=(n, 6), dtype=np.uint8)
    return b" ".join(bytes(w) for w in letters) + b"\n"


def _named(pattern: str, split: str, k: int) -> list[str]:
    """The first ``k`` paths ``pattern.format(i)`` that the path hash puts in ``split``."""
    found = (pattern.format(i) for i in itertools.count())
    return list(itertools.islice((p for p in found if ls.split_of(p) == split), k))


def _tar(files: dict[str, bytes], mode: str = "w:xz") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _ar(members: dict[str, bytes]) -> bytes:
    out = [b"!<arch>\n"]
    for name, data in members.items():
        out.append(f"{name:<16}{0:<12}{0:<6}{0:<6}{644:<8}{len(data):<10}`\n".encode())
        out.append(data + (b"\n" if len(data) % 2 else b""))
    return b"".join(out)


@pytest.fixture(scope="module")
def tree():
    """``(files, roles)``: the fake tree's files and which held-out file plays which part."""
    val_docs = _named("Documentation/v{}.rst", "validation", 4)
    test_docs = _named("Documentation/t{}.rst", "test", 2)
    held_c = _named("kernel/h{}.c", "validation", 1) + _named("kernel/h{}.c", "test", 1)
    train = _named("Documentation/train{}.rst", "train", 9)
    base, shared = _words(1, 300), _words(2, 40)
    files = {path: _words(100 + i, 200) for i, path in enumerate(train[:8])}
    files[train[0]] = base
    files[train[8]] = files[train[1]]  # an exact duplicate within train
    files["Documentation/ABI/testing/sysfs-x"] = _words(3, 50)  # no suffix: docs all the same
    files[train[2]] += shared
    files[val_docs[0]] = b"  " + base.replace(b" ", b"\n ")  # exact up to whitespace
    files[val_docs[1]] = base.replace(base[600:606], b"zzzzzz")  # near duplicate
    files[val_docs[2]] = _words(4, 400) + shared  # a passage copied from train2
    files[val_docs[3]] = _words(5, 300)  # its own text
    files[test_docs[0]] = _words(6, 300)
    files[test_docs[1]] = _words(7, 100)
    files["Documentation/image.svg"] = b"<svg/>"  # not a docs file
    files["kernel/fork.c"] = b"// SPDX-License-Identifier: GPL-2.0\n" + _words(8, 300)
    files["drivers/net/x.c"] = _words(9, 50)  # drivers/ is left out
    for i, path in enumerate(held_c):
        files[path] = _words(20 + i, 200)
    files["kernel/empty.c"] = b"\n\n"
    files = {ROOT + k: v for k, v in files.items()}
    roles = {"exact": val_docs[0], "near": val_docs[1], "contained": val_docs[2],
             "own": val_docs[3], "test": test_docs, "c": held_c}
    return files, roles


@pytest.fixture(scope="module")
def deb(tree, tmp_path_factory):
    folder = tmp_path_factory.mktemp("deb")
    data = _tar({"./usr/src/linux-source-6.1.tar.xz": _tar(tree[0])})
    path = folder / "linux-source-6.1_6.1.176-1_all.deb"
    path.write_bytes(_ar({"debian-binary": b"2.0\n", "control.tar.xz": _tar({}),
                          "data.tar.xz": data}))
    return str(path)


@pytest.fixture(scope="module")
def prepared(deb, tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("data"))
    sha = ls.sha256_file(deb)
    manifests = {c: ls.prepare(c, data_dir, deb=deb, sha256=sha) for c in ("docs", "c")}
    return data_dir, manifests


def test_a_checksum_mismatch_names_both_sums_and_the_override(deb, tmp_path):
    got = ls.sha256_file(deb)
    with pytest.raises(ls.ChecksumError) as err:
        ls.prepare("docs", str(tmp_path), deb=deb)
    message = str(err.value)
    assert got in message and ls.DEB_SHA256 in message and "--sha256" in message
    assert not (tmp_path / "tjax_linux_source").exists()
    # the command line says the same, as an error, not a traceback
    assert cli.main(["corpus", "linux-source", "--config", "docs", "--deb", deb,
                     "--data-dir", str(tmp_path)]) == 2


def test_without_apt_get_the_error_says_pass_deb(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="--deb PATH"):
        ls.download_deb(str(tmp_path))


def test_split_by_file_path_deterministic():
    assert ls.split_of("kernel/fork.c") == ls.split_of("kernel/fork.c") == "train"
    paths = [f"fs/f{i}.c" for i in range(20_000)]
    splits = [ls.split_of(p) for p in paths]
    share = {s: splits.count(s) / len(splits) for s in ls.SPLITS}
    assert abs(share["validation"] - 0.02) < 0.004 and abs(share["test"] - 0.02) < 0.004
    assert ls.domain_of("Documentation/ABI/testing/sysfs-x") == "docs"
    assert ls.domain_of("Documentation/a.svg") is None and ls.domain_of("arch/x86/a.c") is None
    assert ls.domain_of("include/linux/sched.h") == "c"


def test_duplicates_never_straddle_train_and_held_out(tree, deb, prepared):
    files, roles = tree
    data_dir, manifests = prepared
    docs = manifests["docs"]
    read = {s: {open_documents("tfds:tjax_linux_source/docs", split=s, data_dir=data_dir,
                               max_piece_bytes=None)[i].text
                for i in range(docs["splits"][s]["docs"]["files"])} for s in ls.SPLITS}
    assert files[ROOT + roles["own"]] in read["validation"]
    assert files[ROOT + roles["exact"]] not in read["validation"]  # removed: train has it
    assert files[ROOT + roles["near"]] not in read["validation"]  # removed: near train0
    assert files[ROOT + roles["contained"]] in read["train"]  # moved: shares a passage
    assert {files[ROOT + p] for p in roles["test"]} == read["test"]
    assert docs["exact_duplicates_removed"] == {"train": 1, "validation": 1, "test": 0}
    assert docs["near_duplicates_removed"] == {"train": 0, "validation": 1, "test": 0}
    assert docs["moved_to_train"]["validation"][0] == 1
    assert docs["held_out_overlap_before_moving"]["validation"] > 0.02
    assert docs["files_skipped"] == {} and manifests["c"]["files_skipped"] == {"empty": 1}
    assert docs["splits"]["train"]["docs"]["files"] == 10  # 8 + ABI + the moved one
    assert manifests["c"]["splits"]["validation"]["c"]["files"] == 1
    # the measure recorded equals the measure of what is read back; ours is clean text
    for split in ("validation", "test"):
        share = overlap(read["train"], read[split], 64)["share"]
        assert docs["held_out_overlap"][split] == pytest.approx(share)
        assert share < 0.01
    assert set(docs["split_sha256"]) == set(ls.SPLITS)
    assert docs["source"]["deb_sha256"] == ls.sha256_file(deb)


def test_held_out_overlap_by_hand():
    # windows of 3 bytes: held "abcxyz" has abc bcx cxy xyz, "cdefgh" has cde def efg fgh;
    # training "abcdef" holds abc, cde, def: 3 of 8
    result = overlap([b"abcdef"], [b"abcxyz", b"cdefgh", b"ab"], 3)
    assert result == {"window_bytes": 3, "heldout_windows": 8, "found_in_training": 3,
                      "share": 3 / 8}
    # a window never spans two documents, training or held-out
    assert overlap([b"ab", b"cd"], [b"bcd"], 3)["found_in_training"] == 0
    assert overlap([b"abcd"], [b"ab", b"cd"], 3)["heldout_windows"] == 0


@pytest.mark.slow
def test_read_as_data_and_by_default_data_dir(prepared, monkeypatch, tmp_path, capsys):
    data_dir, manifests = prepared
    monkeypatch.setenv("TJAX_DATA_DIR", data_dir)  # where tjax corpus puts it by default
    train = open_documents("tfds:tjax_linux_source/docs", "train")
    held = open_documents("tfds:tjax_linux_source/docs", "eval")
    assert held.source.info.split == "validation"
    assert len(train) >= 10 and all(train[i].text for i in range(len(train)))
    # a sweep scores the validation split and records what the corpus measured of it
    from transformers_jax.study.splits import make_split

    split = make_split("tfds:tjax_linux_source/docs", heldout_bytes=10**9)
    assert split.unit == "tfds split validation"
    assert split.heldout == tuple(held[i].text for i in range(len(held)))
    recorded = split.meta()["dataset_metadata"]
    assert recorded["held_out_overlap"] == manifests["docs"]["held_out_overlap"]
    json.dumps(recorded)  # plain JSON, as results.json holds it
    from transformers_jax.sweep.report import recorded_overlap

    share = manifests["docs"]["held_out_overlap"]["validation"]
    assert f"validation {share:.2%}" in recorded_overlap(split.meta())
    assert recorded_overlap({}) == ""
    # prepared already: the command prints the manifest without fetching anything
    assert cli.main(["corpus", "linux-source", "--config", "docs,c"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["docs"]["held_out_overlap"] == manifests["docs"]["held_out_overlap"]
    monkeypatch.setenv("TJAX_DATA_DIR", str(tmp_path))
    with pytest.raises(DatasetNotPreparedError, match="tjax corpus linux-source --config c"):
        open_documents("tfds:tjax_linux_source/c", "train", split="train")
