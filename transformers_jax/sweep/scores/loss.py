"""``loss@L``: the mean next-token loss over the held-out stream in non-overlapping windows of
L tokens (``[eval] lengths``), by chunk of the stream, and the loss by position in the window
(``[eval] by_position``)."""

from __future__ import annotations

from transformers_jax.sweep.scores.base import Job, ScoreKind, chunk_summary, scored_length
from transformers_jax.sweep.terms import SpecError


class Loss(ScoreKind):
    term_help = ("loss@L (non-overlapping windows of L), L tokens or a multiple of seq_len "
                 "such as 2x")

    def in_scores(self, spec) -> bool:
        return not spec.task_sweep

    def check_term(self, kind, length, spec, where, text) -> None:
        scored_length(length, spec.lengths, "[eval] lengths", text, where)

    def scored(self, spec):
        return [(self.name, x) for x in spec.lengths]

    def score(self, job: Job) -> dict:
        import numpy as np

        from transformers_jax.evaluation import stream_losses

        spec, planned = job.plan.spec, job.planned
        loss, by_position = {}, {}
        for length_spec, length in zip(spec.lengths, planned.lengths(spec), strict=True):
            try:
                losses_N = stream_losses(job.model, job.params, job.plan.heldout_N, length, None,
                                         spec.eval_batch_size)
            except (ValueError, KeyError, TypeError) as err:
                if not planned.zero_shot:
                    raise
                raise SpecError(
                    f"cell {planned.cell.name}: its model cannot run on the parameters of "
                    f"{job.run_dir} ({type(err).__name__}: {str(err)[:300]}); a zero-shot cell "
                    "may change how the parameters are used (position scaling, attention), "
                    "not their shapes") from None
            loss[length_spec.text] = chunk_summary(losses_N, length, spec.chunk_tokens)
            if spec.by_position:
                scored = np.flatnonzero(~np.isnan(losses_N))
                within = (scored - 1) % length
                total = np.bincount(within, losses_N[scored], minlength=length)
                count = np.bincount(within, minlength=length)
                by_position[length_spec.text] = (total / np.maximum(count, 1)).tolist()
        return {self.name: loss, "by_position": by_position}
