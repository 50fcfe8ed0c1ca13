"""Tokenizers: round trips, the undecodable-input policy, special ids, save/load, caching."""

import json

import numpy as np
import pytest

from transformers_jax.config import ConfigError, TrainConfig
from transformers_jax.data.corpus import default_corpus
from transformers_jax.data.pipeline import make_tokenizer
from transformers_jax.data.tokenizers import (
    SPECIAL_TOKENS,
    TOKENIZERS,
    ByteTokenizer,
    CharTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
    train_tokenizer,
    trainable,
)

SAMPLES = [
    "plain ascii text",
    "  leading and   repeated spaces\tand tabs\n\nand blank lines\n",
    "héllo wörld, naïve café, 東京, emoji 🙂🚀",
    "digits 1234567890 and [MASK] <s> </s> written as text",
    "",
]
CORPUS = default_corpus()[:60_000]


@pytest.fixture(scope="module")
def sp_unigram():
    return train_tokenizer("sentencepiece", [CORPUS], vocab_size=400)


@pytest.fixture(scope="module")
def sp_bpe():
    return train_tokenizer("sentencepiece_bpe", [CORPUS], vocab_size=400)


@pytest.fixture(scope="module")
def char():
    return train_tokenizer("char", [CORPUS + "".join(SAMPLES)])


def _all(char, sp_unigram, sp_bpe):
    return [ByteTokenizer(), char, sp_unigram, sp_bpe]


def test_round_trips(char, sp_unigram, sp_bpe):
    for tok in _all(char, sp_unigram, sp_bpe):
        for text in SAMPLES + [CORPUS[:5000]]:
            ids = tok.encode(text)
            assert ids.dtype == np.int32 and ids.ndim == 1
            assert ((ids >= 0) & (ids < tok.vocab_size)).all()
            assert tok.decode(ids) == text, (tok.name, text)
    # SentencePiece compresses the corpus; bytes and characters do not.
    assert len(sp_unigram.encode(CORPUS)) < 0.8 * len(CORPUS.encode())


def test_special_ids_are_consistent_and_distinct(char, sp_unigram, sp_bpe):
    for tok in _all(char, sp_unigram, sp_bpe):
        ids = [tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id, tok.cls_id, tok.sep_id]
        assert ids == [tok.special[name] for name in SPECIAL_TOKENS]
        assert len(set(ids)) == len(ids) and all(0 <= i < tok.vocab_size for i in ids)
        # Text that spells a special token is ordinary text, never the special id.
        assert not set(tok.encode("[MASK] [SEP] [CLS] <s> </s> <pad>").tolist()) & set(ids)
        # decode drops special tokens
        text = "abc"
        wrapped = np.concatenate([[tok.bos_id], tok.encode(text), [tok.eos_id, tok.pad_id]])
        assert tok.decode(wrapped) == text
    assert ByteTokenizer().pad_id == 256 and ByteTokenizer().vocab_size == 262


def test_undecodable_bytes_policy(char, sp_unigram):
    bad = b"ok \xff\xfe then \xc3"  # invalid UTF-8 and a cut two-byte character
    byte = ByteTokenizer()
    np.testing.assert_array_equal(byte.encode(bad), np.frombuffer(bad, np.uint8))  # lossless
    replaced = bad.decode("utf-8", errors="replace")
    assert "\ufffd" in replaced
    for tok in (char, sp_unigram):
        np.testing.assert_array_equal(tok.encode(bad), tok.encode(replaced))
    assert sp_unigram.decode(sp_unigram.encode(bad)) == replaced
    # char: a character missing from the vocabulary becomes unk, decoded as U+FFFD
    small = CharTokenizer.train(["abc"])
    assert small.encode("abz").tolist() == [
        small.encode("a")[0],
        small.encode("b")[0],
        small.unk_id,
    ]
    assert small.decode(small.encode("abz")) == "ab\ufffd"
    assert byte.decode([0xE6, 0x9D]) == "\ufffd"  # a cut character never raises


def test_char_vocab_size_keeps_most_frequent():
    tok = CharTokenizer.train(["aaaa bbb cc d"], vocab_size=7 + 3)
    assert tok.vocab_size == 10 and tok.chars == ["a", " ", "b"]
    with pytest.raises(ValueError, match="no room"):
        CharTokenizer.train(["abc"], vocab_size=5)


@pytest.mark.parametrize("kind", trainable())
def test_every_trainable_kind_builds_saves_and_restores(kind, tmp_path):
    entry = TOKENIZERS.get(kind)
    vocab = 400 if entry.needs_vocab_size else None
    tok = train_tokenizer(kind, [CORPUS[:20_000]] if entry.needs_text else None, vocab)
    text = CORPUS[:1000]  # seen in training: a char vocabulary lacks other characters
    assert tok.decode(tok.encode(text)) == text
    tok.save(str(tmp_path))
    restored = TOKENIZERS.get(json.loads((tmp_path / "tokenizer.json").read_text())["kind"])
    np.testing.assert_array_equal(restored.restore(str(tmp_path), json.loads(
        (tmp_path / "tokenizer.json").read_text())).encode(text), tok.encode(text))
    np.testing.assert_array_equal(load_tokenizer(str(tmp_path)).encode(text), tok.encode(text))


def test_save_and_load_restore_the_same_ids(tmp_path, char, sp_unigram, sp_bpe):
    text = SAMPLES[2] + CORPUS[:2000]
    for tok in _all(char, sp_unigram, sp_bpe):
        directory = tmp_path / tok.name / str(tok.vocab_size)
        tok.save(str(directory))
        meta = json.loads((directory / "tokenizer.json").read_text())
        assert meta["kind"] == tok.name and meta["special"] == tok.special
        restored = load_tokenizer(str(directory))
        assert type(restored) is type(tok) and restored.vocab_size == tok.vocab_size
        assert restored.special == tok.special
        np.testing.assert_array_equal(restored.encode(text), tok.encode(text))
    with pytest.raises(FileNotFoundError, match="no tokenizer saved"):
        load_tokenizer(str(tmp_path / "nowhere"))


def test_training_cache_skips_a_second_training(tmp_path, monkeypatch):
    first = train_tokenizer("sentencepiece", [CORPUS[:20_000]], 400, cache_dir=str(tmp_path))

    def fail(*args, **kwargs):
        raise AssertionError("trained again instead of loading the cache")

    monkeypatch.setattr(SentencePieceTokenizer, "train", fail)
    second = train_tokenizer("sentencepiece", [CORPUS[:20_000]], 400, cache_dir=str(tmp_path))
    assert second.model_proto == first.model_proto


def test_make_tokenizer_trains_on_the_training_text_once(tmp_path):
    tok = make_tokenizer("char", None, data_dir=str(tmp_path))
    assert tok.decode(tok.encode(CORPUS[:3000])) == CORPUS[:3000]
    again = make_tokenizer("char", None, data_dir=str(tmp_path))
    assert again.chars == tok.chars and len(list((tmp_path / "tokenizers").iterdir())) == 1
    assert isinstance(make_tokenizer("byte"), ByteTokenizer)


def test_tokenizer_errors():
    assert trainable() == ("byte", "char", "sentencepiece", "sentencepiece_bpe")
    assert TOKENIZERS.selectable() == ("byte", "char", "hf", "sentencepiece",
                                       "sentencepiece_bpe")  # hf:PATH, a tokenizer.json
    with pytest.raises(ValueError, match="not known; valid choices: "
                       + ", ".join(TOKENIZERS.selectable())):
        train_tokenizer("wordpiece", ["text"])
    for make in (train_tokenizer, make_tokenizer):  # refused before any text is read
        with pytest.raises(ValueError, match="'huggingface': restored with the converted run "
                           "it came with, not trained; valid choices: byte, char"):
            make("huggingface", "no/such/corpus")
    with pytest.raises(ConfigError, match="train.tokenizer='huggingface': restored with"):
        TrainConfig(tokenizer="huggingface")
    with pytest.raises(ValueError, match="needs a vocab_size"):
        train_tokenizer("sentencepiece", ["text"])
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer("sentencepiece", ["text"], vocab_size=100)
    with pytest.raises(ValueError, match="too small for this text.*need vocab_size >= 3[0-9][0-9]"):
        train_tokenizer("sentencepiece", [CORPUS], vocab_size=300)
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer("char", ["", ""])
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer("sentencepiece", ["  \n"], vocab_size=300)
