"""Text sources: tfds catalog datasets (mocked), the local-text tfds builder, documents."""

import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from transformers_jax.data import local_text
from transformers_jax.data.corpus import default_corpus, default_documents
from transformers_jax.data.local_text import prepare_local_text
from transformers_jax.data.pipeline import make_lm_iterator
from transformers_jax.data.sources import (
    KNOWN_TEXT_DATASETS,
    DatasetNotPreparedError,
    Documents,
    UnknownDatasetError,
    open_documents,
    open_source,
)
from transformers_jax.data.tokenizers import ByteTokenizer


@pytest.fixture
def mock_tfds():
    with tfds.testing.mock_data(num_examples=12, policy=tfds.testing.MockPolicy.USE_CODE):
        yield


@pytest.fixture
def text_dir(tmp_path):
    root = tmp_path / "texts"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"first line\nsecond line\n\n   \r\nthird\r\n")
    (root / "sub" / "b.md").write_bytes("zweite Datei: grüße\n".encode())
    (root / "sub" / "c.bin").write_bytes(b"\xff\xfe not utf-8 \xc3")  # kept byte for byte
    (root / ".hidden").write_bytes(b"skipped")
    return root


def test_catalog_datasets_through_data_source(mock_tfds):
    for name in ("imdb_reviews", "lm1b", "tiny_shakespeare"):
        source = open_source(f"tfds:{name}", "train")
        assert len(source) == 12 and source.text_key == "text"
        assert all(isinstance(source[i], bytes) and source[i] for i in range(len(source)))
    # the single Text feature is found when it is not called "text"
    assert open_source("tfds:pg19", "train").text_key == "book_text"
    with pytest.raises(ValueError, match="several text fields .description, title.*--data.field"):
        open_source("tfds:ag_news_subset", "train")
    assert open_source("tfds:ag_news_subset", "train", text_key="title").text_key == "title"
    with pytest.raises(ValueError, match=r"not a field.*label \(ClassLabel\), text \(Text\)"):
        open_source("tfds:imdb_reviews", "train", text_key="body")


def test_catalog_dataset_feeds_the_lm_pipeline(mock_tfds):
    it = make_lm_iterator("tfds:lm1b", ByteTokenizer(), 32, 4, seed=0, shard=(0, 1))
    batch = next(it)
    assert batch["inputs"].shape == (4, 32) and batch["weights"].sum() > 0
    eval_it = make_lm_iterator("tfds:lm1b", ByteTokenizer(), 32, 4, shard=(0, 1), role="eval")
    assert next(eval_it)["inputs"].shape == (4, 32)


def test_unprepared_and_unknown_datasets_say_what_to_do(tmp_path):
    with pytest.raises(DatasetNotPreparedError) as err:
        open_source("tfds:tiny_shakespeare", "train", data_dir=str(tmp_path))
    message = str(err.value)
    assert "not prepared" in message and str(tmp_path) in message
    assert "tfds build tiny_shakespeare" in message and "array_record" in message
    # the command line's flags are named (the Python arguments beside them)
    assert "--train.data_dir=DIR" in message and "--train.data_download=true" in message
    with pytest.raises(UnknownDatasetError, match="tiny_shakespeare") as err:
        open_source("tfds:tiny_shakespear", "train", data_dir=str(tmp_path))
    assert "Did you mean" in str(err.value)
    assert all(name in str(err.value) for name in KNOWN_TEXT_DATASETS)


def test_local_builder_round_trip_per_file_and_per_line(text_dir, tmp_path):
    data_dir = str(tmp_path / "data")
    prepared = prepare_local_text(str(text_dir), "file", data_dir)
    source = tfds.data_source(prepared.name, split="train", data_dir=prepared.data_dir)
    files = sorted(p for p in text_dir.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert [r["text"] for r in source] == [p.read_bytes() for p in files]
    assert prepared.num_documents == 3

    lines = prepare_local_text(str(text_dir / "*.txt"), "line", data_dir)
    source = open_source(f"lines:{text_dir / '*.txt'}", "train", data_dir=data_dir)
    assert [source[i] for i in range(len(source))] == [b"first line", b"second line", b"third"]
    assert lines.key != prepared.key


def test_local_builder_is_cached_by_content(text_dir, tmp_path, monkeypatch, capfd):
    data_dir = str(tmp_path / "data")
    first = prepare_local_text(str(text_dir), "file", data_dir)
    # one line on stderr says what happens (tfds announced a download of "Unknown size")
    out, err = capfd.readouterr()
    assert out == "" and "Downloading" not in err and "Unknown size" not in err
    assert f"preparing local text once ({len(os.listdir(text_dir))} files ->" in err

    def fail(self):
        raise AssertionError("prepared again")

    monkeypatch.setattr(local_text.TjaxLocalText, "_generate_examples", fail)
    assert prepare_local_text(str(text_dir), "file", data_dir) == first  # no rebuild
    monkeypatch.undo()
    (text_dir / "a.txt").write_bytes(b"changed")
    changed = prepare_local_text(str(text_dir), "file", data_dir)
    assert changed.key != first.key
    assert open_source(str(text_dir), data_dir=data_dir)[0] == b"changed"


def test_default_corpus_goes_through_the_builder(tmp_path):
    source = open_source(None, "train", data_dir=str(tmp_path))
    documents = default_documents()
    assert len(source) == len(documents) > 50
    texts = [source[i] for i in range(len(source))]
    assert texts == [text.encode() for _, text in documents]
    assert b"\n\n".join(texts) == default_corpus().encode()


def test_local_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        prepare_local_text(str(tmp_path / "missing.txt"), data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="matched no files"):
        prepare_local_text(str(tmp_path / "*.nothing"), data_dir=str(tmp_path))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        prepare_local_text(str(tmp_path / "empty.txt"), data_dir=str(tmp_path / "d"))
    (tmp_path / "blank.txt").write_bytes(b" \n\n \n")
    with pytest.raises(ValueError, match="empty"):
        prepare_local_text(str(tmp_path / "blank.txt"), "line", data_dir=str(tmp_path / "d"))
    with pytest.raises(ValueError, match="valid choices: file, line"):
        prepare_local_text(str(tmp_path / "blank.txt"), "paragraph", data_dir=str(tmp_path))


def test_documents_cut_long_texts_and_hold_out_the_tail(tmp_path):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "délta", "ε"]
    text = "".join(
        " ".join(rng.choice(words, rng.integers(1, 30))) + "\n" for _ in range(3000)
    ).encode()
    (tmp_path / "one.txt").write_bytes(text)
    spec, data_dir = str(tmp_path / "one.txt"), str(tmp_path / "data")
    docs = open_documents(spec, "train", val_fraction=0.0, data_dir=data_dir, max_piece_bytes=1000)
    pieces = [docs[i] for i in range(len(docs))]
    assert len(pieces) > 100 and all(len(p.text) <= 1000 for p in pieces)
    assert b"".join(p.text for p in pieces) == text  # nothing lost, nothing repeated
    assert all(p.text.decode() for p in pieces)  # cuts fall on character boundaries
    assert [p.first for p in pieces] == [True] + [False] * (len(pieces) - 1)
    assert [p.last for p in pieces] == [False] * (len(pieces) - 1) + [True]

    kw = dict(val_fraction=0.1, data_dir=data_dir, max_piece_bytes=1000)
    train, held = open_documents(spec, "train", **kw), open_documents(spec, "eval", **kw)
    assert len(held) == round(0.1 * len(pieces)) and len(train) + len(held) == len(pieces)
    assert [train[i] for i in range(len(train))] + [held[i] for i in range(len(held))] == pieces
    assert isinstance(train, Documents) and os.path.isdir(data_dir)


def test_a_binary_file_among_the_text_gets_a_note(tmp_path, capfd):
    """Files are read as bytes, so a binary one is accepted: with a note naming it, once."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("plain text\n")
    (tmp_path / "docs" / "b.bin").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    prepare_local_text(str(tmp_path / "docs"), "file", str(tmp_path / "data"))
    err = capfd.readouterr().err
    assert "note: 1 of 2 files look binary (NUL bytes; e.g. " in err and "b.bin" in err
    prepare_local_text(str(tmp_path / "docs"), "file", str(tmp_path / "data"))  # reused
    assert "binary" not in capfd.readouterr().err
