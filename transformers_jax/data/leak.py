"""How much held-out text also occurs verbatim in the training text.

``overlap(train, heldout, width)`` is the share of the held-out ``width``-byte windows (every
start position inside one document) whose bytes also form a training window. A window is
compared by a 64-bit polynomial hash, so a collision can only overstate the share. Repeated
boilerplate shows here as a few percent, a leaked document as a share near one.

The hashes of all windows are computed with a handful of vectorised passes over the bytes of
many documents at once (hashes of length ``k`` windows combine into length ``2k`` ones), so
100 MB of training text takes tens of seconds on one core.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

_BASE = np.uint64(0x100000001B3)  # odd: multiplying by it is a bijection of uint64
_BATCH_BYTES = 32 << 20  # documents hashed together, about this many bytes at a time


def _power(k: int) -> np.uint64:
    with np.errstate(over="ignore"):
        return np.uint64(pow(int(_BASE), k, 1 << 64))


def _hash_windows(data: np.ndarray, width: int) -> np.ndarray:
    """``[len(data) - width + 1]`` uint64: the hash of ``data[i : i + width]`` for each ``i``,
    ``sum_j data[i + j] * BASE ** (width - 1 - j)`` modulo ``2 ** 64``."""
    n = data.size - width + 1
    block = data.astype(np.uint64)  # hashes of the windows of length `size` at each start
    size, out, out_len = 1, None, 0
    with np.errstate(over="ignore"):
        while True:
            if width & size:  # append this block's windows to the ones already combined
                if out is None:
                    out, out_len = block[: data.size - size + 1].copy(), size
                else:
                    m = data.size - out_len - size + 1
                    out = out[:m] * _power(size) + block[out_len : out_len + m]
                    out_len += size
            if size * 2 > width:
                break
            block = block[: block.size - size] * _power(size) + block[size:]
            size *= 2
    return out[:n]


def window_hashes(texts: Iterable[bytes], width: int) -> tuple[np.ndarray, np.ndarray]:
    """The hashes of every ``width``-byte window inside each text, and the index of the text
    each window lies in (two ``[windows]`` arrays). Texts shorter than ``width`` have none."""
    hashes, owners = [], []
    batch: list[bytes] = []
    first, size = 0, 0

    def flush() -> None:
        nonlocal first
        if batch:
            data = np.frombuffer(b"".join(batch), np.uint8)
            lengths = np.array([len(t) for t in batch], np.int64)
            if data.size >= width:
                ends = np.cumsum(lengths)
                owner = np.repeat(np.arange(first, first + len(batch)), lengths)
                h = _hash_windows(data, width)
                owner = owner[: h.size]
                inside = np.arange(h.size) + width <= ends[owner - first]
                hashes.append(h[inside])
                owners.append(owner[inside])
            first += len(batch)
            batch.clear()

    for text in texts:
        batch.append(bytes(text))
        size += len(text)
        if size >= _BATCH_BYTES:
            flush()
            size = 0
    flush()
    if not hashes:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    return np.concatenate(hashes), np.concatenate(owners)


def train_index(train_texts: Iterable[bytes], width: int) -> np.ndarray:
    """The sorted distinct hashes of the training windows, what ``found_per_text`` looks up."""
    train = np.sort(window_hashes(train_texts, width)[0])  # np.unique is many times slower
    if train.size:
        train = train[np.concatenate(([True], train[1:] != train[:-1]))]
    return train


def found_per_text(
    train: Iterable[bytes] | np.ndarray, heldout_texts: Iterable[bytes], width: int = 64
) -> tuple[np.ndarray, np.ndarray]:
    """For each held-out text: its number of ``width``-byte windows and how many of them are
    also training windows (two ``[held-out texts]`` int64 arrays). ``train``: the training
    texts, or their ``train_index``."""
    heldout_texts = list(heldout_texts)
    if not isinstance(train, np.ndarray):
        train = train_index(train, width)
    held, owner = window_hashes(heldout_texts, width)
    pos = np.minimum(np.searchsorted(train, held), max(train.size - 1, 0))
    hit = train[pos] == held if train.size else np.zeros(held.size, bool)
    n = len(heldout_texts)
    return (np.bincount(owner, minlength=n).astype(np.int64),
            np.bincount(owner, weights=hit, minlength=n).astype(np.int64))


def overlap(train_texts, heldout_texts, width: int = 50) -> dict:
    """The share of held-out ``width``-byte windows found among the training ones:
    ``{"window_bytes", "heldout_windows", "found_in_training", "share"}``."""
    windows, found = found_per_text(train_texts, heldout_texts, width)
    total, hits = int(windows.sum()), int(found.sum())
    return {"window_bytes": width, "heldout_windows": total, "found_in_training": hits,
            "share": hits / total if total else 0.0}
