"""Tokenizers with one interface: byte-level, a character vocabulary, SentencePiece, and a
converted checkpoint's own Hugging Face tokenizer (``HFTokenizer``, needs ``transformers``).

Every tokenizer has ``encode(text) -> int32 [N]``, ``decode(ids) -> str``, ``vocab_size``, the
special ids ``pad_id``, ``bos_id``, ``eos_id``, ``mask_id``, ``cls_id``, ``sep_id`` (also in
``special``), ``save(directory)``, and is restored by ``load_tokenizer(directory)``: store it
beside a checkpoint and the ids mean the same thing when the checkpoint is restored.

Undecodable input (bytes that are not UTF-8):
- ``byte`` never fails and never changes the input: it works on bytes.
- ``char`` and ``sentencepiece`` work on text: invalid UTF-8 bytes become U+FFFD (the Unicode
  replacement character), exactly like ``bytes.decode("utf-8", errors="replace")``. A character
  that the ``char`` vocabulary lacks becomes its ``unk_id`` (decoded as U+FFFD); SentencePiece
  falls back to UTF-8 byte pieces, so it never needs an unknown token.
``decode`` drops special tokens and never fails (a cut multi-byte character becomes U+FFFD).
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from transformers_jax.registry import TOKENIZERS

SPECIAL_TOKENS = ("pad", "bos", "eos", "mask", "cls", "sep")
TOKENIZER_FILE = "tokenizer.json"
_FORMAT_VERSION = 1
_REPLACEMENT = "\ufffd"


def as_text(text: str | bytes) -> str:
    """``text`` as str; invalid UTF-8 bytes become U+FFFD (the documented policy)."""
    return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text


class Tokenizer:
    """The common interface. Subclasses set ``name``, ``special`` and implement the rest."""

    name = "base"
    # What one id stands for in the text, for per-unit figures (``tjax eval``: bits per byte
    # when "byte"); "token" when an id covers a varying span.
    unit = "token"
    special: dict[str, int]

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str | bytes) -> np.ndarray:
        """int32 ids ``[N]`` (no bos/eos: the pipeline adds them)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        raise NotImplementedError

    @property
    def pad_id(self) -> int:
        return self.special["pad"]

    @property
    def bos_id(self) -> int:
        return self.special["bos"]

    @property
    def eos_id(self) -> int:
        return self.special["eos"]

    @property
    def mask_id(self) -> int:
        return self.special["mask"]

    @property
    def cls_id(self) -> int:
        return self.special["cls"]

    @property
    def sep_id(self) -> int:
        return self.special["sep"]

    def _config(self) -> dict:
        return {}

    def save(self, directory: str) -> str:
        """Write ``directory/tokenizer.json`` (and any model file); returns the JSON path."""
        os.makedirs(directory, exist_ok=True)
        meta = {
            "format_version": _FORMAT_VERSION,
            "kind": self.name,
            "vocab_size": self.vocab_size,
            "special": dict(self.special),
            **self._config(),
        }
        path = os.path.join(directory, TOKENIZER_FILE)
        tmp = f"{path}.tmp{os.getpid()}"  # two processes saving the same cache entry
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, path)
        return path

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255, then the special tokens (pad=256, bos=257, ...)."""

    name = "byte"
    unit = "byte"

    def __init__(self) -> None:
        self.special = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIAL_TOKENS)

    def encode(self, text: str | bytes) -> np.ndarray:
        # surrogateescape: a byte that was not UTF-8 where the text came from (a command-line
        # argument, a file read with that error handler) is that byte again, not an error.
        data = text.encode("utf-8", errors="surrogateescape") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        # Special tokens are dropped; a cut multi-byte character becomes U+FFFD, never an error.
        ids = np.asarray(ids).reshape(-1)
        data = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")


class CharTokenizer(Tokenizer):
    """One id per Unicode character seen in the training text.

    Ids: the special tokens 0..5, ``unk`` 6, then the characters by decreasing frequency (ties by
    code point), at most ``vocab_size`` ids in all.
    """

    name = "char"
    unit = "character"

    def __init__(self, chars: Sequence[str]) -> None:
        self.special = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
        self.unk_id = len(SPECIAL_TOKENS)
        self.chars = list(chars)
        if len(set(self.chars)) != len(self.chars) or any(len(c) != 1 for c in self.chars):
            raise ValueError("CharTokenizer: chars must be distinct single characters")
        offset = self.unk_id + 1
        self._id_of = {c: offset + i for i, c in enumerate(self.chars)}
        codes = [ord(c) for c in self.chars]
        # A dense table for the Basic Multilingual Plane makes encoding one numpy gather.
        self._table = np.full(0x10000, self.unk_id, np.int32)
        for c, code in zip(self.chars, codes, strict=True):
            if code < 0x10000:
                self._table[code] = self._id_of[c]
        self._has_astral = any(code >= 0x10000 for code in codes)
        self._strings = np.array(
            [""] * offset + self.chars, dtype=object
        )  # id -> str, specials decode to ""
        self._strings[self.unk_id] = _REPLACEMENT

    @classmethod
    def train(cls, texts: Iterable[str | bytes], vocab_size: int | None = None) -> CharTokenizer:
        counts: collections.Counter[str] = collections.Counter()
        for text in texts:
            counts.update(as_text(text))
        if not counts:
            raise ValueError("char tokenizer: the training text is empty; give it some text")
        ranked = sorted(counts, key=lambda c: (-counts[c], ord(c)))
        reserved = len(SPECIAL_TOKENS) + 1
        if vocab_size is not None:
            if vocab_size <= reserved:
                raise ValueError(
                    f"char tokenizer: vocab_size={vocab_size} leaves no room for characters "
                    f"after the {reserved} special ids; use vocab_size > {reserved}"
                )
            ranked = ranked[: vocab_size - reserved]
        return cls(ranked)

    @property
    def vocab_size(self) -> int:
        return self.unk_id + 1 + len(self.chars)

    def encode(self, text: str | bytes) -> np.ndarray:
        text = as_text(text)
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = self._table[np.minimum(codes, 0xFFFF)]
        astral = codes >= 0x10000
        if astral.any():
            ids[astral] = [
                self._id_of.get(chr(c), self.unk_id) if self._has_astral else self.unk_id
                for c in codes[astral]
            ]
        return ids.astype(np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        return "".join(self._strings[ids])

    def _config(self) -> dict:
        return {"chars": "".join(self.chars)}


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (unigram or BPE) trained on local text, lossless on any input.

    Trained with identity normalisation, no dummy prefix, whitespace kept and byte fallback, so
    ``decode(encode(s)) == s`` for every string. Ids: pad 0, bos 1, eos 2, unk 3 (never produced:
    byte fallback covers every character), mask 4, cls 5, sep 6, newline 7, then the pieces.
    """

    name = "sentencepiece"
    MODEL_FILE = "sentencepiece.model"

    def __init__(self, model_proto: bytes) -> None:
        import sentencepiece as spm

        self.model_proto = bytes(model_proto)
        self.sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        ids = {
            "pad": self.sp.pad_id(),
            "bos": self.sp.bos_id(),
            "eos": self.sp.eos_id(),
            "mask": self.sp.piece_to_id("[MASK]"),
            "cls": self.sp.piece_to_id("[CLS]"),
            "sep": self.sp.piece_to_id("[SEP]"),
        }
        self.special = ids
        self.unk_id = self.sp.unk_id()
        self._specials = np.array(sorted(set(ids.values()) | {self.unk_id}))

    @classmethod
    def train(
        cls,
        texts: Iterable[str | bytes],
        vocab_size: int,
        model_type: str = "unigram",
        *,
        max_sentences: int = 2_000_000,
        num_threads: int = 2,
    ) -> SentencePieceTokenizer:
        """Train on ``texts`` (documents; split into lines for training, newline is a piece)."""
        import sentencepiece as spm

        if model_type not in ("unigram", "bpe"):
            raise ValueError(f"model_type={model_type!r}: valid choices: unigram, bpe")
        lines = [line for text in texts for line in as_text(text).split("\n") if line.strip()]
        if not lines:
            raise ValueError("sentencepiece: the training text is empty; give it some text")
        minimum = 256 + 8 + 1
        if vocab_size < minimum:
            raise ValueError(
                f"sentencepiece: vocab_size={vocab_size} is too small: the 256 byte-fallback "
                f"pieces and 8 special ids need {minimum - 1}; use vocab_size >= {minimum}, "
                "or the char/byte tokenizer for tiny vocabularies"
            )
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines),
                model_writer=model,
                vocab_size=vocab_size,
                model_type=model_type,
                pad_id=0,
                bos_id=1,
                eos_id=2,
                unk_id=3,
                control_symbols=["[MASK]", "[CLS]", "[SEP]"],
                user_defined_symbols=["\n"],
                byte_fallback=True,
                character_coverage=1.0,
                normalization_rule_name="identity",
                add_dummy_prefix=False,
                remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True,
                split_digits=True,
                hard_vocab_limit=False,
                input_sentence_size=max_sentences,
                shuffle_input_sentence=True,
                max_sentence_length=1 << 16,
                num_threads=num_threads,
                minloglevel=2,
            )
        except RuntimeError as e:
            found = re.search(r"required_chars\. \d+ vs (\d+)", str(e))
            if found:
                raise ValueError(
                    f"sentencepiece: vocab_size={vocab_size} is too small for this text: its "
                    f"distinct characters plus the 264 reserved pieces (256 bytes, 8 special) "
                    f"need vocab_size >= {found.group(1)}"
                ) from None
            raise ValueError(
                f"sentencepiece training failed (vocab_size={vocab_size}, "
                f"model_type={model_type}): {e}"
            ) from e
        tok = cls(model.getvalue())
        tok.model_type = model_type
        return tok

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str | bytes) -> np.ndarray:
        return np.asarray(self.sp.encode(as_text(text)), dtype=np.int32)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        out = self.sp.encode([as_text(t) for t in texts])
        return [np.asarray(ids, dtype=np.int32) for ids in out]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.vocab_size) & ~np.isin(ids, self._specials)]
        return self.sp.decode(ids.tolist())

    def save(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, self.MODEL_FILE)
        tmp = f"{path}.tmp{os.getpid()}"  # another process may be reading the same file
        with open(tmp, "wb") as f:
            f.write(self.model_proto)
        os.replace(tmp, path)
        return super().save(directory)

    def _config(self) -> dict:
        return {
            "model_file": self.MODEL_FILE,
            "model_type": getattr(self, "model_type", None),
            "sha256": hashlib.sha256(self.model_proto).hexdigest(),
        }


EXTERNAL = "external"  # a run's tokenizer kind when it has none of its own (converted ids)


def trainable() -> tuple[str, ...]:
    """The kinds built here from text (or none, byte); ``train.tokenizer`` also takes the
    kinds read from a file, ``hf:PATH`` (``TOKENIZERS.selectable()`` lists both)."""
    return TOKENIZERS.names_where(lambda entry: entry.train is not None)


def trainable_kind(kind: str) -> TokenizerKind:
    """The entry of ``kind``, refused with the valid choices unless it can be trained here."""
    return TOKENIZERS.select(kind, "tokenizer")


def train_tokenizer(
    kind: str,
    texts: Iterable[str | bytes] | None = None,
    vocab_size: int | None = None,
    *,
    cache_dir: str | None = None,
) -> Tokenizer:
    """Build a tokenizer of ``kind`` (one of ``trainable()``) from ``texts``.

    ``byte`` needs no text. ``char`` keeps the most frequent characters (all of them when
    ``vocab_size`` is None). ``sentencepiece`` (unigram) and ``sentencepiece_bpe`` need
    ``vocab_size``. With ``cache_dir``, a trained tokenizer is saved under a hash of the text and
    settings, and a second call with the same inputs loads it instead of training again.
    """
    kind, path = split_tokenizer_value(kind)
    entry = trainable_kind(kind)
    if entry.from_path is not None or path is not None:
        return tokenizer_from_path(kind, path, entry)
    if not entry.needs_text:
        return entry.train([], vocab_size)
    if texts is None:
        raise ValueError(f"tokenizer={kind!r} is trained on text: pass texts")
    texts = list(texts)
    if entry.needs_vocab_size and vocab_size is None:
        raise ValueError(f"tokenizer={kind!r} needs a vocab_size (e.g. 1024)")
    cached = None
    if cache_dir is not None:
        h = hashlib.blake2b(f"{kind}|{vocab_size}|{_FORMAT_VERSION}".encode(), digest_size=16)
        for text in texts:
            data = text.encode("utf-8") if isinstance(text, str) else text
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        cached = os.path.join(cache_dir, f"{kind}-{h.hexdigest()}")
        if os.path.exists(os.path.join(cached, TOKENIZER_FILE)):
            return load_tokenizer(cached)
    tok = entry.train(texts, vocab_size)
    if cached is not None:
        tok.save(cached)
    return tok


def tokenizer_from_path(kind: str, path: str | None, entry: TokenizerKind) -> Tokenizer:
    """``train.tokenizer=KIND:PATH``: the tokenizer the file at ``path`` holds."""
    if entry.from_path is None:
        raise ValueError(f"tokenizer={kind}:{path}: a {kind!r} tokenizer is trained here and "
                         f"takes no path; give tokenizer={kind}")
    if not path:
        raise ValueError(f"tokenizer={kind!r} reads a file: give {kind}:PATH (a tokenizer.json "
                         "or a Hugging Face model folder)")
    return entry.from_path(path)


def require_special(tokenizer: Tokenizer, key: str, purpose: str) -> None:
    """Refuse ``tokenizer`` for ``purpose`` unless it has the special token ``key`` (only a
    Hugging Face tokenizer.json may lack one: ``[MASK]`` in a GPT tokenizer)."""
    if key in tokenizer.special:
        return
    hint = tokenizer.special_hint(key) if hasattr(tokenizer, "special_hint") else ""
    raise ValueError(
        f"{purpose} needs a {key} token and the {tokenizer.name} tokenizer has none"
        + (f" ({hint})" if hint else "") + "; use a tokenizer that has one: a BERT-family "
        "tokenizer.json ([MASK]), or one trained by 'tjax tokenizer train' (it adds [MASK])")


def load_tokenizer(directory: str) -> Tokenizer:
    """Restore the tokenizer that ``Tokenizer.save(directory)`` wrote."""
    path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no tokenizer saved in {directory!r} (expected {TOKENIZER_FILE}); save one with "
            "tokenizer.save(directory)"
        )
    with open(path) as f:
        meta = json.load(f)
    kind = meta.get("kind")
    if kind not in TOKENIZERS:
        raise ValueError(f"{path}: unknown tokenizer kind {kind!r}")
    tok = TOKENIZERS.get(kind).restore(directory, meta)
    if tok.vocab_size != meta["vocab_size"] or tok.special != meta["special"]:
        raise ValueError(f"{path}: the restored tokenizer's ids differ from the saved ones")
    return tok


# A Hugging Face tokenizer --------------------------------------------------------------------

# Files that make up a Hugging Face tokenizer (whichever of them a directory has).
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
FILES_SUBDIR = "hf"


class HFTokenizer(Tokenizer):
    """``AutoTokenizer.from_pretrained(files_dir)`` with our interface (needs ``transformers``)."""

    name = "huggingface"

    def __init__(self, files_dir: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(
                "this run's tokenizer is a Hugging Face tokenizer: install transformers "
                "(pip install 'transformers-jax[parity]') to encode and decode text with it"
            ) from None
        self.files_dir = files_dir
        self.hf = AutoTokenizer.from_pretrained(files_dir)
        ids = {
            "pad": self.hf.pad_token_id,
            "bos": self.hf.bos_token_id,
            "eos": self.hf.eos_token_id,
            "mask": self.hf.mask_token_id,
            "cls": self.hf.cls_token_id,
            "sep": self.hf.sep_token_id,
        }
        if ids["pad"] is None:
            ids["pad"] = ids["eos"]
        self.special = {k: int(v) for k, v in ids.items() if v is not None}

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str | bytes) -> np.ndarray:
        ids = self.hf.encode(as_text(text), add_special_tokens=False)
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        return self.hf.decode(ids.tolist(), skip_special_tokens=True)

    def save(self, directory: str) -> str:
        """Copy the Hugging Face files to ``directory/hf`` and write our ``tokenizer.json``."""
        target = os.path.join(directory, FILES_SUBDIR)
        copy_hf_tokenizer_files(self.files_dir, target)
        return super().save(directory)

    def save_hf(self, directory: str) -> list[str]:
        """Copy the Hugging Face files themselves into ``directory`` (for an exported model)."""
        return copy_hf_tokenizer_files(self.files_dir, directory)

    def _config(self) -> dict:
        return {"files": FILES_SUBDIR, "hf_class": type(self.hf).__name__}

    @classmethod
    def load(cls, directory: str) -> HFTokenizer:
        """Restore from what ``save(directory)`` wrote (checking the ids did not change)."""
        with open(os.path.join(directory, TOKENIZER_FILE)) as f:
            meta = json.load(f)
        tok = cls(os.path.join(directory, meta.get("files", FILES_SUBDIR)))
        if tok.vocab_size != meta["vocab_size"] or tok.special != meta["special"]:
            raise ValueError(f"{directory}: the restored tokenizer's ids differ from the saved")
        return tok


def copy_hf_tokenizer_files(source: str, target: str) -> list[str]:
    os.makedirs(target, exist_ok=True)
    copied = []
    for name in HF_TOKENIZER_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(target, name))
            copied.append(name)
    return copied


# The kinds (registry.TOKENIZERS) --------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerKind:
    """A tokenizer kind: a ``train.tokenizer`` value, or one only restored (a converted
    checkpoint's own tokenizer). Saved tokenizers name their kind (``Tokenizer.name``) and are
    restored by it; code elsewhere asks the entry and never tests the name."""

    # (directory, its tokenizer.json) -> the tokenizer ``save(directory)`` wrote
    restore: Callable[[str, dict], Tokenizer]
    # (texts, vocab_size) -> a new tokenizer; None: not built here (restored only)
    train: Callable[[list, int | None], Tokenizer] | None = None
    needs_text: bool = True  # False: the same tokenizer whatever the text (byte)
    needs_vocab_size: bool = False
    # PATH -> the tokenizer a file holds (``train.tokenizer=KIND:PATH``); None: takes no path
    from_path: Callable[[str], Tokenizer] | None = None


def split_tokenizer_value(value: str) -> tuple[str, str | None]:
    """``"hf:PATH"`` -> ``("hf", "PATH")``; a plain kind -> ``(kind, None)``."""
    kind, colon, path = value.partition(":")
    return (kind, path) if colon else (value, None)


def _restore_sentencepiece(directory: str, meta: dict) -> SentencePieceTokenizer:
    with open(os.path.join(directory, meta["model_file"]), "rb") as f:
        proto = f.read()
    if hashlib.sha256(proto).hexdigest() != meta["sha256"]:
        raise ValueError(f"{directory!r}: the SentencePiece model does not match its hash")
    tok = SentencePieceTokenizer(proto)
    tok.model_type = meta.get("model_type")
    return tok


TOKENIZERS.add("byte", TokenizerKind(lambda directory, meta: ByteTokenizer(),
                                     lambda texts, vocab: ByteTokenizer(), needs_text=False))
TOKENIZERS.add("char", TokenizerKind(lambda directory, meta: CharTokenizer(list(meta["chars"])),
                                     CharTokenizer.train))
TOKENIZERS.add("sentencepiece", TokenizerKind(  # unigram; saved as "sentencepiece" either way
    _restore_sentencepiece, lambda texts, vocab: SentencePieceTokenizer.train(texts, vocab),
    needs_vocab_size=True))
TOKENIZERS.add("sentencepiece_bpe", TokenizerKind(
    _restore_sentencepiece,
    lambda texts, vocab: SentencePieceTokenizer.train(texts, vocab, "bpe"),
    needs_vocab_size=True))
TOKENIZERS.add("huggingface", TokenizerKind(  # needs transformers
    lambda directory, meta: HFTokenizer.load(directory)))
TOKENIZERS.refusal = lambda kind: (
    None if kind.train is not None or kind.from_path is not None
    else "restored with the converted run it came with, not trained")
