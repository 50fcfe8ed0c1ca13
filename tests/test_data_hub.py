"""Hugging Face datasets as a source, offline: the hub request is checked at the
``datasets.load_dataset`` call (never sent); streaming is tested on ``datasets``' own streaming
of local jsonl files: every record once per epoch in order, host shares, held-out records,
and resume at the stream's own position."""

import pytest

pytest.importorskip("datasets")  # the hf-data extra

import json

import datasets
import numpy as np
from resume_checks import assert_resumes_exactly

from transformers_jax.data import hub
from transformers_jax.data.pipeline import make_lm_iterator, training_texts
from transformers_jax.data.sources import DataSpecError, UnknownFieldError, parse_spec
from transformers_jax.data.tokenizers import ByteTokenizer

BYTE = ByteTokenizer()
RECORDS = [f"record {i:03d} " + "xyz"[i % 3] * (3 + i % 5) for i in range(48)]


@pytest.fixture
def jsonl_files(tmp_path):
    """Four jsonl shards of 12 records (a text and an int field)."""
    paths = []
    for shard in range(4):
        path = tmp_path / f"part-{shard}.jsonl"
        rows = range(shard * 12, shard * 12 + 12)
        path.write_text("".join(json.dumps({"n": i, "text": RECORDS[i]}) + "\n" for i in rows))
        paths.append(str(path))
    return paths


def stream_of(paths):
    return datasets.load_dataset("json", data_files=paths, split="train", streaming=True)


@pytest.fixture
def fake_hub(monkeypatch, jsonl_files, tmp_path):
    """``datasets.load_dataset`` answering hub requests from local files (splits train and,
    when ``validation`` is listed, a fifth file), recording every call's arguments."""
    calls, listed, real = [], ["train"], datasets.load_dataset
    valid = tmp_path / "validation.jsonl"
    valid.write_text("".join(json.dumps({"n": -i, "text": f"held {i}"}) + "\n" for i in range(9)))

    def load_dataset(**kwargs):
        calls.append(kwargs)
        files = jsonl_files if kwargs["split"] == "train" else [str(valid)]
        cache = None if kwargs["streaming"] else str(tmp_path / "hf_cache")
        return real(
            "json", data_files=files, split="train", streaming=kwargs["streaming"], cache_dir=cache
        )

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda name, config=None: listed)
    return calls, listed


def texts_of(batches):
    """The documents of packed, unshuffled rows: bos ... eos runs decoded."""
    ids = np.concatenate([b["inputs"][b["weights"] > 0] for b in batches]).tolist()
    return BYTE.decode(ids)


def test_hub_specs_parse_or_show_the_form():
    assert hub.parse_hub("hf:wikitext:wikitext-2-raw-v1@validation") == hub.HubSpec(
        "wikitext", "wikitext-2-raw-v1", "validation"
    )
    assert hub.parse_hub("hf:HuggingFaceFW/fineweb-edu") == hub.HubSpec(
        "HuggingFaceFW/fineweb-edu", None, None
    )
    assert parse_spec("hf:roneneldan/TinyStories").kind == "hf"
    for bad, why in [
        ("hf:", "no dataset name"),
        ("hf:a/b/c", "not a hub dataset name"),
        ("hf:name:", "empty config"),
        ("hf:name@", "empty split"),
        ("hf:-x", "not a hub dataset name"),
    ]:
        with pytest.raises(DataSpecError, match=f"{why}.*hf:NAME\\[:CONFIG\\]\\[@SPLIT\\]"):
            parse_spec(bad)


def test_the_hub_request_streams_unless_a_download_is_asked(fake_hub, tmp_path):
    calls, listed = fake_hub
    listed.append("validation")
    it = make_lm_iterator("hf:owner/corpus:en@train", BYTE, 16, 2, shard=(0, 1))
    next(it)
    # the probe (the text field) and the host's stream: both streamed, the spec's parts as given
    assert calls and all(
        c == {"path": "owner/corpus", "name": "en", "split": "train", "streaming": True}
        for c in calls
    )
    calls.clear()
    next(make_lm_iterator("hf:owner/corpus:en", BYTE, 16, 2, shard=(0, 1), role="eval"))
    assert {c["split"] for c in calls} == {"validation"}  # the hub lists a held-out split
    calls.clear()
    texts = training_texts("hf:owner/corpus", 10**6, download=True, data_dir=str(tmp_path))
    assert calls == [
        {
            "path": "owner/corpus",
            "split": "train",
            "streaming": False,
            "cache_dir": str(tmp_path / "hub"),
        }
    ]
    assert [t.decode() for t in texts] == RECORDS  # downloaded: random access, all of train


@pytest.mark.slow
def test_a_stream_reads_every_record_once_per_epoch_and_resumes_exactly(jsonl_files):
    stream = stream_of(jsonl_files)
    one = list(make_lm_iterator(stream, BYTE, 32, 2, shard=(0, 1), num_epochs=1, shuffle_rows=0))
    assert texts_of(one) == "".join(RECORDS)  # in stored order, nothing lost or repeated

    def make():
        return make_lm_iterator(
            stream_of(jsonl_files), BYTE, 32, 2, shard=(0, 1), seed=3, shuffle_rows=8
        )

    # 50 batches of 2 rows run past the first epoch (about 25)
    assert_resumes_exactly(make, after=(0, 7, 50), batches=8)


def test_hosts_stream_disjoint_shares_that_cover_the_records(jsonl_files):
    shares = []
    for host in range(2):
        it = make_lm_iterator(
            stream_of(jsonl_files), BYTE, 32, 2, shard=(host, 2), num_epochs=1, shuffle_rows=0
        )
        text = texts_of(list(it))
        shares.append({r for r in RECORDS if r in text})
    assert not shares[0] & shares[1]
    assert shares[0] | shares[1] == set(RECORDS)
    assert len(shares[0]) == 24  # four files, two each


def test_without_a_held_out_split_the_first_records_are_held_out(fake_hub, monkeypatch):
    monkeypatch.setattr(hub, "HELD_OUT_RECORDS", 5)
    common = dict(shard=(0, 1), num_epochs=1, shuffle_rows=0)
    held = texts_of(list(make_lm_iterator("hf:corpus", BYTE, 32, 2, role="eval", **common)))
    train = texts_of(list(make_lm_iterator("hf:corpus", BYTE, 32, 2, **common)))
    assert [r for r in RECORDS if r in held] == RECORDS[:5]
    assert [r for r in RECORDS if r in train] == RECORDS[5:]


def test_the_text_field_of_a_stream_is_chosen_or_refused(jsonl_files):
    with pytest.raises(UnknownFieldError, match=r"'body' is not a field.*n \(int64\), text"):
        make_lm_iterator(stream_of(jsonl_files), BYTE, 16, 2, shard=(0, 1), text_key="body")
    with pytest.raises(UnknownFieldError, match="holds int64, not text"):
        make_lm_iterator(stream_of(jsonl_files), BYTE, 16, 2, shard=(0, 1), text_key="n")


def test_an_unreachable_hub_puts_the_process_offline_and_fails_at_once(monkeypatch):
    """No network (as here): one probe, then the Hugging Face libraries' offline mode, so a
    dataset that is not cached fails at once with one line naming the fix, not after a minute
    of retried requests; a reachable hub changes nothing."""
    from transformers_jax.data import hub_offline

    for name in hub_offline.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    monkeypatch.setattr(hub_offline, "hub_reachable", lambda timeout=3.0: True)
    assert hub_offline.offline_unless_reachable() is False
    assert not hub_offline.offline_by_setting()
    monkeypatch.setattr(hub_offline, "hub_reachable", lambda timeout=3.0: False)
    assert hub_offline.offline_unless_reachable() is True
    assert hub_offline.offline_by_setting() and datasets.config.HF_HUB_OFFLINE is True
    with pytest.raises(hub.DatasetNotPreparedError, match=r"--data hf:someone/not-cached: the "
                                                           r"hub cannot be reached"):
        hub.load_dataset(path="someone/not-cached", split="train", streaming=True)
