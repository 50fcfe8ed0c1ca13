"""Token-level work behind the lm-eval adapter, without lm-eval: score continuations and
generate greedily, in fixed batches and bucketed lengths so that a task of any size compiles a
handful of programs, not one per request.

``TokenScorer.score(rows)``: each row is ``(tokens, n)``, the log-probability of its last ``n``
tokens given those before them, and whether greedy decoding would have produced them.
``TokenScorer.generate(prompts, max_new, stops)``: greedy (or sampled) continuations through
the KV cache (``sample.generate_tokens``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax.learning.objectives import apply_model
from transformers_jax.models import family_of
from transformers_jax.sample import SamplingConfig, generate_tokens

MIN_BUCKET = 16


def bucket(length: int, cap: int) -> int:
    """The padded length for ``length`` tokens: the next power of two (at least 16), never past
    ``cap`` (a learned position table has no rows beyond it)."""
    size = MIN_BUCKET
    while size < length:
        size *= 2
    return max(min(size, cap), length)


def _by_length(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Row indices grouped into batches, longest first (a batch pads to its first row, and
    neighbours in length share a bucket)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


@dataclasses.dataclass
class TokenScorer:
    """Scores and generates for a next-token model (``model``, ``params``); ``max_length``:
    the most tokens one forward pass reads; ``batch_size``: rows per compiled call."""

    model: Any
    params: Any
    max_length: int
    batch_size: int
    pad_id: int

    def __post_init__(self) -> None:
        config = self.model.config
        family = family_of(config)

        def score(params, inputs_BT, targets_BT, weights_BT):
            batch = {"inputs": inputs_BT, **family.inputs_for(config, inputs_BT)}
            logits_BTV = apply_model(self.model, params, batch).astype(jnp.float32)
            logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
            target_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
            greedy_BT = jnp.argmax(logits_BTV, axis=-1) == targets_BT
            logp_B = (target_BT * weights_BT).sum(-1)
            all_greedy_B = jnp.all(greedy_BT | (weights_BT == 0), axis=-1)
            return logp_B, all_greedy_B

        self._score = jax.jit(score)

    def score(self, rows: Sequence[tuple[Sequence[int], int]]) -> list[tuple[float, bool]]:
        """For each ``(tokens, n)``: ``(sum of log p of the last n tokens, all of them greedy)``.
        ``tokens`` holds at most ``max_length + 1`` ids (the first is never scored)."""
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for chunk in _by_length([len(t) for t, _ in rows], self.batch_size):
            width = bucket(len(rows[chunk[0]][0]) - 1, self.max_length)
            inputs = np.full((self.batch_size, width), self.pad_id, np.int32)
            targets = np.zeros((self.batch_size, width), np.int32)
            weights = np.zeros((self.batch_size, width), np.float32)
            for r, i in enumerate(chunk):
                tokens, n = rows[i]
                if not 0 < n < len(tokens) or len(tokens) > self.max_length + 1:
                    raise ValueError(f"a row of {len(tokens)} tokens cannot score its last {n} "
                                     f"with at most {self.max_length} tokens of input")
                inputs[r, : len(tokens) - 1] = tokens[:-1]
                targets[r, : len(tokens) - 1] = tokens[1:]
                weights[r, len(tokens) - 1 - n : len(tokens) - 1] = 1.0
            logp_B, greedy_B = jax.device_get(self._score(self.params, inputs, targets, weights))
            for r, i in enumerate(chunk):
                out[i] = (float(logp_B[r]), bool(greedy_B[r]))
        return out

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                 seed: int = 0) -> list[list[int]]:
        """New tokens for each prompt (``sampling.max_new_tokens`` each, ``sampling.pad_id``
        after a row's first stop token). Prompts hold at most ``max_length -
        sampling.max_new_tokens`` tokens; rows are batched by length and padded to
        ``batch_size`` rows and a bucketed width."""
        room = self.max_length - sampling.max_new_tokens
        out: list[list[int]] = [[] for _ in prompts]
        for chunk in _by_length([len(p) for p in prompts], self.batch_size):
            width = bucket(len(prompts[chunk[0]]), room)
            tokens = np.full((self.batch_size, width), self.pad_id, np.int32)
            lengths = np.ones((self.batch_size,), np.int32)  # spare rows: one pad token
            for r, i in enumerate(chunk):
                tokens[r, : len(prompts[i])] = prompts[i]
                lengths[r] = len(prompts[i])
            new_BN = np.asarray(generate_tokens(
                self.model, self.params, jnp.asarray(tokens), jnp.asarray(lengths),
                jax.random.key(seed), cfg=sampling))
            for r, i in enumerate(chunk):
                out[i] = new_BN[r].tolist()
        return out
