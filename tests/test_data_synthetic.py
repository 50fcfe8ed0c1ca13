"""Synthetic tasks: correct by construction, lengths in range, deterministic, both formats."""

import re

import numpy as np
import pytest

from transformers_jax.data.pipeline import make_task_iterator
from transformers_jax.data.synthetic import (
    FORMATS,
    TASKS,
    TaskSource,
    accuracy_by_length,
    answer_exact_match,
    decoder_example,
    encdec_example,
    exact_match,
    exact_match_segments,
    task_source,
)
from transformers_jax.data.tokenizers import ByteTokenizer
from transformers_jax.registry import UnknownNameError

TOK = ByteTokenizer()


def _check(name: str, prompt: str, answer: str, n: int) -> None:
    if name == "copy":
        assert answer == prompt and len(prompt) == n
    elif name == "reverse":
        assert answer == prompt[::-1] and len(prompt) == n
    elif name == "sort":
        assert answer == "".join(sorted(prompt)) and len(prompt) == n
    elif name == "addition":
        a, b = prompt.split("+")
        assert len(a) == len(b) == n and int(answer) == int(a) + int(b)
        assert n == 1 or (a[0] != "0" and b[0] != "0")
    elif name == "addition_reversed":
        a, b = prompt.split("+")
        assert len(a) == len(b) == n and int(answer[::-1]) == int(a[::-1]) + int(b[::-1])
    elif name == "parity":
        assert set(prompt) <= {"0", "1"} and len(prompt) == n
        assert answer == str(prompt.count("1") % 2)
    elif name == "associative_recall":
        context, query = prompt.split("|")
        pairs = re.findall(r"([a-z]{2})(\d)", context)
        assert len(pairs) == n and "".join(k + v for k, v in pairs) == context
        keys = [k for k, _ in pairs]
        assert len(set(keys)) == n and answer == dict(pairs)[query]
    elif name == "passkey":
        text, query = prompt.split("|")
        words = text.split(" ")
        assert query == "key" and len(words) == n + 1
        assert re.fullmatch(r"\d{5}", answer) and f"key={answer}" in words
    else:
        raise AssertionError(f"no check for task {name}")


@pytest.mark.parametrize("name", TASKS.names())
def test_tasks_are_correct_in_range_and_deterministic(name):
    lo, hi = (1, 12) if name != "associative_recall" else (1, 30)
    train = task_source(
        name, "train", train_lengths=(lo, hi), test_lengths=(hi + 1, hi + 9), seed=3
    )
    test = task_source(name, "test", train_lengths=(lo, hi), test_lengths=(hi + 1, hi + 9), seed=3)
    assert len(train) == 1_000_000 and len(test) == 1_000
    seen = set()
    for source, (a, b) in ((train, (lo, hi)), (test, (hi + 1, hi + 9))):
        for i in range(200):
            ex = source[i]
            assert a <= ex["length"] <= b
            _check(name, ex["prompt"], ex["answer"], ex["length"])
            seen.add(ex["length"])
    assert seen == set(range(lo, hi + 10))  # every length of both ranges appears
    again = task_source(name, "train", train_lengths=(lo, hi), seed=3)
    assert [again[i] for i in range(20)] == [train[i] for i in range(20)]
    other = task_source(name, "train", train_lengths=(lo, hi), seed=4)
    assert [other[i] for i in range(20)] != [train[i] for i in range(20)]
    prompt_bound, answer_bound = TaskSource(name, lengths=(hi, hi)).max_chars()
    for i in range(50):
        ex = TaskSource(name, lengths=(hi, hi), seed=i)[0]
        assert len(ex["prompt"]) <= prompt_bound and len(ex["answer"]) <= answer_bound


def test_addition_handles_numbers_beyond_int64():
    ex = TaskSource("addition", lengths=(40, 40))[5]
    a, b = ex["prompt"].split("+")
    assert len(a) == 40 and int(ex["answer"]) == int(a) + int(b)


def test_decoder_format_weights_only_the_answer():
    ex = {"prompt": "abc", "answer": "cba", "length": 3}
    row = decoder_example(ex, TOK)
    seq = [TOK.bos_id, *b"abc", TOK.sep_id, *b"cba", TOK.eos_id]
    assert row["inputs"].tolist() == seq[:-1] and row["targets"].tolist() == seq[1:]
    assert row["targets"][row["weights"] > 0].tolist() == [*b"cba", TOK.eos_id]
    assert int(row["prefix_len"]) == 5  # bos a b c sep
    t = np.arange(len(row["targets"]))
    np.testing.assert_array_equal(row["weights"] > 0, t + 1 >= row["prefix_len"])
    enc = encdec_example(ex, TOK)
    assert enc["encoder_inputs"].tolist() == [*b"abc", TOK.eos_id]
    assert enc["inputs"].tolist() == [TOK.bos_id, *b"cba"]
    assert enc["targets"].tolist() == [*b"cba", TOK.eos_id] and enc["weights"].all()


def test_task_batches_decode_to_prompt_and_answer():
    it = make_task_iterator(
        "reverse", TOK, 48, 8, seed=1, shard=(0, 1), train_lengths=(1, 20), prefix=True
    )
    batch = next(it)
    assert batch["inputs"].shape == (8, 48) and batch["prefix_len"].shape == (8,)
    for row in range(8):
        w = batch["weights"][row] > 0
        answer = TOK.decode(batch["targets"][row][w])
        prompt = TOK.decode(batch["inputs"][row][: batch["prefix_len"][row]])
        assert answer == prompt[::-1] and len(answer) == batch["lengths"][row]
        assert (batch["segment_ids"][row] == (batch["inputs"][row] != TOK.pad_id)).all()

    it = make_task_iterator(
        "addition", TOK, 24, 4, shard=(0, 1), fmt="encdec", train_lengths=(1, 8), encoder_len=20
    )
    batch = next(it)
    assert batch["encoder_inputs"].shape == (4, 20) and batch["inputs"].shape == (4, 24)
    assert "prefix_len" not in batch
    for row in range(4):
        enc = batch["encoder_inputs"][row][batch["encoder_segment_ids"][row] > 0]
        a, b = TOK.decode(enc).split("+")
        assert TOK.decode(batch["targets"][row]) == str(int(a) + int(b))


def test_test_split_is_one_pass_in_the_long_range():
    it = make_task_iterator(
        "copy", TOK, 64, 16, shard=(0, 1), split="test", test_lengths=(21, 30), num_examples=40
    )
    batches = list(it)
    lengths = np.concatenate([b["lengths"] for b in batches])
    real = np.concatenate([b["weights"].sum(1) > 0 for b in batches])
    assert len(batches) == 3 and real.sum() == 40  # last batch padded with empty rows
    assert ((lengths[real] >= 21) & (lengths[real] <= 30)).all()


def test_packed_task_batches_keep_examples_whole():
    it = make_task_iterator(
        "sort", TOK, 64, 4, shard=(0, 1), pack="first_fit", train_lengths=(1, 10)
    )
    batch = next(it)
    for row in range(4):
        seg = batch["segment_ids"][row]
        for s in np.unique(seg[seg > 0]):
            m = seg == s
            tokens = batch["inputs"][row][m]
            assert tokens[0] == TOK.bos_id and batch["positions"][row][m][0] == 0
            sep = list(tokens).index(TOK.sep_id)
            prompt = TOK.decode(tokens[1:sep])
            answer = TOK.decode(batch["targets"][row][m & (batch["weights"][row] > 0)])
            assert answer == "".join(sorted(prompt))


def test_packed_encoder_decoder_segments_pair_up():
    it = make_task_iterator(
        "addition",
        TOK,
        32,
        2,
        shard=(0, 1),
        fmt="encdec",
        pack="first_fit",
        train_lengths=(1, 4),
        encoder_len=40,
    )
    batch = next(it)
    for r in range(2):
        enc_seg, dec_seg = batch["encoder_segment_ids"][r], batch["segment_ids"][r]
        assert set(enc_seg[enc_seg > 0]) == set(dec_seg[dec_seg > 0])  # same example ids
        for s in np.unique(dec_seg[dec_seg > 0]):
            a, b = TOK.decode(batch["encoder_inputs"][r][enc_seg == s]).split("+")
            assert TOK.decode(batch["targets"][r][dec_seg == s]) == str(int(a) + int(b))
            assert batch["encoder_positions"][r][enc_seg == s][0] == 0


def test_exact_match_and_accuracy_by_length():
    targets = np.array([[1, 2, 3, 0], [4, 5, 6, 0], [7, 8, 9, 0]])
    weights = np.array([[0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]])
    preds = np.array([[9, 2, 3, 5], [4, 5, 0, 0], [7, 8, 9, 0]])
    assert exact_match(preds, targets, weights).tolist() == [True, False, False]
    assert accuracy_by_length([True, False, True, True], [2, 2, 5, 5]) == {2: 0.5, 5: 1.0}
    seg = np.array([[1, 1, 2, 2]])
    assert exact_match_segments([[1, 2, 0, 4]], [[1, 2, 3, 4]], [[1, 1, 1, 1]], seg) == [
        True,
        False,
    ]
    assert answer_exact_match(["123 ", "12"], ["123", "13"]).tolist() == [True, False]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_task_format_fields_say_what_its_rows_carry(fmt):
    """``encoder``/``takes_prefix``/``row_lengths`` agree with the arrays ``example`` makes, and
    the pipeline pads and checks by them (a new layout is covered once registered)."""
    layout = FORMATS[fmt]
    source = task_source("copy", train_lengths=(3, 3))
    row = layout.example(source[0], TOK)
    assert layout.encoder == ("encoder_inputs" in row)
    assert layout.encoder == ("encoder_inputs" in layout.row_lengths(3, 3))
    assert layout.takes_prefix == ("prefix_len" in row)
    example = source[0]
    for key, n in layout.row_lengths(len(example["prompt"]), len(example["answer"])).items():
        assert len(row[key]) == n  # unpadded: exactly what a row of this example needs
    batch = next(make_task_iterator("copy", TOK, 16, 2, shard=(0, 1), fmt=fmt, encoder_len=8,
                                    prefix=layout.takes_prefix, train_lengths=(3, 3)))
    assert ("encoder_inputs" in batch) == layout.encoder
    if layout.encoder:
        assert batch["encoder_inputs"].shape == (2, 8)
    if not layout.takes_prefix:
        with pytest.raises(ValueError, match=f"prefix=True needs fmt in .* \\(not '{fmt}'\\)"):
            make_task_iterator("copy", TOK, 16, 2, shard=(0, 1), fmt=fmt, prefix=True)


def test_task_errors():
    with pytest.raises(UnknownNameError, match="valid choices: addition, addition_reversed"):
        task_source("revers")
    with pytest.raises(ValueError, match="1 <= low <= high"):
        task_source("copy", train_lengths=(5, 2))
    with pytest.raises(ValueError, match="up to 676"):
        task_source("associative_recall", test_lengths=(21, 700))
    with pytest.raises(ValueError, match="needs up to 162 tokens but seq_len=64"):
        make_task_iterator("copy", TOK, 64, 4, shard=(0, 1), split="test")
    with pytest.raises(ValueError, match="prefix=True needs pack=False"):
        make_task_iterator("copy", TOK, 64, 4, shard=(0, 1), prefix=True, pack="first_fit")
    with pytest.raises(ValueError, match="longer than the model allows"):
        make_task_iterator("copy", TOK, 64, 4, shard=(0, 1), max_len=32)
