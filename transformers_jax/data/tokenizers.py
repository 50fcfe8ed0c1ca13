"""Tokenizers. Byte-level needs no training and never meets an unknown symbol."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SPECIAL_TOKENS = ("pad", "bos", "eos", "mask", "cls", "sep")


class ByteTokenizer:
    """UTF-8 bytes 0..255, then the special tokens (pad=256, bos=257, ...)."""

    name = "byte"

    def __init__(self) -> None:
        self.special = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIAL_TOKENS)

    @property
    def pad_id(self) -> int:
        return self.special["pad"]

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        # Special tokens are dropped; a cut multi-byte character becomes U+FFFD, never an error.
        data = bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")
