"""A Hugging Face tokenizer behind this project's ``Tokenizer`` interface.

``HFTokenizer`` wraps ``transformers.AutoTokenizer`` (GPT-2 byte-level BPE, Llama
SentencePiece, BERT WordPiece, T5 unigram: whatever the source directory ships), so a converted
run can encode prompts and decode samples with the tokenizer its weights were trained with.
It is saved like our own tokenizers: ``DIR/tokenizer.json`` (kind ``huggingface``, vocabulary
size, special ids) plus the original files under ``DIR/hf/``.

``encode`` adds no special tokens (the interface's contract: callers add bos/eos), ``decode``
drops them. Special ids missing from the Hugging Face tokenizer are absent from ``special``,
except ``pad``, which falls back to ``eos`` as ``generate`` does in ``transformers``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence

import numpy as np

from transformers_jax.data.tokenizers import TOKENIZER_FILE, Tokenizer, as_text

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
