"""Finding the tokenizer of a Hugging Face checkpoint directory.

``HFTokenizer`` (``data/tokenizers.py``) wraps ``transformers.AutoTokenizer`` behind this
project's ``Tokenizer`` interface; it lives in ``data/`` because ``load_tokenizer`` restores it
from a run directory. This module says whether a source directory has such a tokenizer, or
one of ours.
"""

from __future__ import annotations

import json
import os

from transformers_jax.data.tokenizers import HFTokenizer

__all__ = ["HFTokenizer", "has_hf_tokenizer", "is_tjax_tokenizer_file"]

# Any of these means the directory really has a tokenizer (config files alone do not).
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                "sentencepiece.bpe.model")


def has_hf_tokenizer(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, name)) for name in _VOCAB_FILES)


def is_tjax_tokenizer_file(path: str) -> bool:
    """Whether ``path`` is one of our ``tokenizer.json`` files (not a Hugging Face one)."""
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "format_version" in meta and "kind" in meta
