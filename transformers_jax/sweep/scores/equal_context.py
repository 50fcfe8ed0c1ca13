"""``loss_k@L``: the held-out loss in windows of L tokens over the positions with at least k
tokens of context in their window (``[eval] equal_context``; k defaults to the largest n-gram
order less one), so that the model and the n-gram baselines, which always see k tokens, are
scored on the same positions with as much context. ``loss@L`` scores every position, the
first of a window with one token of context."""

from __future__ import annotations

from typing import Any

from transformers_jax.sweep.scores.base import Job, ScoreKind, chunk_summary, scored_length
from transformers_jax.sweep.terms import SpecError


def with_context(losses_N, length: int, k: int):
    """``losses_N`` (a stream scored in windows of ``length`` from its start) with NaN where
    a position has fewer than ``k`` tokens of context in its window."""
    import numpy as np

    context_N = (np.arange(len(losses_N)) - 1) % length + 1  # position i of a window: i
    return np.where(context_N >= k, losses_N, np.nan)


class EqualContext(ScoreKind):
    term_help = "loss_k@L (the loss of the positions with k tokens of context or more)"
    table = "equal_context"  # [eval] equal_context = true, or k

    def parse_table(self, value: Any, default_lengths: list) -> dict:
        if value is True:
            return {"k": None}
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f"[eval] equal_context = {value!r}: true (k = the largest n-gram "
                            "order less one) or k, the fewest tokens of context a scored "
                            "position has (1 or more)")
        return {"k": value}

    def finish(self, settings: dict, spec) -> dict:
        if settings["k"] is not None:
            return settings
        if not spec.ngram_orders:
            raise SpecError("[eval] equal_context = true takes k from the n-gram baselines, "
                            "and [baselines] ngram is empty; give k (equal_context = 4)")
        return {"k": max(max(spec.ngram_orders) - 1, 1)}

    def record(self, settings: dict) -> dict:
        return dict(settings)

    def in_scores(self, spec) -> bool:
        return not spec.task_sweep and self.table in spec.tables

    def check_term(self, kind, length, spec, where, text) -> None:
        if self.table not in spec.tables:
            raise SpecError(f"{where}: {text!r} needs [eval] equal_context = true (or k)")
        scored_length(length, spec.lengths, "[eval] lengths", text, where)

    def notes(self, spec) -> list[str]:
        k = spec.tables[self.table]["k"]
        return [f"loss_k@L: the loss of the positions with at least {k} tokens of context in "
                "their window (the n-grams' context, for comparing with them)"]

    def scored(self, spec):
        return [(self.name, x) for x in spec.lengths] if self.table in spec.tables else []

    def score(self, job: Job) -> dict:
        spec, planned = job.plan.spec, job.planned
        k = spec.tables[self.table]["k"]
        out = {}
        for length_spec, length in zip(spec.lengths, planned.lengths(spec), strict=True):
            losses_N = with_context(job.stream_losses(length), length, k)
            out[length_spec.text] = {**chunk_summary(losses_N, length, spec.chunk_tokens),
                                     "k": k}
        return {self.name: out}
