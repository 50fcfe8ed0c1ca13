"""``loss@L``: the mean next-token loss over the held-out stream in non-overlapping windows of
L tokens (``[eval] lengths``), by chunk of the stream, and the loss by position in the window
(``[eval] by_position``)."""

from __future__ import annotations

from transformers_jax.sweep.scores.base import Job, ScoreKind, chunk_summary, saved, scored_length
from transformers_jax.sweep.terms import SpecError


class Loss(ScoreKind):
    term_help = ("loss@L (non-overlapping windows of L), L tokens or a multiple of seq_len "
                 "such as 2x")

    def check_term(self, kind, length, spec, where, text) -> None:
        scored_length(length, spec.lengths, "[eval] lengths", text, where)

    def scored(self, spec):
        return [(self.name, x) for x in spec.lengths]

    def score(self, job: Job) -> dict:
        import numpy as np

        spec, planned = job.plan.spec, job.planned
        loss, by_position = {}, {}
        for length_spec, length in zip(spec.lengths, planned.lengths(spec), strict=True):
            try:
                losses_N = job.stream_losses(length)
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

    def cell_summary(self, plan, scores) -> dict:
        """The loss by position in each window, mean over seeds."""
        import numpy as np

        if not (plan.spec.by_position and scores):
            return {}
        return {"by_position": {
            x.text: np.mean([scores[s]["by_position"][x.text] for s in scores], 0).tolist()
            for x in plan.spec.lengths}}

    def plots(self, plan, results, out, plt) -> list[str]:
        return loss_by_length(results, out, plt) + loss_by_position(plan, results, out, plt)


def loss_by_length(results: dict, out: str, plt) -> list[str]:
    """Each cell's held-out loss against the evaluation length, the band min to max over
    seeds, the largest budget's n-gram baselines as lines."""
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in results["cells"]:
        rows = [e for e in c["by_length"] if e["kind"] == "loss" and e["per_seed"]]
        if not rows:
            continue
        x = [e["tokens"] for e in rows]
        y_SX = np.array([e["per_seed"] for e in rows]).T
        (line,) = ax.plot(x, y_SX.mean(0), marker="o", markersize=3, label=c["name"])
        if y_SX.shape[0] > 1:
            ax.fill_between(x, y_SX.min(0), y_SX.max(0), color=line.get_color(), alpha=0.2,
                            linewidth=0)
    if ax.lines:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.set_title("mean over seeds; band: min to max")
        by_budget = results["baselines"]
        largest = by_budget[max(by_budget, key=int)] if by_budget else {}
        largest = {k: v for k, v in largest.items() if not isinstance(v, dict)}
        for name, value in largest.items():  # the largest budget's: the strongest
            ax.axhline(value, color="grey", linestyle=":", linewidth=0.8)
            ax.annotate(name, (0.01, value), xycoords=("axes fraction", "data"), fontsize=7)
        ax.legend(fontsize=7)
    return saved(plt, fig, out, "loss_by_length.png", bool(ax.lines))


def loss_by_position(plan, results: dict, out: str, plt) -> list[str]:
    """Each cell's loss by position in a window of the longest evaluation length."""
    import numpy as np

    longest = plan.spec.lengths[-1].text
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in results["cells"]:
        curve = c.get("by_position", {}).get(longest)
        if curve:
            ax.plot(np.arange(1, len(curve) + 1), curve, linewidth=0.8, label=c["name"])
    if ax.lines:
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"position in a window of {longest}")
        ax.set_ylabel("held-out loss (nats/token), mean over seeds")
        ax.legend(fontsize=7)
    return saved(plt, fig, out, "loss_by_position.png", bool(ax.lines))
