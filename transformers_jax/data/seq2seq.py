"""Sequence-to-sequence batches: the synthetic tasks of ``data/synthetic.py`` (``reverse``,
``copy``, ``addition``...) as (source ids, target ids) pairs, packed for an encoder-decoder
(the ``seq2seq`` objective). ``data/prefix_lm.py`` packs the same pairs for a decoder-only
prefix-LM.

Shape legend: B batch, S encoder length, T decoder length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from transformers_jax.data.synthetic import get_task
from transformers_jax.data.tokenizers import ByteTokenizer


def task_pairs(task: str, sizes: Sequence[int], seed: int, tokenizer=None) -> list[tuple]:
    """(prompt ids, answer ids) of ``data/synthetic.py``'s ``task``, one per size in ``sizes``
    (string length, or digits per operand for addition), from one generator seeded by seed."""
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    make = get_task(task).make
    rng = np.random.default_rng([seed & 0xFFFFFFFF, 7])
    pairs = []
    for n in sizes:
        src, tgt = make(rng, int(n))
        pairs.append((tokenizer.encode(src), tokenizer.encode(tgt)))
    return pairs


def task_shapes(task: str, max_size: int) -> tuple[int, int]:
    """(S, T): encoder and decoder lengths that hold every example up to ``max_size`` (+ eos),
    for one byte/char token per character."""
    prompt_chars, answer_chars = get_task(task).max_chars(max_size)
    return prompt_chars + 1, answer_chars + 1


def pack_seq2seq(pairs: Sequence[tuple], source_len: int, target_len: int,
                 tokenizer=None) -> dict:
    """Encoder-decoder batch from (source ids, target ids) pairs.

    Encoder: ``src eos pad..`` with ``encoder_segment_ids`` 1 on real tokens, 0 on padding.
    Decoder: ``inputs = bos tgt pad..`` (targets shifted right), ``targets = tgt eos pad..``,
    ``weights`` and ``segment_ids`` 1 on the ``len(tgt) + 1`` real positions. Positions are
    left to the model's defaults (0, 1, ... on each side).
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    pad, bos, eos = (tokenizer.special[k] for k in ("pad", "bos", "eos"))
    B = len(pairs)
    enc = np.full((B, source_len), pad, np.int32)
    dec_in = np.full((B, target_len), pad, np.int32)
    dec_out = np.full((B, target_len), pad, np.int32)
    for i, (src, tgt) in enumerate(pairs):
        if len(src) + 1 > source_len or len(tgt) + 1 > target_len:
            raise ValueError(f"example {i} (source {len(src)}, target {len(tgt)} tokens) does "
                             f"not fit source_len={source_len}, target_len={target_len} with eos")
        enc[i, : len(src)] = src
        enc[i, len(src)] = eos
        dec_in[i, 0] = bos
        dec_in[i, 1 : len(tgt) + 1] = tgt
        dec_out[i, : len(tgt)] = tgt
        dec_out[i, len(tgt)] = eos
    enc_seg = (np.arange(source_len)[None] <= np.array([len(s) for s, _ in pairs])[:, None])
    dec_seg = (np.arange(target_len)[None] <= np.array([len(t) for _, t in pairs])[:, None])
    return {
        "encoder_inputs": enc,
        "encoder_segment_ids": enc_seg.astype(np.int32),
        "inputs": dec_in,
        "targets": dec_out,
        "weights": dec_seg.astype(np.float32),
        "segment_ids": dec_seg.astype(np.int32),
    }


def seq2seq_batch(task: str, batch_size: int, seed: int, index: int, *, min_size: int = 1,
                  max_size: int = 8, tokenizer=None) -> dict:
    """A batch of ``task`` with sizes uniform in ``[min_size, max_size]`` (string length;
    digits per operand for addition), padded to the shapes of ``max_size``. Pure in (seed,
    index)."""
    if not 1 <= min_size <= max_size:
        raise ValueError(f"task sizes [{min_size}, {max_size}]: need 1 <= min_size <= max_size")
    rng = np.random.default_rng([seed & 0xFFFFFFFF, index])
    sizes = rng.integers(min_size, max_size + 1, size=batch_size)
    pairs = task_pairs(task, sizes, int(rng.integers(0, 2**31)), tokenizer)
    return pack_seq2seq(pairs, *task_shapes(task, max_size), tokenizer)
