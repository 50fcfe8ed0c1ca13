"""A task sweep's scores (``[eval.task]``): exact match of a run trained on a synthetic task
(``--task NAME``, ``data/synthetic.py``) at each task length, example by example.

The test examples are the task's test split drawn by ``[eval.task] seed``, ``examples`` at each
length: the same for every cell of one task and every seed, so two cells pair example by
example (the bootstrap's unit). An example is right when the teacher-forced argmax predicts
every answer token and the eos: that holds exactly when greedy decoding writes the answer
and stops, at the cost of one forward pass.
"""

from __future__ import annotations

import numpy as np

from transformers_jax.data.synthetic import FORMATS, exact_match, get_task
from transformers_jax.registry import FAMILIES


def row_tokens(task: str, family: str, length: int) -> int:
    """Tokens a decoder row of task length ``length`` needs (an upper bound: one token per
    character, as the byte tokenizer)."""
    prompt, answer = get_task(task).max_chars(length)
    return max(FORMATS[FAMILIES.get(family).tasks].row_lengths(prompt, answer).values())


def test_batch(
    task: str,
    family: str,
    tokenizer,
    length: int,
    seq_len: int,
    examples: int,
    seed: int,
    prefix: bool,
) -> dict:
    """The ``examples`` test examples of task length ``length``, as one batch of rows of
    ``seq_len`` tokens (one shape for every length: one compile)."""
    from transformers_jax.data.pipeline import make_task_iterator

    fmt = FAMILIES.get(family).tasks
    batches = make_task_iterator(
        task,
        tokenizer,
        seq_len,
        examples,
        seed,
        split="test",
        train_lengths=(length, length),
        test_lengths=(length, length),
        fmt=fmt,
        prefix=prefix and FORMATS[fmt].takes_prefix,
        num_examples=examples,
        num_threads=1,
    )
    return next(batches)


def train_batch(model_cfg, train_cfg, tokenizer) -> dict:
    """One training batch of the cell's task, as its run draws them (the dry run times a
    step on it: a prefix-LM needs ``prefix_len``, an encoder-decoder its encoder rows)."""
    from transformers_jax.data.pipeline import make_task_iterator

    fmt = FAMILIES.get(model_cfg.family).tasks
    return next(make_task_iterator(
        train_cfg.task, tokenizer, train_cfg.seq_len, train_cfg.batch_size, train_cfg.seed,
        train_lengths=train_cfg.train_lengths, test_lengths=train_cfg.test_lengths, fmt=fmt,
        prefix=model_cfg.mask.needs_prefix_len and FORMATS[fmt].takes_prefix,
        num_threads=1))


def task_scores(model, params, tokenizer, model_cfg, task: str, settings) -> dict:
    """``{str(length): {"mean", "chunks"}}``: exact match (1.0 / 0.0) of each test example at
    each task length of ``settings`` (``[eval.task]``: lengths, examples, seed), in the order
    they are drawn."""
    import jax

    seq_len = row_tokens(task, model_cfg.family, max(settings.lengths))
    prefix = model_cfg.mask.needs_prefix_len
    forward = jax.jit(lambda p, b: exact_logits(model, p, b))
    out = {}
    for n in settings.lengths:
        batch = test_batch(
            task, model_cfg.family, tokenizer, n, seq_len, settings.examples, settings.seed, prefix
        )
        predicted = np.asarray(forward(params, batch))
        right = exact_match(predicted, batch["targets"], batch["weights"]).astype(float)
        out[str(n)] = {"tokens": n, "mean": float(right.mean()), "chunks": right.tolist()}
    return out


def exact_logits(model, params, batch: dict):
    """The argmax ids under teacher forcing ``[B, T]`` (jit-able)."""
    from transformers_jax.learning.objectives import apply_model

    return apply_model(model, params, batch).argmax(-1)
