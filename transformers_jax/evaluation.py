"""Evaluation, all of it: ``tjax eval`` (a trained, fine-tuned or converted run, evaluated
without writing Python), the held-out metrics the training loop logs, greedy exact match.

    result = evaluate_run("runs/gpt", lengths=[128, 256], passkey=True)

- held-out loss (nats per target token), perplexity and bits per unit: ``bits_per_byte`` when
  the tokenizer's ids are bytes (``Tokenizer.unit``), else ``bits_per_character`` or
  ``bits_per_token``; all of it on the run's own held-out batches by default (the very batches
  its training loop evaluated on), or on other data (``data``, ``split``);
- the mean loss at each of ``lengths`` (windows of that many tokens), and for next-token
  families the loss by position (mean over the windows of the loss at each position), also
  drawn as a PNG when matplotlib is installed;
- with ``passkey``, for families that generate: passkey retrieval, a random number hidden in
  filler text at a relative depth, asked for at the end, decoded greedily and scored by exact
  match, per length and depth;
- for a classifier run (``--train.objective=sequence_classification``): the held-out loss and
  accuracy on the labelled rows its training held out (or on every row of ``data``), with its
  class names (``RUN_DIR/labels.json``).

``held_out_metrics`` is the mean of an eval step over fixed batches: what the training loop
(``train/loop.py``) logs at each evaluation and what ``evaluate_run`` reports. Greedy decoding
scored against a synthetic task's targets is ``seq2seq_exact_match``.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax.config import ConfigError, TrainConfig
from transformers_jax.data.mixture import is_mixture
from transformers_jax.data.seq2seq import pack_seq2seq, task_pairs, task_shapes
from transformers_jax.data.sources import parse_spec
from transformers_jax.data.tokenizers import ByteTokenizer
from transformers_jax.learning.losses import token_losses
from transformers_jax.learning.objectives import apply_model
from transformers_jax.learning.step import make_eval_step
from transformers_jax.models.encdec import greedy_decode
from transformers_jax.runs.data import labelled_eval_batches, make_eval_batches
from transformers_jax.runs.load import Run, open_run
from transformers_jax.sample import SamplingConfig, check_generates, generate

PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
                  "There and back again. ")
PASSKEY_QUESTION = "What is the pass key? The pass key is"
PASSKEY_DEPTHS = (0.0, 0.5, 1.0)


def passkey_needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def _check_run(run_dir: str) -> None:
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(
            f"no run directory at {run_dir!r}; pass the --run-dir of a tjax train run or the "
            "--out of tjax convert --from-hf")


def _check_length(config, length: int) -> None:
    if length <= 1:
        raise ValueError(f"--lengths {length}: a window needs at least 2 tokens")
    limit = config.position.max_length(config)
    if limit is not None and length > limit:
        raise ValueError(
            f"--lengths {length} is longer than the model's positions "
            f"(position={config.position.name}: {config.position.limit_text(config)}); "
            f"evaluate at lengths up to {limit}, or train a model whose positions extrapolate "
            "(rope, alibi)")


def mean_metrics(rows: Sequence[dict]) -> dict[str, float]:
    """Each metric's mean over ``rows`` (host values, one dict per step or batch)."""
    return {k: float(np.mean([float(r[k]) for r in rows])) for k in rows[0]}


def held_out_metrics(eval_step: Callable, params, batches: Sequence[dict]) -> dict[str, float]:
    """Mean metrics over a fixed list of held-out batches (``eval_step(params, batch) ->
    metrics``, e.g. ``learning.step.make_eval_step``'s or a parallel trainer's)."""
    return mean_metrics(jax.device_get([eval_step(params, batch) for batch in batches]))


def _per_position(model, objective):
    """A jitted ``(params, batch) -> (loss sum [T], weight sum [T])`` of next-token loss."""

    @jax.jit
    def sums(params, batch):
        logits_BTV = apply_model(model, params, batch, objective.input_keys).astype(jnp.float32)
        loss_BT = token_losses(logits_BTV, batch["targets"])
        weights_BT = batch.get("weights")
        weights_BT = jnp.ones_like(loss_BT) if weights_BT is None else weights_BT
        return (loss_BT * weights_BT).sum(0), weights_BT.sum(0)

    return sums


def _figures(loss: float, unit: str) -> dict:
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            f"bits_per_{unit}": loss / math.log(2)}


def evaluate_run(
    run_dir: str,
    *,
    data: str | None = None,
    split: str | None = None,
    lengths: Sequence[int] | None = None,
    batches: int | None = None,
    passkey: bool = False,
    passkey_lengths: Sequence[int] | None = None,
    passkey_trials: int = 4,
    passkey_depths: Sequence[float] = PASSKEY_DEPTHS,
    passkey_digits: int = 5,
    step: int | None = None,
    plot: str | None = None,
    seed: int = 0,
) -> dict:
    """Evaluate ``run_dir`` (see the module docstring); returns one JSON-ready dict.

    ``data``/``split``: text to read instead of the run's own held-out split (local text is
    read whole; a tfds dataset: its validation or test split, or the ``split`` named).
    ``lengths``: window lengths (default the run's ``seq_len``).
    ``batches``: batches per length (default the run's ``eval_batches``). ``passkey_lengths``:
    prompt-plus-answer lengths of the passkey test (default ``lengths``). ``plot``: the PNG of
    the loss by position (None: no file). ``step``: the checkpoint (default the latest).
    """
    _check_run(run_dir)
    run = open_run(run_dir, step)
    model, params, tokenizer, config = run.model, run.params, run.tokenizer, run.config
    meta, train_cfg = run.meta, run.train_config
    if tokenizer is None:
        raise ValueError(
            f"{run_dir} has no tokenizer this project can load (converted with an external "
            "tokenizer), and tjax eval reads text: convert it again from a directory that "
            "holds tokenizer.json, or evaluate from Python on token ids "
            "(transformers_jax.learning.step.make_eval_step)")
    cfg: TrainConfig = train_cfg.replace(run_dir=None,
                                         eval_batches=batches or train_cfg.eval_batches)
    if data is not None:
        cfg = cfg.replace(data=data, task=None)
    if run.classifier:  # labelled rows, held out (or all of another file, like text below)
        return _evaluate_classifier(run, cfg, whole=data is not None, split=split,
                                    lengths=lengths, passkey=passkey)
    if split is not None and not cfg.task and parse_spec(cfg.data).kind not in ("tfds", "hf"):
        raise ValueError(f"--split {split}: splits are read from tfds and hub datasets (--data "
                         f"tfds:NAME, hf:NAME); {cfg.data or 'the default corpus'} is local "
                         "text whose held-out part is read by default: drop --split")
    # Local text given with --data is evaluated whole (it is not the run's training text, so
    # nothing of it needs holding out); the run's own data, its held-out part.
    read = split
    if data is not None and split is None and (
        is_mixture(data) or parse_spec(data).kind not in ("tfds", "hf")
    ):  # a mixture: each part read as it would be alone
        read = "train"  # local text has one split: all of it
    lengths = [int(n) for n in (lengths or [train_cfg.seq_len])]
    passkey_lengths = [int(n) for n in (passkey_lengths or lengths)]
    for length in {*lengths, *(passkey_lengths if passkey else ())}:
        _check_length(config, length)
    if passkey:
        try:
            check_generates(config)
        except ConfigError as err:
            raise ValueError(f"--passkey needs a model that generates; {run_dir}: {err}; "
                             "or drop --passkey") from None

    objective = run.objective
    eval_step = jax.jit(make_eval_step(model, objective))
    by_position = _per_position(model, objective) if objective.per_position else None
    unit = tokenizer.unit
    result: dict = {
        "run": run_dir, "step": int(meta["step"]), "family": config.family,
        "data": cfg.task and f"task:{cfg.task}" or cfg.data or "the default corpus",
        "split": split or ("all of --data" if read else "held-out"),
        "tokenizer": tokenizer.name, "unit": unit,
        "batches": cfg.eval_batches, "batch_size": cfg.batch_size,
    }
    notes = []
    if unit == "byte":
        notes.append("bits_per_byte counts the bos/eos ids among the bytes")
    by_length, curves = [], {}
    for length in sorted(set(lengths) | {train_cfg.seq_len}):
        eval_batches = make_eval_batches(config, cfg.replace(seq_len=length), tokenizer, read)
        loss = held_out_metrics(eval_step, params, eval_batches)["loss"]
        entry = {"length": length, **_figures(loss, unit)}
        if by_position is not None:
            total, count = np.zeros(length), np.zeros(length)
            for b in eval_batches:
                s, c = jax.device_get(by_position(params, b))
                total, count = total + s, count + c
            curve = [float(t / c) if c else None for t, c in zip(total, count, strict=True)]
            curves[length] = curve
            entry["loss_by_position"] = curve
        if length == train_cfg.seq_len:
            result.update(_figures(loss, unit))
            result["seq_len"] = length
        if length in lengths:
            by_length.append(entry)
    result["by_length"] = by_length
    if by_position is None:
        notes.append(f"no loss by position: the {objective.name} objective does not predict "
                     "the next token at every position")
    result["plot"] = None
    if plot and curves:
        result["plot"] = _plot(curves, plot, run_dir, unit, notes)
    if passkey:
        result["passkey"] = passkey_accuracy(
            model, params, tokenizer, passkey_lengths, passkey_depths, passkey_trials,
            passkey_digits, seed)
    result["notes"] = notes
    return result


def _evaluate_classifier(run: Run, cfg: TrainConfig, *, whole: bool, split: str | None,
                         lengths: Sequence[int] | None, passkey: bool) -> dict:
    """A classifier's held-out loss and accuracy on labelled rows (``evaluate_run``)."""
    refused = [name for name, given in (("--split", split), ("--lengths", lengths),
                                        ("--passkey", passkey)) if given]
    if refused:
        raise ValueError(
            f"{run.directory} holds a {run.objective.name} classifier, evaluated on labelled "
            f"rows as it was trained ({cfg.seq_len} tokens); {', '.join(refused)} apply to "
            "language models: drop them (--data PATH.jsonl evaluates every row of another "
            "labelled file)")
    batches, examples = labelled_eval_batches(cfg, run.tokenizer, run.labels, whole=whole)
    metrics = held_out_metrics(jax.jit(make_eval_step(run.model, run.objective)), run.params,
                               batches)
    return {
        "run": run.directory, "step": run.step, "family": run.config.family,
        "objective": run.objective.name, "labels": list(run.labels), "data": cfg.data,
        "split": "all of --data" if whole else "held-out",
        "examples": examples, "tokenizer": run.tokenizer.name,
        "batches": len(batches), "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
        "loss": metrics["loss"], "accuracy": metrics["accuracy"],
        "notes": (["the last batch repeats rows to fill it: the figures weigh those twice"]
                  if len(batches) * cfg.batch_size > examples else []),
    }


def _plot(curves: dict[int, list], path: str, run_dir: str, unit: str, notes: list) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        notes.append("no PNG: matplotlib is not installed (pip install 'transformers-jax"
                     "[experiments]' or pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for length, curve in sorted(curves.items()):
        ys = [np.nan if y is None else y for y in curve]
        ax.plot(np.arange(1, len(ys) + 1), ys, label=f"windows of {length}")
    ax.set_xlabel("position in the window (tokens of context + 1)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(f"loss by position: {os.path.basename(os.path.abspath(run_dir))}")
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def passkey_prompt(tokenizer, key: str, length: int, depth: float) -> list[int]:
    """Token ids of exactly ``length`` tokens: filler with the key's sentence at ``depth``
    (0: first, 1: just before the question), then the question."""
    needle = list(tokenizer.encode(passkey_needle(key)))
    question = list(tokenizer.encode(PASSKEY_QUESTION))
    room = length - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"a passkey prompt of {length} tokens is too short for the key and "
                         f"the question ({len(needle) + len(question)} tokens); use longer "
                         "--passkey-lengths")
    unit = list(tokenizer.encode(PASSKEY_FILLER))
    filler = (unit * (room // max(len(unit), 1) + 1))[:room]
    cut = round(depth * room)
    return [int(t) for t in filler[:cut] + needle + filler[cut:] + question]


def passkey_accuracy(model, params, tokenizer, lengths: Sequence[int],
                     depths: Sequence[float] = PASSKEY_DEPTHS, trials: int = 4,
                     digits: int = 5, seed: int = 0) -> dict:
    """Exact-match passkey retrieval by length (prompt plus answer) and depth: ``trials``
    random ``digits``-digit keys per cell, decoded greedily in one batch per length."""
    rng = np.random.default_rng(seed)
    answer_len = len(tokenizer.encode(" " + "9" * digits)) + 2
    cells = []
    for length in lengths:
        keys = [[str(rng.integers(10 ** (digits - 1), 10 ** digits)) for _ in range(trials)]
                for _ in depths]
        prompts = [passkey_prompt(tokenizer, key, length - answer_len, depth)
                   for depth, row in zip(depths, keys, strict=True) for key in row]
        sampling = SamplingConfig(max_new_tokens=answer_len, temperature=0.0,
                                  stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id,
                                  bos_id=tokenizer.bos_id)
        outputs = iter(generate(model, params, prompts, sampling))
        for depth, row in zip(depths, keys, strict=True):
            records = []
            for key in row:
                answer = tokenizer.decode(next(outputs))
                found = re.match(r"\s*(\d+)", answer)
                records.append({"key": key, "answer": answer,
                                "correct": bool(found and found.group(1) == key)})
            cells.append({"length": int(length), "depth": float(depth),
                          "accuracy": float(np.mean([r["correct"] for r in records])),
                          "trials": records})
    by_length = {str(n): float(np.mean([c["accuracy"] for c in cells if c["length"] == n]))
                 for n in lengths}
    return {"digits": digits, "trials_per_cell": trials, "accuracy_by_length": by_length,
            "cells": cells}


def seq2seq_exact_match(model, params, task: str, sizes: Sequence[int], n_per_size: int = 64,
                        seed: int = 1234, tokenizer=None) -> dict[int, float]:
    """Greedy-decoding exact-match accuracy of an encoder-decoder per task size
    (``data/seq2seq.py``'s synthetic tasks).

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


@functools.lru_cache(maxsize=16)
def window_losses(model):
    """A jitted ``(params, windows [B, L+1]) -> next-token losses [B, L]``, one per model
    (equal configs make equal modules, so every seed of a cell reuses one compile)."""

    @jax.jit
    def losses(params, windows_BT):
        batch = {"inputs": windows_BT[:, :-1]}
        logits_BTV = apply_model(model, params, batch).astype(jnp.float32)
        return token_losses(logits_BTV, windows_BT[:, 1:])

    return losses


def stream_losses(model, params, tokens_N: np.ndarray, length: int, stride: int | None = None,
                  batch_size: int = 8) -> np.ndarray:
    """The next-token loss of every position of a token stream ``[N]`` scored in windows of
    ``length`` (``[i]``: the loss of predicting ``tokens[i]``; NaN where no window scores it),
    so that runs and lengths scored on one stream pair position by position.

    ``stride=None``: windows side by side, every position scored once (the first ones of a
    window with little context). ``stride=S``: a window starts every S tokens and scores only
    its last S positions (the first window all of its), so each has ``length - S`` tokens of
    context or more (sliding-window evaluation).
    """
    step = stride or length
    if stride is not None and not 0 < stride <= length:
        raise ValueError(f"stride={stride}: must be in [1, length={length}]")
    starts = list(range(0, len(tokens_N) - length, step))
    if not starts:
        raise ValueError(f"a held-out stream of {len(tokens_N)} tokens is too short for windows "
                         f"of {length}: hold out more text")
    losses_fn = window_losses(model)
    out = np.full(len(tokens_N), np.nan)
    for i in range(0, len(starts), batch_size):
        chunk = starts[i : i + batch_size]
        padded = chunk + [chunk[-1]] * (batch_size - len(chunk))  # one shape: one compile
        windows = np.stack([tokens_N[s : s + length + 1] for s in padded]).astype(np.int32)
        loss_BT = np.asarray(losses_fn(params, windows))
        for row, s in enumerate(chunk):
            keep = length if stride is None or s == 0 else stride
            out[s + length + 1 - keep : s + length + 1] = loss_BT[row, length - keep:]
    return out
