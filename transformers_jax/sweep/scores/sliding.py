"""``sliding@L``: the loss in windows of L tokens that slide by ``[eval] stride``, each token
scored once with the longest context the window gives it (``[eval] sliding``)."""

from __future__ import annotations

from transformers_jax.sweep.scores.base import Job, ScoreKind, chunk_summary, scored_length
from transformers_jax.sweep.terms import SpecError


class Sliding(ScoreKind):
    term_help = "sliding@L (sliding windows)"

    def check_term(self, kind, length, spec, where, text) -> None:
        if not spec.sliding:
            raise SpecError(f"{where}: {text!r} needs sliding windows; set [eval] sliding = "
                            "true")
        table = "[eval] lengths" if spec.slid is None else "[eval] sliding"
        scored_length(length, spec.sliding_lengths, table, text, where)

    def notes(self, spec) -> list[str]:
        if not spec.sliding:
            return []
        return [f"sliding@L: windows of L sliding by {spec.stride.text} of seq_len, each token "
                "scored with that much context or more"]

    def scored(self, spec):
        return [(self.name, x) for x in spec.sliding_lengths]

    def score(self, job: Job) -> dict:
        spec, planned = job.plan.spec, job.planned
        slid = {x.text for x in spec.sliding_lengths}
        out = {}
        for length_spec, length in zip(spec.lengths, planned.lengths(spec), strict=True):
            if length_spec.text not in slid:
                continue
            stride = min(spec.stride.resolve(planned.reference_len), length)
            losses_N = job.stream_losses(length, stride)
            out[length_spec.text] = {**chunk_summary(losses_N, length, spec.chunk_tokens),
                                     "stride": stride}
        return {self.name: out}
