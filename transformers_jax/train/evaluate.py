"""Evaluation beyond the objectives' teacher-forced metrics: greedy decoding scored against
the targets of a synthetic task (``data/seq2seq.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from transformers_jax.data.seq2seq import pack_seq2seq, task_pairs, task_shapes
from transformers_jax.data.tokenizers import ByteTokenizer
from transformers_jax.models.encdec import greedy_decode


def seq2seq_exact_match(model, params, task: str, sizes: Sequence[int], n_per_size: int = 64,
                        seed: int = 1234, tokenizer=None) -> dict[int, float]:
    """Greedy-decoding exact-match accuracy of an encoder-decoder per task size.

    For each size, ``n_per_size`` fresh examples are decoded greedily (``greedy_decode``) and
    an example counts when the output up to its first ``eos`` equals the target.
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    sp = tokenizer.special
    results = {}
    S, T = task_shapes(task, max(int(s) for s in sizes))  # one shape: one compilation
    for size in sizes:
        pairs = task_pairs(task, [size] * n_per_size, seed + 1000 * int(size), tokenizer)
        batch = pack_seq2seq(pairs, S, T, tokenizer)
        out = np.asarray(greedy_decode(
            model, params, jnp.asarray(batch["encoder_inputs"]), max_len=T,
            bos_id=sp["bos"], eos_id=sp["eos"], pad_id=sp["pad"],
            encoder_segment_ids=jnp.asarray(batch["encoder_segment_ids"]),
        ))
        correct = [
            np.array_equal(out[i, : len(tgt) + 1], np.append(tgt, sp["eos"]))
            for i, (_, tgt) in enumerate(pairs)
        ]
        results[int(size)] = float(np.mean(correct))
    return results
