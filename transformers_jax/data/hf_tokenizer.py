"""Any Hugging Face ``tokenizer.json`` as a training tokenizer (``--train.tokenizer=hf:PATH``),
and training one on local text (``tjax tokenizer train``); needs the ``tokenizers`` library only.

``HFJsonTokenizer`` wraps ``tokenizers.Tokenizer`` with the interface of ``data/tokenizers.py``.
Its special ids are found by name, once, when the file is opened (``special_ids``):

- ``eos`` (the document separator) is required: the first of ``EOS_NAMES`` the vocabulary holds,
  or the token a model folder's ``tokenizer_config.json`` / ``special_tokens_map.json`` names;
  a file with none is refused with the special tokens it does have.
- ``bos`` and ``pad`` fall back to ``eos`` (GPT-2 has ``<|endoftext|>`` only), ``cls`` to
  ``bos`` and ``sep`` to ``eos``.
- ``mask`` only if the file has one (``[MASK]``, ``<mask>``); a masked-LM run refuses a
  tokenizer without it (``require_special``).

Text is text: a literal ``</s>`` inside a document is encoded as ordinary pieces, never as the
special id (``encode_special_tokens``), so only the pipeline's own separators are specials.
A run keeps the file in ``RUN_DIR/tokenizer/hf/tokenizer.json`` with the id mapping beside it,
so sampling and evaluation decode with exactly the ids training used.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

from transformers_jax.data.tokenizers import (
    FILES_SUBDIR,
    Tokenizer,
    TokenizerKind,
    as_text,
)
from transformers_jax.registry import TOKENIZERS

KIND = "hf"  # the saved kind, and the prefix of --train.tokenizer=hf:PATH
HF_FILE = "tokenizer.json"
# Names looked for, in order, when a file does not say which of its tokens is which.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "[SEP]", "<eos>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]", "<bos>")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")
MASK_NAMES = ("[MASK]", "<mask>", "<|mask|>")
CLS_NAMES = ("[CLS]", "<cls>")
SEP_NAMES = ("[SEP]", "<sep>")
NAMES = {"eos": EOS_NAMES, "bos": BOS_NAMES, "pad": PAD_NAMES, "mask": MASK_NAMES,
         "cls": CLS_NAMES, "sep": SEP_NAMES}
FALLBACK = {"bos": "eos", "pad": "eos", "cls": "bos", "sep": "eos"}  # applied in this order
# What ``train_hf_tokenizer`` adds, at ids 0.. (unigram also has <unk> after them).
TRAINED_SPECIALS = ("<pad>", "<s>", "</s>", "[MASK]")
MODELS = ("bpe", "unigram")


def _library():
    try:
        import tokenizers
    except ImportError:
        raise ImportError("Hugging Face tokenizers need the tokenizers library: "
                          "pip install tokenizers") from None
    return tokenizers


def resolve_file(path: str) -> str:
    """``path`` itself (a ``tokenizer.json`` file), or the ``tokenizer.json`` of a folder (a
    Hugging Face model folder); a clear error when there is none."""
    if os.path.isdir(path):
        found = os.path.join(path, HF_FILE)
        if not os.path.isfile(found):
            present = sorted(os.listdir(path))[:12]
            raise FileNotFoundError(
                f"hf:{path}: the folder has no {HF_FILE} (it holds: "
                f"{', '.join(present) or 'nothing'}); give a Hugging Face model folder with a "
                "fast tokenizer's tokenizer.json, the file itself, or train one with "
                "'tjax tokenizer train'")
        return found
    if not os.path.isfile(path):
        raise FileNotFoundError(f"hf:{path}: no such file or folder; give a tokenizer.json or "
                                "a Hugging Face model folder holding one")
    return path


def _named_in_config(folder: str) -> dict[str, str]:
    """The special tokens a model folder's ``special_tokens_map.json`` and
    ``tokenizer_config.json`` name (``eos_token`` -> ``eos``); the first file wins."""
    names: dict[str, str] = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            with open(os.path.join(folder, file)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        for key in NAMES:
            value = meta.get(f"{key}_token") if isinstance(meta, dict) else None
            if isinstance(value, dict):  # {"content": "</s>", ...}
                value = value.get("content")
            if isinstance(value, str) and key not in names:
                names[key] = value
    return names


def special_tokens_of(hf) -> list[str]:
    """The added tokens of a ``tokenizers.Tokenizer`` marked special (else all added ones)."""
    added = hf.get_added_tokens_decoder()
    special = [t.content for _, t in sorted(added.items()) if t.special]
    return special or [t.content for _, t in sorted(added.items())]


def special_ids(hf, named: dict[str, str] | None = None, where: str = "") -> dict[str, int]:
    """Our special ids for a ``tokenizers.Tokenizer`` (see the module docstring); ``named``:
    the tokens a model folder's config names. Refuses a tokenizer without an end-of-text."""
    named = named or {}
    ids: dict[str, int] = {}
    for key, candidates in NAMES.items():
        for name in ([named[key]] if key in named else []) + list(candidates):
            found = hf.token_to_id(name)
            if found is not None:
                ids[key] = int(found)
                break
    if "eos" not in ids:
        have = special_tokens_of(hf)
        raise ValueError(
            f"{where or 'the tokenizer'} has no end-of-text token, which separates documents "
            f"in training: looked for {', '.join(EOS_NAMES)}"
            + (f" and {named['eos']!r} (its config's eos_token)" if "eos" in named else "")
            + f"; its special tokens are: {', '.join(have) if have else 'none'}. Add one "
            "(tokenizers: tok.add_special_tokens(['</s>'])) or train a tokenizer with "
            "'tjax tokenizer train', which adds " + ", ".join(TRAINED_SPECIALS))
    for key, other in FALLBACK.items():
        ids.setdefault(key, ids[other])
    return ids


class HFJsonTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer (``tokenizer.json``) with the project's interface."""

    name = KIND

    def __init__(self, file: str, special: dict[str, int], source: str | None = None) -> None:
        tokenizers = _library()
        try:
            self.hf = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # the library's own error type is not exported
            raise ValueError(f"{source or file}: not a Hugging Face tokenizer.json the "
                             f"tokenizers library can read ({e})") from None
        self.hf.encode_special_tokens = True  # text is text (module docstring)
        self.file = file
        self.special = dict(special)
        self._vocab_size = max(self.hf.get_vocab_size(with_added_tokens=True),
                               max(self.hf.get_vocab().values(), default=-1) + 1)
        self._specials = np.array(sorted(set(self.special.values())))

    @classmethod
    def from_path(cls, path: str) -> HFJsonTokenizer:
        """``hf:PATH``: a ``tokenizer.json`` file or a model folder holding one."""
        file = resolve_file(path)
        with open(file, "rb") as f:
            head = f.read()
        try:
            meta = json.loads(head)
        except ValueError as e:
            raise ValueError(f"hf:{path}: {file} is not JSON ({e})") from None
        if isinstance(meta, dict) and "kind" in meta and "model" not in meta:
            raise ValueError(f"hf:{path}: {file} is a transformers-jax run's tokenizer, not a "
                             "Hugging Face one; fine-tune from that run with --train.init_from "
                             "(its tokenizer comes with it)")
        tok = cls(file, {}, source=f"hf:{path}")
        named = _named_in_config(os.path.dirname(file)) if os.path.basename(file) == HF_FILE \
            else {}
        tok.special = special_ids(tok.hf, named, f"hf:{path}")
        tok._specials = np.array(sorted(set(tok.special.values())))
        return tok

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str | bytes) -> np.ndarray:
        ids = self.hf.encode(as_text(text), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        out = self.hf.encode_batch([as_text(t) for t in texts], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in out]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.vocab_size) & ~np.isin(ids, self._specials)]
        return self.hf.decode(ids.tolist(), skip_special_tokens=True)

    def special_hint(self, key: str) -> str:
        """What was looked for and what the file has, for an error about a missing ``key``."""
        have = special_tokens_of(self.hf)
        return (f"looked for {', '.join(NAMES.get(key, (key,)))}; its special tokens are: "
                f"{', '.join(have) if have else 'none'}")

    def save(self, directory: str) -> str:
        """Copy the ``tokenizer.json`` to ``directory/hf`` and write our ``tokenizer.json``."""
        target = os.path.join(directory, FILES_SUBDIR)
        os.makedirs(target, exist_ok=True)
        path = os.path.join(target, HF_FILE)
        with open(self.file, "rb") as f:
            data = f.read()
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return super().save(directory)

    def _config(self) -> dict:
        with open(self.file, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        return {"file": f"{FILES_SUBDIR}/{HF_FILE}", "sha256": digest}


def _restore(directory: str, meta: dict) -> HFJsonTokenizer:
    file = os.path.join(directory, meta.get("file", f"{FILES_SUBDIR}/{HF_FILE}"))
    with open(file, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != meta["sha256"]:
            raise ValueError(f"{file}: the Hugging Face tokenizer does not match its hash")
    return HFJsonTokenizer(file, meta["special"])


def train_hf_tokenizer(texts: Iterable[str | bytes], vocab_size: int, model: str = "bpe",
                       *, length: int | None = None):
    """A new ``tokenizers.Tokenizer`` trained on ``texts``: byte-level (every string encodes and
    decodes back exactly, no unknown token), BPE or unigram, with ``TRAINED_SPECIALS`` at ids
    0.. (unigram: ``<unk>`` too, never produced)."""
    tokenizers = _library()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if model not in MODELS:
        raise ValueError(f"model={model!r}: valid choices: {', '.join(MODELS)}")
    specials = list(TRAINED_SPECIALS) + (["<unk>"] if model == "unigram" else [])
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(alphabet) + len(specials) + 1
    if vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level {model}: its "
                         f"{len(alphabet)} byte symbols and {len(specials)} special tokens "
                         f"need vocab_size >= {minimum}")
    if model == "bpe":
        tok = tokenizers.Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                      initial_alphabet=alphabet, show_progress=False)
    else:
        tok = tokenizers.Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials,
                                          initial_alphabet=alphabet, unk_token="<unk>",
                                          show_progress=False)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    seen = [0]

    def text_of() -> Iterable[str]:
        for text in texts:
            seen[0] += 1
            yield as_text(text)

    tok.train_from_iterator(text_of(), trainer, length=length)
    if seen[0] == 0 or tok.get_vocab_size() <= len(specials):
        raise ValueError("the training text is empty; give the tokenizer some text")
    return tok


TOKENIZERS.add(KIND, TokenizerKind(_restore, from_path=HFJsonTokenizer.from_path))
