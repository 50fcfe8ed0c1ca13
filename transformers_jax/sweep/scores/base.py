"""What a kind of score is to a sweep: how a metric names it, how a spec asks for it, how a
seed's run is scored, and how a metric reads its units back. Each kind is one entry of
``SCORE_KINDS`` (``sweep/scores/__init__.py``) in a file of its own; the spec, the runner and
the report ask the entries and never test a kind's name.

A metric term is ``KIND@LENGTH`` (``loss@4x``, ``passkey@256``, ``exact@1-20``) or, for a kind
with variants, ``KIND:VARIANT@LENGTH`` (``context:shuffle@50``). A seed's scores are one JSON
object (``sweep_scores.json``) with a table per kind under its name; a term's table maps a
length to ``{"mean": ..., "chunks": [...]}``, the units the paired statistics pair.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from transformers_jax.sweep.terms import Length, SpecError, length_value, parse_length

# The spec and the plan import the registry, so the entries name them in words only: ``spec``
# is a ``sweep.spec.Spec``, ``plan`` a ``sweep.plan.SweepPlan``, ``planned`` its PlannedCell.

TERM = re.compile(r"^([a-z_][a-z0-9_]*)(?::([a-z_][a-z0-9_]*))?@(.+)$")


@dataclasses.dataclass(frozen=True)
class Job:
    """One seed's run to score: the model on its parameters, and what asks for the scores."""

    plan: Any  # sweep.plan.SweepPlan
    planned: Any  # its PlannedCell
    model: Any
    params: Any
    tokenizer: Any
    run_dir: str
    # what one kind computed that another reads (the held-out stream's losses by length)
    memo: dict = dataclasses.field(default_factory=dict)

    def stream_losses(self, length: int, stride: int | None = None):
        """The held-out stream's next-token losses in windows of ``length``
        (``evaluation.stream_losses``), computed once for every kind that reads them."""
        key = ("stream", length, stride)
        if key not in self.memo:
            from transformers_jax.evaluation import stream_losses

            self.memo[key] = stream_losses(self.model, self.params, self.plan.heldout_N, length,
                                           stride, self.plan.spec.eval_batch_size)
        return self.memo[key]


class ScoreKind:
    """A kind of score. ``name`` is set when the entry is registered: the key of its table in
    a seed's scores and the first word of its metric terms."""

    name = ""
    table: str | None = None  # the [eval] key of its settings (``parse_table``), if any
    # the settings' place in a score's key when the spec has none (None), for the kinds that
    # keys written before this registry held that way; else absent
    keyed_when_absent = False
    higher_is_better = False  # an accuracy (a loss: lower)
    # its units are context windows, each value a loss added by a perturbation (higher: more
    # context used); else chunks of the held-out stream, or a task's examples
    per_window = False
    task = False  # scored on a task's examples (a task sweep scores nothing else)
    term_help = ""  # how its terms are written, for the error naming every kind

    def parse_term(self, variant: str | None, length: str, where: str) -> Length:
        """The length of a term ``NAME[:VARIANT]@LENGTH`` (tokens or a multiple of seq_len)."""
        if variant is not None:
            raise SpecError(f"{where}: {self.name} has no variants ({self.name}:{variant})")
        if not re.fullmatch(r"\d+(\.\d+)?x|\d+", length):
            raise SpecError(f"{where}: {self.name}@{length}: the length is tokens (256) or a "
                            "multiple of seq_len (2x)")
        return parse_length(length_value(length), where)

    def in_scores(self, spec: Any) -> bool:
        """Whether a seed's scores under ``spec`` hold this kind's table: by default, those of
        every sweep of held-out text (none of a task sweep)."""
        return not spec.task_sweep

    def check_term(self, kind: str, length: Length, spec: Any, where: str, text: str) -> None:
        """Raise ``SpecError`` unless ``spec`` scores the term (its table, its length) of the
        metric ``text``."""
        raise NotImplementedError

    def parse_table(self, value: Any, default_lengths: list) -> Any:
        """Its settings from its ``[eval]`` table (``table``); ``default_lengths``: ``[eval]
        lengths`` as written."""
        raise NotImplementedError

    def finish(self, settings: Any, spec: Any) -> Any:
        """Its settings once the whole spec is read (a default that follows another section)."""
        return settings

    def record(self, settings: Any) -> Any:
        """Its settings as a score's key records them (JSON)."""
        return settings.settings()

    def check_difference(self, first: Length, second: Length, text: str, where: str) -> None:
        """Two terms of this kind subtracted unit by unit: their units must pair."""

    def scored(self, spec: Any) -> list[tuple[str, Length]]:
        """The (term kind, length) rows of the report's table of each cell; none by default."""
        return []

    def score(self, job: Job) -> dict[str, Any]:
        """``{table name: table}`` of one seed's run, merged into its scores."""
        raise NotImplementedError

    def term(self, scores: dict, kind: str, length: str) -> dict:
        """A term's ``{"mean", "chunks"}`` in a seed's scores."""
        return scores[self.name][length]

    # The report (``sweep/report.py``) asks every kind the spec scores for its parts:
    def cell_summary(self, plan: Any, scores: dict[int, dict]) -> dict:
        """Figures of a cell over its seeds (``scores``: seed -> scores) besides its rows of
        the table, into the cell's entry of ``results.json``."""
        return {}

    def notes(self, spec: Any) -> list[str]:
        """What its columns of the cells' table mean, under the table."""
        return []

    def markdown(self, plan: Any, results: dict) -> list[str]:
        """A section of its own in ``report.md``, after the cells' table."""
        return []

    def plots(self, plan: Any, results: dict, out: str, plt) -> list[str]:
        """Figures saved into ``out`` (matplotlib's ``pyplot`` given); their file names."""
        return []


def fmt(x, digits: int = 3) -> str:
    """A figure in the report (``n/a`` for none)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def saved(plt, fig, out: str, name: str, drawn: bool = True) -> list[str]:
    """``fig`` saved as ``out/name`` when it holds a drawing, then closed: the names written."""
    if drawn:
        fig.savefig(os.path.join(out, name), dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [name] if drawn else []


def chunk_summary(losses_N, length: int, chunk: int) -> dict:
    """A length's scores over the held-out stream: its mean and the means of its chunks."""
    import numpy as np

    from transformers_jax.study.stats import block_means

    return {"tokens": length, "mean": float(np.nanmean(losses_N)),
            "chunks": block_means(losses_N, chunk).tolist()}


def scored_length(length: Length, scored: tuple[Length, ...], table: str, text: str,
                  where: str) -> None:
    """A term's length is one its table scores."""
    if not any(length.text == x.text for x in scored):
        raise SpecError(f"{where}: {text!r} needs length {length.text}, which {table} "
                        f"({[x.text for x in scored]}) does not score; add it there")
