"""Local columnar files (parquet, jsonl, arrow, csv) as a source: the same documents whatever
the format, the text field chosen or refused by name, host shards, held-out tail, resume."""

import pytest

pytest.importorskip("datasets")  # the hf-data extra

import csv
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from resume_checks import assert_resumes_exactly

from transformers_jax.data.pipeline import make_lm_iterator
from transformers_jax.data.sources import (
    UnknownFieldError,
    UnreadableDataError,
    open_documents,
    parse_spec,
)
from transformers_jax.data.tokenizers import ByteTokenizer

BYTE = ByteTokenizer()
TEXTS = [f"row {i}: " + "abcdefghij"[i % 10] * (5 + i % 7) + ", ünïcode" for i in range(60)]


def write_all_formats(root, texts=TEXTS, column="text"):
    """The same rows (a text column, an int column) in each format this project reads."""
    ids = list(range(len(texts)))
    table = pa.table({"id": ids, column: texts})
    paths = {}
    paths["parquet"] = root / "rows.parquet"
    pq.write_table(table, paths["parquet"])
    paths["jsonl"] = root / "rows.jsonl"
    paths["jsonl"].write_text(
        "".join(json.dumps({"id": i, column: t}) + "\n" for i, t in zip(ids, texts, strict=True))
    )
    paths["csv"] = root / "rows.csv"
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", column])
        writer.writerows(zip(ids, texts, strict=True))
    paths["arrow"] = root / "rows.arrow"
    with pa.OSFile(str(paths["arrow"]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return {k: str(v) for k, v in paths.items()}


def one_pass(source, data_dir, **kw):
    it = make_lm_iterator(
        source,
        BYTE,
        24,
        4,
        shard=kw.pop("shard", (0, 1)),
        num_epochs=1,
        shuffle=False,
        data_dir=data_dir,
        **kw,
    )
    return list(it)


def test_every_format_gives_the_documents_a_list_of_texts_gives(tmp_path):
    paths = write_all_formats(tmp_path)
    data_dir = str(tmp_path / "cache")
    for path in paths.values():
        assert parse_spec(path).kind == "columnar"
        docs = open_documents(path, "train", val_fraction=0.0, data_dir=data_dir)
        assert [docs[i].text.decode() for i in range(len(docs))] == TEXTS, path
    # whole pipeline parity: the parquet file's batches are the list's batches, token for token
    expected = one_pass(TEXTS, data_dir)
    got = one_pass(paths["parquet"], data_dir, val_fraction=0.0)
    assert len(got) == len(expected) > 3
    for a, b in zip(expected, got, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    # a folder of them reads every file in sorted order; a glob picks one format
    assert parse_spec(str(tmp_path / "*.parquet")).files == (paths["parquet"],)


def test_the_text_field_is_chosen_or_refused_with_the_fields_listed(tmp_path):
    paths = write_all_formats(tmp_path, column="body")
    data_dir = str(tmp_path / "cache")
    # the only string column is taken without being named
    docs = open_documents(paths["jsonl"], "train", val_fraction=0.0, data_dir=data_dir)
    assert docs[3].text.decode() == TEXTS[3]
    with pytest.raises(
        UnknownFieldError,
        match=r"'title' is not a field.*id \(int64\), body "
        r"\(string\)",
    ):
        open_documents(paths["parquet"], "train", data_dir=data_dir, text_key="title")
    with pytest.raises(UnknownFieldError, match=r"holds int64, not text; its text fields: body"):
        open_documents(paths["parquet"], "train", data_dir=data_dir, text_key="id")
    two = tmp_path / "two.parquet"
    pq.write_table(pa.table({"a": ["x", "y"], "b": ["z", "w"]}), two)
    with pytest.raises(
        UnknownFieldError,
        match=r"several text fields \(a, b\); choose one with "
        r"--data.field=NAME",
    ):
        open_documents(str(two), "train", data_dir=data_dir)
    docs = open_documents(str(two), "train", val_fraction=0.0, data_dir=data_dir, text_key="b")
    assert [docs[i].text for i in range(2)] == [b"z", b"w"]


def test_unreadable_files_and_mixed_folders_are_refused_by_name(tmp_path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(UnreadableDataError, match=r"cannot read 1 \.parquet file.*broken\.parquet"):
        open_documents(str(bad), "train", data_dir=str(tmp_path / "cache"))
    lines = tmp_path / "bad.jsonl"
    lines.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(UnreadableDataError, match=r"bad\.jsonl.* as json"):
        open_documents(str(lines), "train", data_dir=str(tmp_path / "cache"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_all_formats(mixed)
    (mixed / "notes.txt").write_text("hello")
    with pytest.raises(
        UnreadableDataError,
        match=r"\.arrow, \.csv, \.jsonl, \.parquet files "
        r"and \.txt files; read one kind",
    ):
        parse_spec(str(mixed))
    only_text = tmp_path / "plain"
    only_text.mkdir()
    (only_text / "a.txt").write_text("text, not columns")
    assert parse_spec(str(only_text)).kind == "local"  # plain text is read as before


@pytest.mark.slow
def test_held_out_tail_host_shards_and_exact_resume(tmp_path):
    path = write_all_formats(tmp_path)["parquet"]
    data_dir = str(tmp_path / "cache")
    train = open_documents(path, "train", val_fraction=0.1, data_dir=data_dir)
    held = open_documents(path, "eval", val_fraction=0.1, data_dir=data_dir)
    assert [held[i].text.decode() for i in range(len(held))] == TEXTS[-6:]
    assert len(train) == 54
    # each host reads what it reads of the same texts given as a list (whose shards the
    # pipeline tests show disjoint and covering), and the two hosts read different rows
    per_host = []
    for host in range(2):
        got = one_pass(path, data_dir, shard=(host, 2), val_fraction=0.1)
        expected = one_pass(TEXTS[:54], data_dir, shard=(host, 2))
        for a, b in zip(expected, got, strict=True):
            np.testing.assert_array_equal(a["inputs"], b["inputs"])
        per_host.append(np.concatenate([b["inputs"] for b in got]))
    assert not np.array_equal(per_host[0][:4], per_host[1][:4])

    def make():
        return make_lm_iterator(path, BYTE, 24, 4, seed=5, shard=(0, 1), data_dir=data_dir)

    assert_resumes_exactly(make, after=(0, 5, 40))  # 40 batches cross an epoch


def test_data_field_and_download_are_aliases_of_train_options():
    from transformers_jax.cli import build_configs

    _, cfg = build_configs(["--data", "rows.parquet", "--data.field=body", "--data.download=true"])
    assert (cfg.data, cfg.text_key, cfg.data_download) == ("rows.parquet", "body", True)
    _, cfg = build_configs(["--data", "0.7*hf:a/b,0.3*./my_text/"])
    assert cfg.data == "0.7*hf:a/b,0.3*./my_text/" and not cfg.data_download
