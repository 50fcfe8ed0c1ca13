"""Mixtures of sources (``--data "0.7*A,0.3*B"``): specs parsed or refused by the part at
fault, documents drawn in the weights' proportions, the same for a seed, resumed exactly, and
the proportions named where the run reports its data."""

import pytest

pytest.importorskip("datasets")  # the hf-data extra

import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from resume_checks import assert_resumes_exactly

from transformers_jax.config import TrainConfig
from transformers_jax.data import hub
from transformers_jax.data.mixture import Part, is_mixture, parse_mixture
from transformers_jax.data.pipeline import make_lm_iterator, take
from transformers_jax.data.sources import DataSpecError
from transformers_jax.data.tokenizers import ByteTokenizer
from transformers_jax.runs.data import data_fingerprint, data_name

BYTE = ByteTokenizer()


def test_mixture_specs_parse_or_name_the_part_at_fault():
    assert parse_mixture("0.7*hf:a/b, 0.3 * ./my_text/") == (
        Part(0.7, "hf:a/b"),
        Part(0.3, "./my_text/"),
    )
    assert parse_mixture("3*x,1*lines:y") == (Part(0.75, "x"), Part(0.25, "lines:y"))
    for spec in ("corpus/*.txt", "*.md", "a*b.txt", "tfds:lm1b", None, ""):
        assert not is_mixture(spec), spec  # globs and plain specs are single sources
    for spec, why in [
        ("0.7*a,b", "the part 'b' has no weight"),
        ("x*a,0.3*b", "the weight 'x' of 'a' is not a number"),
        ("0.5*a,0*b", "the weight '0' of 'b' must be a positive number"),
        ("0.5*a,-1*b", "'-1' of 'b' must be a positive"),
        ("nan*a,1*b", "'nan' of 'a' must be a positive"),
        ("1*a", "needs two sources or more"),
        ("0.5*a,0.5*", "the part '0.5\\*' has no weight"),
    ]:
        assert is_mixture(spec), spec
        with pytest.raises(DataSpecError, match=why):
            parse_mixture(spec)


@pytest.fixture
def two_sources(tmp_path):
    """Source A: a parquet file of 'a' documents; B: a text file with one 'b' document per
    line."""
    a = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [f"a{i:03d}" + "a" * 20 for i in range(200)]}), a)
    b = tmp_path / "b.txt"
    b.write_text("".join(f"b{i:03d}" + "b" * 20 + "\n" for i in range(200)))
    return str(a), f"lines:{b}", str(tmp_path / "cache")


def first_letters(batches):
    """The first byte of each document, in the order read (packed rows, no row shuffle)."""
    out = []
    for batch in batches:
        for row, seg in zip(batch["inputs"], batch["segment_ids"], strict=True):
            starts = np.flatnonzero(row == BYTE.bos_id)
            out += [chr(row[i + 1]) for i in starts if i + 1 < len(row) and seg[i + 1] > 0]
    return out


@pytest.mark.slow
def test_documents_are_drawn_in_proportion_the_same_for_a_seed(two_sources):
    a, b, cache = two_sources

    def make(seed, spec=f"0.75*{a},0.25*{b}"):
        return make_lm_iterator(
            spec, BYTE, 64, 4, seed=seed, shard=(0, 1), shuffle_rows=0, data_dir=cache
        )

    letters = first_letters(take(make(0), 60))
    assert len(letters) > 150
    assert abs(letters.count("a") / len(letters) - 0.75) < 0.02
    assert set(letters) == {"a", "b"}
    again = take(make(0), 5)
    for x, y in zip(take(make(0), 5), again, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    other = np.concatenate([x["inputs"] for x in take(make(1), 5)])
    assert not np.array_equal(other, np.concatenate([x["inputs"] for x in again]))
    flipped = first_letters(take(make(0, f"1*{a},3*{b}"), 60))
    assert abs(flipped.count("b") / len(flipped) - 0.75) < 0.02


@pytest.mark.slow
def test_a_mixture_with_a_stream_resumes_exactly(two_sources, tmp_path, monkeypatch):
    a, b, cache = two_sources
    stream_file = tmp_path / "s.jsonl"
    stream_file.write_text("".join(json.dumps({"text": f"s{i:03d}" * 4}) + "\n" for i in range(90)))

    def hub_from_file(**kwargs):  # hf:local/s streamed from the file
        return datasets.load_dataset(
            "json", data_files=[str(stream_file)], split="train", streaming=True
        )

    monkeypatch.setattr(hub, "load_dataset", hub_from_file)
    monkeypatch.setattr(hub, "split_names", lambda spec: ["train", "validation"])

    def make():
        return make_lm_iterator(
            f"0.5*{a},0.2*{b},0.3*hf:local/s",
            BYTE,
            32,
            4,
            seed=2,
            shard=(0, 1),
            shuffle_rows=16,
            data_dir=cache,
        )

    # 70 batches: the stream (90 records) starts its second epoch
    assert_resumes_exactly(make, after=(0, 9, 70))
    assert "s" in first_letters(take(make(), 20))


def test_the_run_names_the_proportions_and_fingerprints_each_part(two_sources):
    a, b, cache = two_sources
    cfg = TrainConfig(data=f"3*{a},1*{b}", data_dir=cache)
    assert data_name(cfg) == f"a mixture by documents of 75% {a}, 25% {b}"
    fingerprint = data_fingerprint(cfg)
    assert fingerprint.startswith("0.75*[columnar:") and "+ 0.25*[local-text:" in fingerprint
    other = TrainConfig(data=f"1*{a},1*{b}", data_dir=cache)
    assert data_fingerprint(other) != fingerprint  # other weights: other data
