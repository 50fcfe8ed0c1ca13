"""Language-model batches drawn from one long token array.

Batch ``i`` is a pure function of (seed, i): the run can resume at any step and see exactly the
batches it would have seen, with no iterator state beyond the step number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenSplits:
    train: np.ndarray  # int32 [N_train]
    val: np.ndarray  # int32 [N_val]


def split_tokens(tokens: np.ndarray, val_fraction: float, seq_len: int) -> TokenSplits:
    """Hold out the last ``val_fraction`` of the corpus for evaluation."""
    need = seq_len + 1
    n_val = max(int(len(tokens) * val_fraction), need)
    if len(tokens) - n_val < need:
        raise ValueError(
            f"corpus of {len(tokens)} tokens is too short for seq_len={seq_len} with a "
            f"validation split of {val_fraction}: need at least {2 * need} tokens; use more "
            "text or a shorter train.seq_len"
        )
    return TokenSplits(train=tokens[:-n_val], val=tokens[-n_val:])


def lm_batch(
    tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, index: int, prefix: bool = False
) -> dict:
    """Random windows of ``seq_len + 1`` tokens: inputs and next-token targets, ``[B, T]``.

    With ``prefix`` (prefix-LM), each row also gets a random ``prefix_len`` in [1, T/2] and
    ``weights`` that keep the loss only on tokens after the prefix.
    """
    rng = np.random.default_rng([seed & 0xFFFFFFFF, index])
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    windows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
    batch = {"inputs": windows[:, :-1], "targets": windows[:, 1:]}
    if prefix:
        prefix_len = rng.integers(1, max(seq_len // 2, 1) + 1, size=batch_size).astype(np.int32)
        # target t is token t+1: it lies after the prefix when t + 1 >= prefix_len
        batch["prefix_len"] = prefix_len
        batch["weights"] = (np.arange(seq_len)[None] + 1 >= prefix_len[:, None]).astype(
            np.float32
        )
    return batch
