"""``context:PERTURBATION@B``: context usage (``[eval.context]``, ``sweep/context.py``): how
much the loss of a window's last tokens rises when the context farther than B tokens back is
perturbed, window by window (the windows are the units; higher: more of that context used)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from transformers_jax.overrides import closest
from transformers_jax.study import stats
from transformers_jax.sweep.context import PERTURBATIONS
from transformers_jax.sweep.scores.base import Job, ScoreKind, fmt, saved
from transformers_jax.sweep.terms import (
    Length,
    SpecError,
    distinct_list,
    parse_length,
    positive_int,
    seed_value,
    unknown_keys,
)

KEYS = {"window", "target", "distances", "perturbations", "windows", "span", "seed"}


@dataclasses.dataclass(frozen=True)
class Context:
    """``[eval.context]``: context usage in windows of ``window`` tokens, the last ``target``
    scored, the context farther than each distance perturbed."""

    window: Length
    target: int
    distances: tuple[int, ...]
    perturbations: tuple[str, ...]
    windows: int
    span: int  # shuffle_local's spans
    seed: int

    def check(self, window: int, where: str) -> None:
        """Every distance leaves some far context in a window of ``window`` tokens."""
        if self.target >= window:
            raise SpecError(f"{where}: target = {self.target} scores the whole window of "
                            f"{window} tokens; score fewer (the context is what comes before)")
        longest = window + 1 - self.target  # the first target's context, w[:first]
        far = [b for b in self.distances if b >= longest]
        if far:
            raise SpecError(f"{where}: distance {far[0]} leaves no context to perturb in a window "
                            f"of {window} tokens with {self.target} targets (the first target "
                            f"has {longest} before it); use distances below {longest} or a "
                            "longer window")

    def settings(self) -> dict:
        return {**dataclasses.asdict(self), "window": self.window.text,
                "distances": list(self.distances), "perturbations": list(self.perturbations)}


def parse_context(table: Any) -> Context:
    """``[eval.context]`` checked (its window against each cell's length in the plan)."""
    where = "[eval.context]"
    if not isinstance(table, dict):
        raise SpecError(f"{where}: a table such as {{window = 512, target = 16, distances = "
                        "[20, 50, 200]}")
    unknown_keys(table, KEYS, where)
    for key in ("window", "distances"):
        if key not in table:
            raise SpecError(f"{where}: give {key} (window: tokens a model reads, such as 512 "
                            "or \"4x\"; distances: b in tokens, such as [20, 50, 200])")
    window = parse_length(table["window"], f"{where} window")
    target = positive_int(table.get("target", 1), f"{where} target")
    distances = distinct_list(table["distances"], f"{where} distances",
                              lambda b: isinstance(b, int) and not isinstance(b, bool)
                              and b > 0, "distances in tokens (1 or more: the first target "
                              "needs a token to be predicted from)")
    names = distinct_list(table.get("perturbations", list(PERTURBATIONS.names())),
                          f"{where} perturbations", lambda n: isinstance(n, str),
                          f"names ({', '.join(PERTURBATIONS.names())})")
    for name in names:
        if name not in PERTURBATIONS:
            near = closest(name, set(PERTURBATIONS.names()))
            raise SpecError(f"{where} perturbations: {name!r} is not one; "
                            + (f"did you mean {near!r}? " if near else "")
                            + f"known: {', '.join(PERTURBATIONS.names())}")
    seed = seed_value(table.get("seed", 0), f"{where} seed")
    context = Context(window, target, tuple(sorted(distances)), tuple(names),
                      positive_int(table.get("windows", 200), f"{where} windows"),
                      positive_int(table.get("span", 20), f"{where} span"), seed)
    if window.tokens is not None:
        context.check(window.tokens, where)
    return context


def target_losses(model, params, windows_WT, target: int, batch_size: int):
    """Each window's mean next-token loss over its last ``target`` predictions ``[W]``."""
    import numpy as np

    from transformers_jax.evaluation import window_losses

    losses_fn = window_losses(model)
    out = []
    for i in range(0, len(windows_WT), batch_size):
        chunk_BT = windows_WT[i : i + batch_size]
        padded_BT = np.concatenate([chunk_BT, np.repeat(chunk_BT[-1:], batch_size - len(chunk_BT),
                                                        0)])  # one shape: one compile
        loss_BT = np.asarray(losses_fn(params, padded_BT))
        out.append(loss_BT[: len(chunk_BT), -target:].mean(axis=1))
    return np.concatenate(out)


def context_scores(model, params, windows, batch_size: int) -> dict:
    """Context usage of one run on the sweep's windows (``context.Windows``): the intact
    windows' loss of the targets, and for each perturbation and distance the increase over
    it, window by window (nats per token; ``relative``: the mean increase over the mean
    intact loss, Khandelwal et al.'s measure). The windows are the units (``chunks``) that
    pair cells, seeds and distances."""
    intact_W = target_losses(model, params, windows.intact_WT, windows.target, batch_size)
    out: dict = {"window": windows.window, "target": windows.target,
                 "intact": {"mean": float(intact_W.mean()), "chunks": intact_W.tolist()}}
    for (name, b), perturbed_WT in windows.perturbed.items():
        up_W = target_losses(model, params, perturbed_WT, windows.target, batch_size) - intact_W
        out.setdefault(name, {})[str(b)] = {
            "mean": float(up_W.mean()), "chunks": up_W.tolist(),
            "relative": float(up_W.mean() / intact_W.mean())}
    return out


def context_summary(plan, scores: dict[int, dict]) -> dict:
    """A cell's context usage over its seeds: the intact loss of the targets, and for each
    perturbation and distance the mean increase with its paired 95% interval over seeds x
    windows (each entry on its own, not corrected for the table's many: the claims are the
    declared comparisons) and the relative increase."""
    ctx = plan.spec.context
    seeds = sorted(scores)
    out: dict = {"window": plan.context.window, "target": ctx.target,
                 "intact": [scores[s]["context"]["intact"]["mean"] for s in seeds], "rows": []}
    intact = float(np.mean(out["intact"])) if seeds else math.nan
    for name in ctx.perturbations:
        for b in ctx.distances:
            row: dict = {"perturbation": name, "b": b, "per_seed": [
                scores[s]["context"][name][str(b)]["mean"] for s in seeds]}
            if seeds:
                result = stats.paired(np.stack([scores[s]["context"][name][str(b)]["chunks"]
                                                for s in seeds]))
                low, high = result.interval()
                row.update(mean=result.mean, low=low, high=high,
                           relative=result.mean / intact)
            out["rows"].append(row)
    return out


def context_markdown(plan, results: dict) -> list[str]:
    """One table per perturbation: the loss it adds at each distance, cells side by side."""
    ctx = plan.spec.context
    first = plan.context.window + 1 - ctx.target
    lines = ["", "## Context usage", "",
             f"{ctx.windows} held-out windows of {plan.context.window} tokens, the last "
             f"{ctx.target} scored (the first of them with {first} tokens before it), drawn by "
             f"seed {ctx.seed}: the same windows and the same perturbations for every cell and "
             "seed. Each entry is the loss the perturbation of the context farther than b "
             "tokens from the first target adds (nats per token, mean over seeds x windows), "
             "its paired 95% interval over seeds x windows (each entry alone, not corrected: "
             "the claims are the declared comparisons), and the relative increase over the "
             "intact loss (Khandelwal et al. 2018's measure).", "",
             "Intact loss of the targets: " + ", ".join(
                 f"{c['name']} {fmt(float(np.mean(c['context']['intact'])))}"
                 for c in results["cells"] if c["context"]["intact"]) + "."]
    for name in ctx.perturbations:
        about = PERTURBATIONS.get(name).about.format(span=ctx.span)
        lines += ["", f"**{name}**: {about}.", "",
                  "| cell | " + " | ".join(f"b={b}" for b in ctx.distances) + " |",
                  "|---|" + "---|" * len(ctx.distances)]
        for c in results["cells"]:
            rows = {r["b"]: r for r in c["context"]["rows"] if r["perturbation"] == name}
            entries = [f"{rows[b]['mean']:+.3f} [{rows[b]['low']:+.3f}, {rows[b]['high']:+.3f}] "
                       f"{100 * rows[b]['relative']:+.1f}%" if "mean" in rows[b] else "pending"
                       for b in ctx.distances]
            lines.append(f"| {c['name']} | " + " | ".join(entries) + " |")
    return lines


def context_plot(plan, results: dict, out: str, plt) -> list[str]:
    """The relative loss increase against b, a panel per perturbation, cells side by side,
    each with its paired 95% interval as a band."""
    ctx = plan.spec.context
    cells = [c for c in results["cells"] if c["context"]["intact"]]
    if not cells:
        return []
    fig, axes = plt.subplots(1, len(ctx.perturbations), squeeze=False,
                             figsize=(3.6 * len(ctx.perturbations), 3.6))
    for ax, name in zip(axes[0], ctx.perturbations, strict=True):
        for c in cells:
            rows = [r for r in c["context"]["rows"] if r["perturbation"] == name]
            intact = float(np.mean(c["context"]["intact"]))
            x = [r["b"] for r in rows]
            (line,) = ax.plot(x, [100 * r["relative"] for r in rows], marker="o", markersize=3,
                              label=c["name"])
            ax.fill_between(x, [100 * r["low"] / intact for r in rows],
                            [100 * r["high"] / intact for r in rows], color=line.get_color(),
                            alpha=0.2, linewidth=0)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("b (tokens before the first target)")
    axes[0][0].set_ylabel("loss increase (%), band: paired 95%")
    axes[0][-1].legend(fontsize=7)
    return saved(plt, fig, out, "context_usage.png")


class ContextUsage(ScoreKind):
    per_window = True
    term_help = ("context:PERTURBATION@B (the loss increase when the context beyond B tokens "
                 "is perturbed, [eval.context])")
    table = "context"  # [eval.context]

    def parse_table(self, value: Any, default_lengths: list) -> Context:
        return parse_context(value)

    def parse_term(self, variant, length, where) -> Length:
        if variant is None or not length.isdigit():
            raise SpecError(f"{where}: context:PERTURBATION@B names a perturbation and a "
                            "distance B in tokens (context:shuffle@50)")
        return Length(length, tokens=int(length))

    def in_scores(self, spec) -> bool:
        return spec.context is not None

    def check_term(self, kind, length, spec, where, text) -> None:
        where, context = f"{where}: {text!r}", spec.context
        if context is None:
            raise SpecError(f"{where} needs context usage; add an [eval.context] table (window, "
                            "distances, perturbations)")
        name = kind.partition(":")[2]
        if name not in context.perturbations:
            raise SpecError(f"{where}: [eval.context] perturbations ("
                            f"{', '.join(context.perturbations)}) do not include {name!r}; add "
                            "it there")
        if length.tokens not in context.distances:
            raise SpecError(f"{where}: distance {length.tokens} is not in [eval.context] "
                            f"distances ({list(context.distances)}); add it there")

    def score(self, job: Job) -> dict:
        return {self.name: context_scores(job.model, job.params, job.plan.context,
                                          job.plan.spec.eval_batch_size)}

    def term(self, scores: dict, kind: str, length: str) -> dict:
        return scores[self.name][kind.partition(":")[2]][length]

    def cell_summary(self, plan, scores) -> dict:
        return {self.name: context_summary(plan, scores)}

    def markdown(self, plan, results) -> list[str]:
        return context_markdown(plan, results)

    def plots(self, plan, results, out, plt) -> list[str]:
        return context_plot(plan, results, out, plt)
