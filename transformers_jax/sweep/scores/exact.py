"""``exact@N`` / ``exact@A-B``: exact match of a run trained on a synthetic task (``--task``)
at task length N, or over lengths A-B side by side (``[eval.task]``, ``sweep/tasks.py``),
example by example: the same test examples for every cell and seed. A task sweep scores
nothing else."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from transformers_jax.sweep.scores.base import Job, ScoreKind, saved
from transformers_jax.sweep.terms import (
    Length,
    SpecError,
    positive_int,
    seed_value,
    task_range,
    unknown_keys,
)

KEYS = {"lengths", "examples", "seed"}


@dataclasses.dataclass(frozen=True)
class TaskEval:
    """``[eval.task]``: exact match of task cells (``--task NAME``) at each task length in
    ``lengths``, on ``examples`` test examples per length drawn by ``seed``: the same
    examples for every cell (of one task) and seed, so that they pair example by example."""

    lengths: tuple[int, ...]
    examples: int
    seed: int

    def settings(self) -> dict:
        return {"lengths": list(self.lengths), "examples": self.examples, "seed": self.seed}


def task_lengths(value: Any, where: str) -> tuple[int, ...]:
    """``"21-40"``, ``12``, or a list of them: the task lengths, sorted, each once."""
    items = value if isinstance(value, list) else [value]
    found: set[int] = set()
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool) and item >= 1:
            found.add(item)
        elif isinstance(item, str) and re.fullmatch(r"\d+(-\d+)?", item.strip()):
            lo, hi = task_range(item.strip())
            if not 1 <= lo <= hi:
                raise SpecError(f"{where} = {value!r}: {item!r} is an empty range; write "
                                "\"LOW-HIGH\" with 1 <= LOW <= HIGH")
            found.update(range(lo, hi + 1))
        else:
            raise SpecError(f"{where} = {value!r}: give task lengths as a range (\"1-40\"), a "
                            "positive integer, or a list of them ([8, \"17-24\"])")
    if not found:
        raise SpecError(f"{where} = {value!r}: give at least one task length (\"1-40\")")
    return tuple(sorted(found))


def parse_task(table: Any) -> TaskEval:
    """``[eval.task]``, checked: the task lengths scored, examples per length, their seed."""
    where = "[eval.task]"
    if not isinstance(table, dict):
        raise SpecError(f"{where}: a table, such as [eval.task] lengths = \"1-40\", "
                        "examples = 64")
    unknown_keys(table, KEYS, where)
    if "lengths" not in table:
        raise SpecError(f"{where}: give lengths, the task lengths to score (\"1-40\": the "
                        "training lengths and past them)")
    seed = seed_value(table.get("seed", 0), f"{where} seed", " (draws the test examples, the "
                      "same for every cell and seed)")
    return TaskEval(task_lengths(table["lengths"], f"{where} lengths"),
                    positive_int(table.get("examples", 64), f"{where} examples"), seed)


def _ranges(lengths: tuple[int, ...]) -> str:
    """(1, 2, 3, 7) -> "1-3, 7"."""
    out, start = [], lengths[0]
    for prev, n in zip(lengths, (*lengths[1:], None), strict=True):
        if n != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = n
    return ", ".join(out)


def exact_plot(plan, results: dict, out: str, plt) -> list[str]:
    """Exact match against task length, a panel per task, the band min to max over seeds."""
    by_name = {p.cell.name: p for p in plan.cells}
    cells = [c for c in results["cells"] if c["seeds_scored"]]
    tasks = sorted({by_name[c["name"]].train.task for c in cells})
    if not tasks:
        return []
    fig, axes = plt.subplots(1, len(tasks), squeeze=False, sharey=True,
                             figsize=(4.6 * len(tasks), 3.8))
    for ax, task in zip(axes[0], tasks, strict=True):
        for c in cells:
            planned = by_name[c["name"]]
            if planned.train.task != task:
                continue
            x = [e["tokens"] for e in c["by_length"]]
            y_SX = np.array([e["per_seed"] for e in c["by_length"]]).T
            (line,) = ax.plot(x, y_SX.mean(0), marker="o", markersize=2, label=c["name"])
            ax.fill_between(x, y_SX.min(0), y_SX.max(0), color=line.get_color(), alpha=0.15,
                            linewidth=0)
            ax.axvline(planned.train.train_lengths[1] + 0.5, color="grey", linestyle=":",
                       linewidth=0.8)
        ax.set_title(task)
        ax.set_xlabel("task length (dotted: longest trained)")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("exact match, mean over seeds")
    return saved(plt, fig, out, "exact_by_length.png")


class ExactMatch(ScoreKind):
    higher_is_better = True
    task = True
    term_help = ("exact@N / exact@A-B (exact match at task length N, or its mean over A-B, "
                 "[eval.task])")
    table = "task"  # [eval.task]

    def parse_table(self, value: Any, default_lengths: list) -> TaskEval:
        return parse_task(value)

    def parse_term(self, variant, length, where) -> Length:
        if variant is not None or not re.fullmatch(r"\d+(-\d+)?", length):
            raise SpecError(f"{where}: exact@N or exact@A-B (task lengths)")
        lo, hi = task_range(length)
        if not 1 <= lo <= hi:
            raise SpecError(f"{where}: 'exact@{length}' is no range of task lengths; write "
                            "exact@LOW-HIGH with 1 <= LOW <= HIGH")
        return Length(length)

    def in_scores(self, spec) -> bool:
        return spec.task is not None

    def check_term(self, kind, length, spec, where, text) -> None:
        where, task = f"{where}: {text!r}", spec.task
        if task is None:
            raise SpecError(f"{where} needs exact match on a task; add an [eval.task] table "
                            "(lengths, examples) and train the cells with --task NAME")
        lo, hi = task_range(length.text)
        missing = [n for n in range(lo, hi + 1) if n not in task.lengths]
        if missing:
            raise SpecError(f"{where}: task length {missing[0]} is not scored; add it to "
                            f"[eval.task] lengths (now {_ranges(task.lengths)})")

    def check_difference(self, first: Length, second: Length, text: str, where: str) -> None:
        widths = [task_range(x.text)[1] - task_range(x.text)[0] for x in (first, second)]
        if widths[0] != widths[1]:
            lo, _ = task_range(second.text)
            raise SpecError(f"{where}: {text!r} subtracts exact match example by example, so "
                            "it needs ranges of as many lengths on both sides (e.g. "
                            f"\"exact@{first.text} - exact@{lo}-{lo + widths[0]}\")")

    def scored(self, spec):
        return ([(self.name, Length(str(n), tokens=n)) for n in spec.task.lengths]
                if spec.task is not None else [])

    def score(self, job: Job) -> dict:
        from transformers_jax.sweep.tasks import task_scores

        planned = job.planned
        return {self.name: task_scores(job.model, job.params, job.tokenizer, planned.model,
                                       planned.train.task, job.plan.spec.task)}

    def term(self, scores: dict, kind: str, length: str) -> dict:
        """The examples of every length in the range side by side, and their mean."""
        import numpy as np

        lo, hi = task_range(length)
        chunks = [x for n in range(lo, hi + 1) for x in scores[self.name][str(n)]["chunks"]]
        return {"mean": float(np.mean(chunks)), "chunks": chunks}

    def plots(self, plan, results, out, plt) -> list[str]:
        return exact_plot(plan, results, out, plt)
