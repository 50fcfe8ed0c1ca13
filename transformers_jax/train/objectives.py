"""Training objectives per model family, and the batches that feed them.

Shape legend: B batch, T (decoder/model) length, S encoder length, V vocabulary, L labels.

An objective is a loss function ``(model, params, batch, rng, deterministic) -> (loss, metrics)``
plus the batch keys its model reads. ``OBJECTIVES`` maps names to them and
``FAMILY_OBJECTIVES`` gives each family its default (``gpt`` -> ``lm``, ``bert`` -> ``mlm``,
``encdec`` -> ``seq2seq``). ``train/step.py``'s ``init_state``, ``make_train_step`` and
``make_eval_step`` take any of them (``objective=``; default ``lm``).

Batches (pure functions of ``(seed, index)``, like the rest of the data code):

- ``MaskedBatches`` / ``mask_eval_batches``: the training loop's text-pipeline batches turned
  into masked-LM batches by ``data/mlm.py`` (padding and special ids are never chosen).
- ``mlm_batch``: the same from a plain token array, rows framed ``[CLS] ... [SEP]``.
- ``seq2seq_batch``: a synthetic task of ``data/synthetic.py`` (``reverse``, ``copy``,
  ``addition``...) as an encoder-decoder batch; ``pack_seq2seq`` does the same for any
  (source ids, target ids) pairs, and ``seq2seq_exact_match`` scores greedy decoding per length.
- ``prefix_lm_batch``: the same pairs as one decoder-only row, ``[bos] src [sep] tgt [eos]``,
  with ``prefix_len`` covering ``[bos] src [sep]`` and the loss on the target only.
- ``load_classification`` + ``classification_batch``: a tfds classification dataset
  (``imdb_reviews``, ``glue/sst2``...) read by random access through ``tfds.data_source``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from transformers_jax.data.mlm import (
    BERT_MASKING,
    MaskingConfig,
    mask_batch,
    mask_tokens,
    special_ids_of,
)
from transformers_jax.data.synthetic import get_task
from transformers_jax.data.tokenizers import ByteTokenizer
from transformers_jax.models.encdec import greedy_decode
from transformers_jax.registry import Registry
from transformers_jax.train.step import lm_loss

LossFn = Callable[[nn.Module, Any, dict, "jax.Array | None", bool], tuple[jax.Array, dict]]

# Model inputs --------------------------------------------------------------------------------

GPT_INPUTS = ("positions", "segment_ids", "prefix_len")
BERT_INPUTS = ("token_types", "positions", "segment_ids", "prefix_len")
ENCDEC_INPUTS = (
    "encoder_inputs", "positions", "segment_ids", "encoder_positions", "encoder_segment_ids",
    "prefix_len",
)


def model_inputs(batch: dict, keys: Sequence[str]) -> dict:
    """The keyword inputs among ``keys`` that the batch carries (absent or None: left out)."""
    return {k: batch[k] for k in keys if batch.get(k) is not None}


def apply_model(model: nn.Module, params, batch: dict, keys: Sequence[str], rng=None,
                deterministic: bool = True) -> jax.Array:
    """``model.apply`` on ``batch["inputs"]`` and the batch's optional inputs among ``keys``;
    dropout only when not deterministic (then ``rng`` is required)."""
    rngs = None if deterministic or rng is None else {"dropout": rng}
    return model.apply({"params": params}, batch["inputs"], **model_inputs(batch, keys),
                       deterministic=deterministic, rngs=rngs)


# Loss functions ------------------------------------------------------------------------------


def _token_metrics(logits_BTV, targets_BT, weights_BT) -> tuple[jax.Array, dict]:
    weights_BT = jnp.ones(targets_BT.shape, jnp.float32) if weights_BT is None else weights_BT
    loss, accuracy = lm_loss(logits_BTV, targets_BT, weights_BT)
    return loss, {"loss": loss, "accuracy": accuracy, "tokens": weights_BT.sum()}


def lm_objective(model, params, batch, rng=None, deterministic=True):
    """Next-token cross-entropy (decoder-only; prefix-LM skips the prefix through weights)."""
    logits = apply_model(model, params, batch, GPT_INPUTS, rng, deterministic)
    return _token_metrics(logits, batch["targets"], batch.get("weights"))


def mlm_objective(model, params, batch, rng=None, deterministic=True):
    """Masked-LM cross-entropy and accuracy on the chosen positions only (``weights``)."""
    logits = apply_model(model, params, batch, BERT_INPUTS, rng, deterministic)
    return _token_metrics(logits, batch["targets"], batch["weights"])


def seq2seq_objective(model, params, batch, rng=None, deterministic=True):
    """Teacher-forced target cross-entropy; ``sequence_accuracy`` is the share of rows whose
    every target token is the argmax, which equals greedy exact match (each greedy step then
    sees exactly the teacher-forced prefix)."""
    logits = apply_model(model, params, batch, ENCDEC_INPUTS, rng, deterministic)
    loss, metrics = _token_metrics(logits, batch["targets"], batch["weights"])
    metrics["sequence_accuracy"] = sequence_accuracy(logits, batch["targets"], batch["weights"])
    return loss, metrics


def sequence_accuracy(logits_BTV, targets_BT, weights_BT) -> jax.Array:
    """Share of rows whose argmax is right at every weighted position."""
    wrong_BT = (jnp.argmax(logits_BTV, -1) != targets_BT) & (weights_BT > 0)
    return 1.0 - jnp.any(wrong_BT, axis=-1).astype(jnp.float32).mean()


def sequence_classification_objective(model, params, batch, rng=None, deterministic=True):
    """Cross-entropy of ``[B, L]`` logits against integer ``labels [B]``."""
    logits_BL = apply_model(model, params, batch, BERT_INPUTS, rng, deterministic)
    labels_B = batch["labels"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits_BL, labels_B).mean()
    accuracy = (jnp.argmax(logits_BL, -1) == labels_B).astype(jnp.float32).mean()
    return loss, {"loss": loss, "accuracy": accuracy}


def token_classification_objective(model, params, batch, rng=None, deterministic=True):
    """Per-token cross-entropy of ``[B, T, L]`` logits against ``targets``, ``weights``."""
    logits = apply_model(model, params, batch, BERT_INPUTS, rng, deterministic)
    return _token_metrics(logits, batch["targets"], batch.get("weights"))


@dataclass(frozen=True)
class Objective:
    """A loss function and the model inputs it reads from a batch."""

    name: str
    loss: LossFn
    input_keys: tuple[str, ...]

    def inputs(self, batch: dict) -> dict:
        return model_inputs(batch, self.input_keys)

    def init_params(self, model: nn.Module, rng: jax.Array, batch: dict) -> Any:
        """Fresh (unboxed) parameters for ``model``, shaped by an example batch."""
        variables = model.init(rng, batch["inputs"], **self.inputs(batch))
        return nn.meta.unbox(variables["params"])


OBJECTIVES: Registry[Objective] = Registry("objective")
for _objective in (
    Objective("lm", lm_objective, GPT_INPUTS),
    Objective("mlm", mlm_objective, BERT_INPUTS),
    Objective("seq2seq", seq2seq_objective, ENCDEC_INPUTS),
    Objective("sequence_classification", sequence_classification_objective, BERT_INPUTS),
    Objective("token_classification", token_classification_objective, BERT_INPUTS),
):
    OBJECTIVES.add(_objective.name, _objective)
FAMILY_OBJECTIVES = {"gpt": "lm", "bert": "mlm", "encdec": "seq2seq", "lstm": "lm"}


def objective_for(family: str) -> Objective:
    """The default objective of a model family."""
    if family not in FAMILY_OBJECTIVES:
        raise ValueError(f"family {family!r} has no default objective; known: "
                         f"{', '.join(sorted(FAMILY_OBJECTIVES))}")
    return OBJECTIVES.get(FAMILY_OBJECTIVES[family])


def mlm_batch(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    seed: int,
    index: int,
    *,
    tokenizer=None,
    masking: MaskingConfig = BERT_MASKING,
    vocab_size: int | None = None,
) -> dict:
    """Random corpus windows as ``[CLS] w_1 .. w_{T-2} [SEP]``, masked for the MLM loss.

    Returns numpy ``inputs`` (corrupted), ``targets``, ``weights`` (1 on chosen positions) and
    ``token_types`` (zeros: one segment), all ``[B, T]``. A pure function of (seed, index): the
    windows come from numpy's generator seeded with both, the corruption from a JAX key folded
    from both.
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    if seq_len < 3:
        raise ValueError(f"seq_len={seq_len}: an MLM row needs [CLS], a token and [SEP]")
    body = seq_len - 2
    rng = np.random.default_rng([seed & 0xFFFFFFFF, index])
    starts = rng.integers(0, len(tokens) - body + 1, size=batch_size)
    rows = np.empty((batch_size, seq_len), np.int32)
    rows[:, 0] = tokenizer.special["cls"]
    rows[:, -1] = tokenizer.special["sep"]
    rows[:, 1:-1] = np.stack([tokens[s : s + body] for s in starts])
    key = jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), index)
    out = mask_tokens(
        key,
        rows,
        mask_id=int(tokenizer.special["mask"]),
        special_ids=special_ids_of(tokenizer),
        vocab_size=tokenizer.vocab_size if vocab_size is None else vocab_size,
        config=masking,
    )
    batch = {k: np.asarray(v) for k, v in out.items()}
    batch["token_types"] = np.zeros((batch_size, seq_len), np.int32)
    return batch


# Synthetic sequence-to-sequence tasks (the tasks of data/synthetic.py) --------------------------


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


def prefix_lm_batch(pairs: Sequence[tuple], seq_len: int, tokenizer=None) -> dict:
    """Decoder-only conditional rows ``[bos] src [sep] tgt [eos] pad..`` for ``mask=prefix``.

    ``inputs`` is the row without its last token, ``targets`` the row shifted left; the prefix
    ``[bos] src [sep]`` (``prefix_len``) is seen bidirectionally and carries no loss: ``weights``
    is 1 exactly on the targets ``tgt eos``. ``segment_ids`` is 0 on padding.
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    sp = tokenizer.special
    B = len(pairs)
    rows = np.full((B, seq_len + 1), sp["pad"], np.int32)
    prefix_len = np.zeros(B, np.int32)
    ends = np.zeros(B, np.int32)
    for i, (src, tgt) in enumerate(pairs):
        row = [sp["bos"], *src, sp["sep"], *tgt, sp["eos"]]
        if len(row) > seq_len + 1:
            raise ValueError(f"example {i} needs {len(row) - 1} positions; seq_len={seq_len}")
        rows[i, : len(row)] = row
        prefix_len[i] = len(src) + 2
        ends[i] = len(row) - 1  # inputs t < ends are real
    t = np.arange(seq_len)[None]
    return {
        "inputs": rows[:, :-1],
        "targets": rows[:, 1:],
        # target t is row[t + 1]: in the answer when t + 1 >= prefix_len, real when t < ends
        "weights": ((t + 1 >= prefix_len[:, None]) & (t < ends[:, None])).astype(np.float32),
        "segment_ids": (t < ends[:, None]).astype(np.int32),
        "prefix_len": prefix_len,
    }


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


# tfds classification ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassificationSource:
    """A random-access tfds split with the features to read: text (one or a pair) and label."""

    source: Any  # tfds data source: len(), source[i] -> dict of features
    text_keys: tuple[str, ...]
    label_key: str
    num_labels: int

    def __len__(self) -> int:
        return len(self.source)


def load_classification(
    name: str = "imdb_reviews",
    split: str = "train",
    *,
    text_key: str | tuple[str, str] | None = None,
    label_key: str = "label",
    data_dir: str | None = None,
) -> ClassificationSource:
    """A tfds classification split read through ``tfds.data_source`` (no TensorFlow).

    ``text_key`` defaults to the dataset's only ``Text`` feature (``text`` for imdb_reviews,
    ``sentence`` for glue/sst2); give a pair, e.g. ``("premise", "hypothesis")``, for sentence
    pairs (then token types 0 and 1). The label must be a ``ClassLabel``. The dataset must be
    prepared in ``data_dir`` (or downloadable); builders that need TensorFlow to prepare
    (glue) must have been prepared elsewhere.
    """
    import tensorflow_datasets as tfds

    source = tfds.data_source(name, split=split, data_dir=data_dir)
    features = source.dataset_info.features
    if text_key is None:
        texts = [k for k, f in features.items() if type(f).__name__ == "Text"]
        if len(texts) != 1:
            raise ValueError(f"{name}: text features {texts}; pass text_key= (one name or a "
                             "pair for sentence-pair tasks)")
        text_key = texts[0]
    text_keys = (text_key,) if isinstance(text_key, str) else tuple(text_key)
    for key in (*text_keys, label_key):
        if key not in features:
            raise ValueError(f"{name} has no feature {key!r}; features: {list(features)}")
    num_labels = getattr(features[label_key], "num_classes", None)
    if not num_labels:
        raise ValueError(f"{name}: feature {label_key!r} is not a ClassLabel")
    return ClassificationSource(source, text_keys, label_key, int(num_labels))


def encode_classification_example(texts: Sequence[str | bytes], seq_len: int,
                                  tokenizer=None) -> tuple[np.ndarray, np.ndarray]:
    """``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]`` truncated to seq_len (the longer text
    loses tokens first) and padded; returns (ids, token types), both ``[seq_len]``."""
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    sp = tokenizer.special
    parts = [list(tokenizer.encode(t)) for t in texts]
    budget = seq_len - 1 - len(parts)
    if budget < 0:
        raise ValueError(f"seq_len={seq_len} cannot hold [CLS] and {len(parts)} [SEP]")
    while sum(len(p) for p in parts) > budget:
        max(parts, key=len).pop()
    ids, types = [sp["cls"]], [0]
    for j, part in enumerate(parts):
        ids += [*part, sp["sep"]]
        types += [j] * (len(part) + 1)
    out_ids = np.full(seq_len, sp["pad"], np.int32)
    out_types = np.zeros(seq_len, np.int32)
    out_ids[: len(ids)], out_types[: len(types)] = ids, types
    return out_ids, out_types


def classification_batch(data: ClassificationSource, indices: Sequence[int], seq_len: int,
                         tokenizer=None) -> dict:
    """Rows ``indices`` of ``data`` as a classifier batch: ``inputs``, ``token_types``,
    ``segment_ids`` (1 real, 0 padding) ``[B, T]`` and ``labels`` ``[B]``."""
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    ids, types, labels = [], [], []
    for i in indices:
        example = data.source[int(i)]
        row, row_types = encode_classification_example(
            [example[k] for k in data.text_keys], seq_len, tokenizer
        )
        ids.append(row)
        types.append(row_types)
        labels.append(int(example[data.label_key]))
    inputs = np.stack(ids)
    return {
        "inputs": inputs,
        "token_types": np.stack(types),
        "segment_ids": (inputs != tokenizer.pad_id).astype(np.int32),
        "labels": np.asarray(labels, np.int32),
    }


def classification_batch_at(data: ClassificationSource, batch_size: int, seq_len: int, seed: int,
                            index: int, tokenizer=None) -> dict:
    """Batch ``index`` of random rows (with replacement), a pure function of (seed, index)."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, index])
    return classification_batch(data, rng.integers(0, len(data), size=batch_size), seq_len,
                                tokenizer)


# Masked-LM on the training loop's text pipeline -----------------------------------------------


def mlm_key(seed: int, index: int, stream: int = 0) -> jax.Array:
    """The corruption key of batch ``index``: a pure function of (seed, stream, index)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), stream),
                              index)


class MaskedBatches:
    """Wraps a batch iterator of the text pipeline (``inputs``, ``segment_ids``, ...) into
    masked-LM batches: ``inputs`` becomes the corrupted tokens, ``targets`` the original ones,
    ``weights`` 1 on the chosen positions (never padding: ``segment_ids == 0``, never a special
    id). The pipeline's next-token ``targets`` and ``weights`` are replaced; positions and
    segment ids pass through, so packed documents stay apart.

    The key of batch i is ``mlm_key(seed, i)``; the state to resume is the inner iterator's
    plus the batch count (``get_state``/``set_state``, like the pipeline's iterators).
    """

    def __init__(self, inner, seed: int, tokenizer, masking: MaskingConfig = BERT_MASKING,
                 vocab_size: int | None = None):
        self.inner, self.seed, self.count = inner, seed, 0
        self.tokenizer, self.masking, self.vocab_size = tokenizer, masking, vocab_size

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.inner)
        key = mlm_key(self.seed, self.count)
        self.count += 1
        return mask_for_mlm(key, batch, self.tokenizer, self.masking, self.vocab_size)

    def get_state(self) -> dict:
        return {"inner": self.inner.get_state(), "count": self.count}

    def set_state(self, state: dict) -> None:
        self.inner.set_state(state["inner"])
        self.count = state["count"]


def mask_for_mlm(key: jax.Array, batch: dict, tokenizer, masking: MaskingConfig = BERT_MASKING,
                 vocab_size: int | None = None) -> dict:
    """One text-pipeline batch as a masked-LM batch (numpy arrays, like the pipeline's)."""
    batch = {k: v for k, v in batch.items() if k != "prefix_len"}
    out = mask_batch(key, batch, tokenizer, masking, vocab_size)
    return {k: np.asarray(v) for k, v in out.items()}


def mask_eval_batches(batches: Sequence[dict], seed: int, tokenizer,
                      masking: MaskingConfig = BERT_MASKING,
                      vocab_size: int | None = None) -> list[dict]:
    """Fixed held-out masked-LM batches (their own key stream), the same at every evaluation."""
    return [mask_for_mlm(mlm_key(seed, i, stream=1), b, tokenizer, masking, vocab_size)
            for i, b in enumerate(batches)]
