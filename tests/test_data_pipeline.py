"""The Grain LM pipeline: packing invariants, no token lost or repeated, host shards, exact
resume, and packed rows that the model sees exactly as separate sequences."""

import collections
import itertools
import json

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from resume_checks import assert_resumes_exactly

from transformers_jax import ModelConfig, build_model
from transformers_jax.data.pipeline import (
    check_sequence_length,
    make_lm_eval_iterator,
    make_lm_iterator,
    make_task_iterator,
    take,
)
from transformers_jax.data.sources import open_documents
from transformers_jax.data.tokenizers import ByteTokenizer, CharTokenizer

MODES = ("concat", "first_fit", "none")
BYTE = ByteTokenizer()


def _documents(n: int = 30, seed: int = 0) -> list[str]:
    """Random documents; document i starts with its own CJK character (a unique id token)."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        body = "".join(rng.choice(list("abcdefgh \n"), int(rng.integers(0, 90))))
        docs.append(chr(0x4E00 + i) + body)
    return docs


DOCS = _documents()
CHAR = CharTokenizer.train(DOCS)


def _pairs(docs, tok) -> collections.Counter:
    out = collections.Counter()
    for d in docs:
        t = [tok.bos_id, *tok.encode(d).tolist(), tok.eos_id]
        out.update(zip(t[:-1], t[1:], strict=True))
    return out


def _batch_pairs(batches) -> collections.Counter:
    out = collections.Counter()
    for b in batches:
        m = b["weights"] > 0
        out.update(zip(b["inputs"][m].tolist(), b["targets"][m].tolist(), strict=True))
    return out


def _check_invariants(batch: dict, tok, seq_len: int, rows: int) -> None:
    assert set(batch) >= {"inputs", "targets", "weights", "segment_ids", "positions"}
    for key in ("inputs", "targets", "segment_ids", "positions"):
        assert batch[key].shape == (rows, seq_len) and batch[key].dtype == np.int32
    assert batch["weights"].dtype == np.float32
    for r in range(rows):
        seg, pos = batch["segment_ids"][r], batch["positions"][r]
        inp, tgt = batch["inputs"][r], batch["targets"][r]
        np.testing.assert_array_equal(batch["weights"][r], (seg > 0).astype(np.float32))
        pad = seg == 0
        assert (inp[pad] == tok.pad_id).all() and (tgt[pad] == tok.pad_id).all()
        assert (pos[pad] == 0).all()
        n_real = int((~pad).sum())
        assert not pad[:n_real].any(), "padding only at the end of a row"
        ids = seg[:n_real]
        if n_real:  # segments are 1, 2, 3... in order, each contiguous
            assert ids[0] == 1 and (np.diff(ids) >= 0).all() and (np.diff(ids) <= 1).all()
        for s in np.unique(ids):
            m = np.flatnonzero(seg == s)
            np.testing.assert_array_equal(pos[m], np.arange(len(m)))  # restart at 0
            # next-token targets never cross a segment: target t is input t+1
            np.testing.assert_array_equal(inp[m][1:], tgt[m][:-1])


def _segments(batches):
    for b in batches:
        for r in range(len(b["inputs"])):
            seg = b["segment_ids"][r]
            for s in np.unique(seg[seg > 0]):
                m = seg == s
                yield [*b["inputs"][r][m].tolist(), int(b["targets"][r][m][-1])]


@pytest.mark.parametrize("mode", MODES)
def test_one_epoch_packs_every_token_exactly_once(mode):
    it = make_lm_iterator(DOCS, CHAR, 24, 4, seed=5, pack=mode, shard=(0, 1), num_epochs=1)
    batches = list(it)
    for b in batches:
        _check_invariants(b, CHAR, 24, 4)
    assert _batch_pairs(batches) == _pairs(DOCS, CHAR)
    # every segment is a contiguous run of one document's tokens
    docs = [",".join(map(str, [CHAR.bos_id, *CHAR.encode(d).tolist(), CHAR.eos_id])) for d in DOCS]
    for tokens in _segments(batches):
        needle = ",".join(map(str, tokens))
        assert sum(needle in d for d in docs) >= 1
    fill = sum(float(b["weights"].sum()) for b in batches) / (len(batches) * 4 * 24)
    assert fill > {"concat": 0.95, "first_fit": 0.75, "none": 0.3}[mode]


@pytest.mark.parametrize("mode", MODES)
def test_bos_per_row_leads_every_window_with_bos_and_keeps_every_target(mode):
    """The same batches as without the option except the first input of each row and of each
    packed piece, which is bos: every target is still predicted once, in the same place."""
    plain = list(make_lm_iterator(DOCS, CHAR, 24, 4, seed=5, pack=mode, shard=(0, 1),
                                  num_epochs=1))
    led = list(make_lm_iterator(DOCS, CHAR, 24, 4, seed=5, pack=mode, shard=(0, 1),
                                num_epochs=1, bos_per_row=True))
    assert len(plain) == len(led)
    changed = 0
    for a, b in zip(plain, led, strict=True):
        for key in ("targets", "weights", "segment_ids", "positions"):
            np.testing.assert_array_equal(a[key], b[key])
        seg = b["segment_ids"]
        starts = (seg > 0) & (seg != np.pad(seg, ((0, 0), (1, 0)), constant_values=-1)[:, :-1])
        assert (b["inputs"][starts] == CHAR.bos_id).all()
        np.testing.assert_array_equal(a["inputs"][~starts], b["inputs"][~starts])
        assert (b["inputs"][seg == 0] == CHAR.pad_id).all()
        changed += int((a["inputs"][starts] != CHAR.bos_id).sum())
    assert changed > 0  # windows that began inside a document now begin with bos
    # a saved position of one layout does not restore into the other
    state = make_lm_iterator(DOCS, CHAR, 24, 4, seed=5, pack=mode, shard=(0, 1)).get_state()
    other = make_lm_iterator(DOCS, CHAR, 24, 4, seed=5, pack=mode, shard=(0, 1), bos_per_row=True)
    with pytest.raises(ValueError):
        other.set_state(state)


@pytest.mark.parametrize("mode", MODES)
def test_shuffle_rows_mixes_documents_within_a_batch_and_keeps_every_row(mode):
    """Packing cuts a document into consecutive rows; shuffle_rows reorders the rows within
    windows, so a batch mixes documents. One epoch holds the same rows either way; the
    held-out pass is never shuffled."""
    rng = np.random.default_rng(0)
    docs = ["".join(rng.choice(list("abcdefgh"), 300)) for _ in range(12)]  # long documents
    tok = CharTokenizer.train(docs)

    def rows(shuffle_rows, **kw):
        kw = {"shuffle": True, **kw}
        batches = list(make_lm_iterator(docs, tok, 16, 8, seed=3, pack=mode, shard=(0, 1),
                                        num_epochs=1, shuffle_rows=shuffle_rows, **kw))
        return [b["inputs"][r].tobytes() + b["targets"][r].tobytes()
                for b in batches for r in range(8) if b["weights"][r].any()]

    plain, mixed = rows(0), rows(64)
    assert sorted(plain) == sorted(mixed) and plain != mixed

    # how far apart, in the plain order, each batch's rows lie (plain: 7 neighbouring rows)
    index = {row: i for i, row in enumerate(plain)}
    spread = [np.ptp([index[r] for r in mixed[i:i + 8]]) for i in range(0, len(mixed) - 8, 8)]
    assert np.median(spread) > 16
    held_out = list(make_lm_eval_iterator(docs, tok, 16, 8, pack=mode, shard=(0, 1),
                                          shuffle_rows=64))
    plain_eval = list(make_lm_eval_iterator(docs, tok, 16, 8, pack=mode, shard=(0, 1)))
    for a, b in zip(held_out, plain_eval, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_every_epoch_is_a_new_permutation_of_the_documents():
    it = make_lm_iterator(DOCS, CHAR, 100, 10, seed=2, pack=False, shard=(0, 1))
    rows = np.concatenate([b["inputs"] for b in take(it, 6)])  # 60 rows: two epochs
    assert (rows[:, 0] == CHAR.bos_id).all()  # one whole document per row
    order = rows[:, 1].tolist()  # each document's own id token
    ids = sorted(int(CHAR.encode(d)[0]) for d in DOCS)
    assert sorted(order[:30]) == ids and sorted(order[30:]) == ids
    assert order[:30] != order[30:] and order[:30] != sorted(order[:30])


@pytest.mark.parametrize("mode", ["concat", "first_fit"])
def test_host_shards_are_disjoint_and_cover_the_data(mode):
    per_host = []
    for index in range(3):
        it = make_lm_iterator(DOCS, CHAR, 24, 6, seed=1, pack=mode, shard=(index, 3), num_epochs=1)
        batches = list(it)
        assert all(b["inputs"].shape == (2, 24) for b in batches)  # 6 rows / 3 hosts
        pairs = _batch_pairs(batches)
        first_chars = {t for (i, t) in pairs if i == CHAR.bos_id}  # one id token per doc
        per_host.append((pairs, first_chars))
    assert sum((p for p, _ in per_host), collections.Counter()) == _pairs(DOCS, CHAR)
    ids = [ids for _, ids in per_host]
    assert all(not (a & b) for a, b in itertools.combinations(ids, 2))
    assert set().union(*ids) == {int(CHAR.encode(d)[0]) for d in DOCS}


@pytest.mark.parametrize("mode, shuffle_rows", [
    pytest.param(mode, rows, marks=() if (mode, rows) == ("concat", 0) else pytest.mark.slow)
    for rows in (0, 10) for mode in MODES])  # the quick tier: one case
def test_resume_continues_with_exactly_the_next_batch(mode, shuffle_rows):
    def make():
        return make_lm_iterator(DOCS, CHAR, 16, 4, seed=7, pack=mode, shard=(0, 1),
                                shuffle_rows=shuffle_rows)

    for k in (0, 3, 40):  # 40 batches cross an epoch boundary (about 25 per epoch)
        it = make()
        take(it, k)
        state = json.loads(json.dumps(it.get_state()))  # JSON-serialisable
        expected = take(it, 12)
        fresh = make()
        fresh.set_state(state)
        got = take(fresh, 12)
        for a, b in zip(expected, got, strict=True):
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
    # epochs are reshuffled, and the seed matters
    first = np.concatenate([b["inputs"] for b in take(make(), 50)])
    other = make_lm_iterator(DOCS, CHAR, 16, 4, seed=8, pack=mode, shard=(0, 1))
    assert not np.array_equal(first[:16], np.concatenate([b["inputs"] for b in take(other, 4)]))


def test_grain_orbax_checkpoint_handler_round_trip(tmp_path):
    from etils import epath

    def make():
        return make_lm_iterator(DOCS, CHAR, 16, 4, seed=3, shard=(0, 1))

    it = make()
    take(it, 7)
    grain.checkpoint.CheckpointHandler().save(epath.Path(tmp_path), item=it)  # per-host JSON
    expected = take(it, 4)
    fresh = grain.checkpoint.CheckpointHandler().restore(epath.Path(tmp_path), item=make())
    for a, b in zip(expected, take(fresh, 4), strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_resume_of_a_task_iterator_and_a_mismatched_state():
    def make(seed=0):
        return make_task_iterator("reverse", BYTE, 48, 4, seed=seed, shard=(0, 1), pack="first_fit")

    state = assert_resumes_exactly(make, after=(5,), batches=5)
    with pytest.raises(ValueError, match="different pipeline.*seed: saved 0, now 1"):
        make(seed=1).set_state(state)


def test_prefix_batches_resume_exactly_and_keep_the_loss_off_the_prefix():
    from transformers_jax.data.prefix_lm import PrefixBatches

    def make():
        return PrefixBatches(make_lm_iterator(DOCS, CHAR, 16, 4, seed=7, shard=(0, 1)), seed=3)

    it = make()
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))
    assert state["count"] == 3 and "inner" in state
    expected = take(it, 4)
    fresh = make()
    fresh.set_state(state)
    for a, b in zip(expected, take(fresh, 4), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    for batch in expected:
        # target t is token t + 1: inside the prefix (no loss) while t + 1 < prefix_len
        positions = batch.get("positions", np.broadcast_to(np.arange(16), (4, 16)))
        inside = positions + 1 < batch["prefix_len"][:, None]
        assert np.all(batch["weights"][inside] == 0) and np.any(batch["weights"] > 0)
    assert any(not np.array_equal(a["prefix_len"], expected[0]["prefix_len"]) for a in expected)


def test_default_corpus_train_and_eval(tmp_path):
    data_dir = str(tmp_path)
    it = make_lm_iterator(None, BYTE, 64, 8, seed=0, shard=(0, 1), data_dir=data_dir)
    _check_invariants(next(it), BYTE, 64, 8)
    eval_batches = list(make_lm_eval_iterator(None, BYTE, 64, 8, shard=(0, 1), data_dir=data_dir))
    held = open_documents(None, "eval", data_dir=data_dir)
    train = open_documents(None, "train", data_dir=data_dir)
    assert len(held) >= 1 and len(train) > 10 * len(held)
    expected = sum(len(held[i].text) + 1 for i in range(len(held)))  # bytes + eos per piece
    expected -= sum(not held[i].first for i in range(len(held)))  # no bos: first byte unseen
    assert sum(int(b["weights"].sum()) for b in eval_batches) == expected
    assert all(b["inputs"].shape == (8, 64) for b in eval_batches)  # last one padded


@pytest.mark.slow
def test_packed_rows_equal_separate_sequences_in_the_model():
    cfg = ModelConfig(vocab_size=262, d_model=32, n_layers=1, n_heads=2, max_len=32)
    model = build_model(cfg)
    docs = [f"doc {i}: " + "ab" * i for i in range(1, 9)]  # 9 to 23 tokens with bos/eos
    batch = next(make_lm_iterator(docs, BYTE, 32, 2, seed=0, pack="first_fit", shard=(0, 1)))
    inputs = jnp.asarray(batch["inputs"])
    params = jax.jit(model.init)(jax.random.key(0), inputs)["params"]
    apply = jax.jit(lambda x, **kw: model.apply({"params": params}, x, **kw))
    packed = apply(
        inputs,
        positions=jnp.asarray(batch["positions"]),
        segment_ids=jnp.asarray(batch["segment_ids"]),
    )
    # Each segment alone, at the start of its own row: the causal mask makes the tail irrelevant.
    where = [
        np.flatnonzero(seg == s) for seg in batch["segment_ids"] for s in np.unique(seg) if s > 0
    ]
    rows = [r for r, seg in enumerate(batch["segment_ids"]) for s in np.unique(seg) if s > 0]
    alone = np.full((len(where), 32), BYTE.pad_id, np.int32)
    for i, (r, m) in enumerate(zip(rows, where, strict=True)):
        alone[i, : len(m)] = batch["inputs"][r][m]
    out = apply(jnp.asarray(alone))
    for i, (r, m) in enumerate(zip(rows, where, strict=True)):
        np.testing.assert_allclose(packed[r, m], out[i, : len(m)], atol=2e-5, rtol=2e-5)
    assert len(where) >= 3


def test_pipeline_errors():
    with pytest.raises(ValueError, match="multiple of the 3 host"):
        make_lm_iterator(DOCS, CHAR, 16, 4, shard=(0, 3))
    with pytest.raises(ValueError, match="pack='best'"):
        make_lm_iterator(DOCS, CHAR, 16, 4, pack="best", shard=(0, 1))
    with pytest.raises(ValueError, match="longer than the model allows.*max_len=256"):
        make_lm_iterator(DOCS, CHAR, 512, 4, shard=(0, 1), max_len=256)
    with pytest.raises(ValueError, match="0 <= index < count"):
        make_lm_iterator(DOCS, CHAR, 16, 4, shard=(2, 2))
    with pytest.raises(ValueError, match="empty"):
        make_lm_iterator([], CHAR, 16, 4, shard=(0, 1))
    with pytest.raises(ValueError, match="empty"):
        make_lm_iterator(["", " \n"], CHAR, 16, 4, shard=(0, 1))
    with pytest.raises(ValueError, match="cannot be shared by 4 hosts"):
        make_lm_iterator(DOCS[:2], CHAR, 16, 4, shard=(0, 4))
    with pytest.raises(ValueError, match="not an input-pipeline state"):
        make_lm_iterator(DOCS, CHAR, 16, 4, shard=(0, 1)).set_state({"next_index": 3})
    check_sequence_length(128, 128)
    with pytest.raises(ValueError, match="seq_len=0"):
        check_sequence_length(0, None)
