"""Synthetic algorithmic tasks that need no data: copy, reverse, sort, addition, parity,
associative recall and passkey retrieval.

Each task turns ``(rng, length)`` into a ``(prompt, answer)`` pair of ASCII strings, so every
tokenizer can encode it (the byte and char tokenizers give one token per character; SentencePiece
gives at most one). ``length`` is the size of the variable part:

| task | length is | prompt -> answer |
|---|---|---|
| copy | string length | ``"qkxa"`` -> ``"qkxa"`` |
| reverse | string length | ``"qkxa"`` -> ``"axkq"`` |
| sort | string length | ``"qkxa"`` -> ``"akqx"`` |
| addition | digits per operand | ``"482+751"`` -> ``"1233"`` |
| addition_reversed | digits per operand | ``"284+157"`` -> ``"3321"`` (least significant first) |
| parity | number of bits | ``"10110"`` -> ``"1"`` (odd number of ones) |
| associative_recall | key-value pairs | ``"ab3cd7ef1|cd"`` -> ``"7"`` |
| passkey | filler words | ``"sky sun key=48213 tree ... |key"`` -> ``"48213"`` |

``TaskSource(name, split, lengths=..., num_examples=..., seed=...)`` is a random-access source
(``len`` and ``[i]``, what Grain's ``MapDataset.source`` reads): example ``i`` is a pure function of
``(seed, split, i)``, and its length is uniform over the split's inclusive range, so accuracy can
be read per length. ``task_source(name, split, train_lengths=(1, 20), test_lengths=(21, 80))``
picks the range by split: train short, test long, for length generalisation.

Formats (``decoder_example``, ``encdec_example``; the pipeline pads, packs and batches them):
decoder-only ``[bos] prompt [sep] answer [eos]`` with loss weights only on the answer and eos
(and ``prefix_len`` = the length of ``[bos] prompt [sep]`` for prefix-LM); encoder-decoder with
encoder ``prompt [eos]`` and decoder ``[bos] answer`` -> ``answer [eos]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from transformers_jax.registry import Registry

LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"
_FILLER = ("sky", "sun", "tree", "blue", "grass", "green", "river", "stone", "cloud", "field")
PASSKEY_DIGITS = 5
SPLITS = ("train", "test")


def _symbols(rng: np.random.Generator, n: int) -> str:
    return "".join(LETTERS[i] for i in rng.integers(0, len(LETTERS), n))


def _copy(rng, n):
    s = _symbols(rng, n)
    return s, s


def _reverse(rng, n):
    s = _symbols(rng, n)
    return s, s[::-1]


def _sort(rng, n):
    s = _symbols(rng, n)
    return s, "".join(sorted(s))


def _operand(rng: np.random.Generator, n: int) -> int:
    """A uniform ``n``-digit number (no leading zero unless ``n == 1``); any size."""
    first = int(rng.integers(0 if n == 1 else 1, 10))
    rest = rng.integers(0, 10, n - 1)
    return int(DIGITS[first] + "".join(DIGITS[d] for d in rest))


def _addition(rng, n):
    a, b = _operand(rng, n), _operand(rng, n)
    return f"{a}+{b}", str(a + b)


def _addition_reversed(rng, n):
    """Addition with every number written least-significant digit first."""
    a, b = _operand(rng, n), _operand(rng, n)
    return f"{str(a)[::-1]}+{str(b)[::-1]}", str(a + b)[::-1]


def _parity(rng, n):
    bits = rng.integers(0, 2, n)
    return "".join(DIGITS[b] for b in bits), str(int(bits.sum() % 2))


_KEYS = [a + b for a in LETTERS for b in LETTERS]  # 676 distinct two-letter keys


def _associative_recall(rng, n):
    if n > len(_KEYS):
        raise ValueError(f"associative_recall: at most {len(_KEYS)} pairs (got length {n})")
    keys = [_KEYS[i] for i in rng.choice(len(_KEYS), n, replace=False)]
    values = [DIGITS[v] for v in rng.integers(0, 10, n)]
    q = int(rng.integers(0, n))
    context = "".join(k + v for k, v in zip(keys, values, strict=True))
    return f"{context}|{keys[q]}", values[q]


def _passkey(rng, n):
    key = "".join(DIGITS[d] for d in rng.integers(0, 10, PASSKEY_DIGITS))
    words = [_FILLER[i] for i in rng.integers(0, len(_FILLER), n)]
    words.insert(int(rng.integers(0, n + 1)), f"key={key}")
    return " ".join(words) + "|key", key


@dataclasses.dataclass(frozen=True)
class TaskDef:
    make: Callable[[np.random.Generator, int], tuple[str, str]]
    max_chars: Callable[[int], tuple[int, int]]  # length -> (prompt chars, answer chars) bound
    max_length: int | None = None


TASKS: Registry[TaskDef] = Registry("synthetic task")
TASKS.add("copy", TaskDef(_copy, lambda n: (n, n)))
TASKS.add("reverse", TaskDef(_reverse, lambda n: (n, n)))
TASKS.add("sort", TaskDef(_sort, lambda n: (n, n)))
TASKS.add("addition", TaskDef(_addition, lambda n: (2 * n + 1, n + 1)))
TASKS.add("addition_reversed", TaskDef(_addition_reversed, lambda n: (2 * n + 1, n + 1)))
TASKS.add("parity", TaskDef(_parity, lambda n: (n, 1)))
TASKS.add(
    "associative_recall",
    TaskDef(_associative_recall, lambda n: (3 * n + 3, 1), max_length=len(_KEYS)),
)
TASKS.add(
    "passkey",
    TaskDef(
        _passkey,
        lambda n: (n * (max(map(len, _FILLER)) + 1) + PASSKEY_DIGITS + 4 + 4, PASSKEY_DIGITS),
    ),
)


def get_task(name: str) -> TaskDef:
    """The task's definition; an unknown name raises ``UnknownNameError`` listing valid ones."""
    return TASKS.get(name)


def longest_fitting_length(name: str, fmt: str, lengths: tuple[int, int], seq_len: int,
                           encoder_len: int | None = None) -> int | None:
    """The longest task length in ``lengths`` whose padded rows fit ``seq_len`` tokens (and
    ``encoder_len`` for an encoder), or None if not even the shortest fits."""
    task, layout = get_task(name), FORMATS[fmt]
    have = {"inputs": seq_len, "encoder_inputs": encoder_len or seq_len}
    for n in range(int(lengths[1]), int(lengths[0]) - 1, -1):
        need = layout.row_lengths(*task.max_chars(n))
        if all(need[key] <= have[key] for key in need):
            return n
    return None


def _check_lengths(name: str, lengths: tuple[int, int], what: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in lengths)
    if lo < 1 or hi < lo:
        raise ValueError(f"{what}={tuple(lengths)}: need 1 <= low <= high (inclusive range)")
    cap = get_task(name).max_length
    if cap is not None and hi > cap:
        raise ValueError(f"{what}={tuple(lengths)}: task {name!r} allows lengths up to {cap}")
    return lo, hi


class TaskSource:
    """Deterministic random-access examples of one task and split.

    ``[i] -> {"prompt": str, "answer": str, "length": int}``; ``len`` is ``num_examples``.
    """

    def __init__(
        self,
        name: str,
        split: str = "train",
        *,
        lengths: tuple[int, int] = (1, 20),
        num_examples: int = 1_000_000,
        seed: int = 0,
    ):
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: valid choices: {', '.join(SPLITS)}")
        self.name = name
        self.task = get_task(name)
        self.split = split
        self.lengths = _check_lengths(name, lengths, "lengths")
        if num_examples <= 0:
            raise ValueError(f"num_examples={num_examples}: must be positive")
        self.num_examples = int(num_examples)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for {self.num_examples} examples")
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, SPLITS.index(self.split), index])
        n = int(rng.integers(self.lengths[0], self.lengths[1] + 1))
        prompt, answer = self.task.make(rng, n)
        return {"prompt": prompt, "answer": answer, "length": n}

    def max_chars(self) -> tuple[int, int]:
        """Upper bounds on prompt and answer characters over this split's lengths."""
        return self.task.max_chars(self.lengths[1])

    def __repr__(self) -> str:
        return (
            f"TaskSource({self.name!r}, split={self.split!r}, lengths={self.lengths}, "
            f"{self.num_examples} examples, seed={self.seed})"
        )


def task_source(
    name: str,
    split: str = "train",
    *,
    train_lengths: tuple[int, int] = (1, 20),
    test_lengths: tuple[int, int] = (21, 80),
    num_examples: int | None = None,
    seed: int = 0,
) -> TaskSource:
    """The train or test source of a task; ``num_examples`` defaults to 1,000,000 for train
    and 1,000 for test."""
    lengths = train_lengths if split == "train" else test_lengths
    _check_lengths(name, train_lengths, "train_lengths")
    _check_lengths(name, test_lengths, "test_lengths")
    if num_examples is None:
        num_examples = 1_000_000 if split == "train" else 1_000
    return TaskSource(name, split, lengths=lengths, num_examples=num_examples, seed=seed)


# ----------------------------------------------------------------------------- formats


def decoder_example(example: dict, tokenizer) -> dict:
    """``[bos] prompt [sep] answer [eos]`` as next-token ``inputs``/``targets`` (unpadded).

    ``weights`` are 1 exactly on the targets that are answer tokens or the final eos;
    ``prefix_len`` is the length of ``[bos] prompt [sep]`` (target ``t`` is after the prefix when
    ``t + 1 >= prefix_len``, the convention of ``batches.lm_batch``).
    """
    prompt = tokenizer.encode(example["prompt"])
    answer = tokenizer.encode(example["answer"])
    seq = np.concatenate(
        [[tokenizer.bos_id], prompt, [tokenizer.sep_id], answer, [tokenizer.eos_id]]
    ).astype(np.int32)
    prefix_len = len(prompt) + 2
    weights = (np.arange(len(seq) - 1) + 1 >= prefix_len).astype(np.float32)
    return {
        "inputs": seq[:-1],
        "targets": seq[1:],
        "weights": weights,
        "prefix_len": np.int32(prefix_len),
        "lengths": np.int32(example["length"]),
    }


def encdec_example(example: dict, tokenizer) -> dict:
    """Encoder ``prompt [eos]``; decoder ``[bos] answer`` predicting ``answer [eos]``."""
    prompt = tokenizer.encode(example["prompt"])
    answer = tokenizer.encode(example["answer"])
    enc = np.concatenate([prompt, [tokenizer.eos_id]]).astype(np.int32)
    dec = np.concatenate([[tokenizer.bos_id], answer, [tokenizer.eos_id]]).astype(np.int32)
    return {
        "encoder_inputs": enc,
        "inputs": dec[:-1],
        "targets": dec[1:],
        "weights": np.ones(len(dec) - 1, np.float32),
        "lengths": np.int32(example["length"]),
    }


@dataclasses.dataclass(frozen=True)
class TaskFormat:
    """How a task example becomes a row: ``example(example, tokenizer)`` the unpadded arrays;
    ``row_lengths(prompt_chars, answer_chars)`` the tokens each padded input needs (byte
    tokens: one per character); ``encoder``: rows carry ``encoder_inputs`` (padded to the
    encoder length); ``takes_prefix``: rows can carry ``prefix_len`` for a prefix-LM mask."""

    example: Callable[[dict, object], dict]
    row_lengths: Callable[[int, int], dict[str, int]]
    encoder: bool = False
    takes_prefix: bool = False


FORMATS = {
    # [bos] prompt [sep] answer, predicting one on (the eos is only a target)
    "decoder": TaskFormat(decoder_example, lambda p, a: {"inputs": p + a + 2},
                          takes_prefix=True),
    # encoder prompt [eos]; decoder [bos] answer
    "encdec": TaskFormat(encdec_example,
                         lambda p, a: {"encoder_inputs": p + 1, "inputs": a + 1},
                         encoder=True),
}


# ----------------------------------------------------------------------------- evaluation


def exact_match(predictions: np.ndarray, targets: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """bool ``[B]``: every weighted target of the row is predicted exactly.

    ``predictions`` are ids aligned with ``targets`` (``argmax`` of the logits under teacher
    forcing, or generated ids placed at the answer positions). Rows with no weighted target are
    False. For packed rows use ``exact_match_segments``.
    """
    predictions, targets = np.asarray(predictions), np.asarray(targets)
    weights = np.asarray(weights) > 0
    ok = (predictions == targets) | ~weights
    return ok.all(axis=-1) & weights.any(axis=-1)


def exact_match_segments(
    predictions: np.ndarray, targets: np.ndarray, weights: np.ndarray, segment_ids: np.ndarray
) -> list[bool]:
    """Exact match per packed example (segment), in row-major order of the segments."""
    out = []
    for p, t, w, s in zip(
        np.asarray(predictions),
        np.asarray(targets),
        np.asarray(weights),
        np.asarray(segment_ids),
        strict=True,
    ):
        for seg in np.unique(s[s > 0]):
            m = (s == seg) & (w > 0)
            out.append(bool(m.any() and (p[m] == t[m]).all()))
    return out


def accuracy_by_length(correct: Sequence[bool], lengths: Sequence[int]) -> dict[int, float]:
    """Mean exact-match accuracy for each task length, sorted by length."""
    correct, lengths = np.asarray(correct, bool), np.asarray(lengths)
    return {int(n): float(correct[lengths == n].mean()) for n in np.unique(lengths)}


def answer_exact_match(generated: Sequence[str], answers: Sequence[str]) -> np.ndarray:
    """bool ``[N]``: each generated answer text (cut at the first eos by the sampler) equals the
    reference answer (surrounding whitespace ignored)."""
    return np.array([g.strip() == a.strip() for g, a in zip(generated, answers, strict=True)])
