"""A sweep's report, rewritten after every finished cell and at the end:

- ``OUT/report.md``: the command that regenerates it, every cell's mean and spread over seeds
  at each evaluation length, the n-gram baselines on the same held-out tokens, and every
  declared comparison with its paired interval, Holm-adjusted p-value and verdict (pending
  while a cell of it is unfinished);
- ``OUT/results.json``: the same figures, the per-chunk scores behind them, and ``provenance``
  (code, data, library versions, host, times, the spec);
- ``OUT/loss_by_length.png`` and ``OUT/loss_by_position.png`` (with matplotlib), and with
  ``[eval.context]`` ``OUT/context_usage.png``;
- ``OUT/hparams/``: TensorBoard's hparams view of the cells.
"""

from __future__ import annotations

import math
import os
import shlex

import numpy as np

from transformers_jax.study import provenance, stats
from transformers_jax.sweep.cells import lineage
from transformers_jax.sweep.plan import PlannedCell, SweepPlan
from transformers_jax.sweep.runner import (
    CELL_FILE,
    cell_dir,
    digest,
    read_json,
    read_scores,
    train_args,
    write_json,
)
from transformers_jax.sweep.scores import in_order, kind_of
from transformers_jax.sweep.scores.base import fmt as _fmt
from transformers_jax.sweep.scores.equal_context import with_context
from transformers_jax.sweep.spec import Metric


def term(scores: dict, kind: str, length: str) -> dict:
    """One term's ``{"mean", "chunks"}`` in a seed's scores (its score kind reads it)."""
    return kind_of(kind).term(scores, kind, length)


def metric_chunks(scores: dict, metric: Metric) -> np.ndarray:
    """One seed's per-chunk (context: per-window) values of ``metric`` (a difference: chunk
    by chunk)."""
    values = [np.asarray(term(scores, kind, length.text)["chunks"], np.float64)
              for kind, length in metric.terms]
    return values[0] if len(values) == 1 else values[0] - values[1]


def metric_mean(scores: dict, metric: Metric) -> float:
    values = [term(scores, kind, length.text)["mean"] for kind, length in metric.terms]
    return values[0] if len(values) == 1 else values[0] - values[1]


def verdict(low: float, high: float, a: str, b: str | None, metric: Metric,
            better: str) -> str:
    """Plain words for the interval: which cell is better; for a context metric (more loss
    added: more context used) which is higher; for ``a`` alone whether it is above zero."""
    if b is None:
        if math.isnan(low) or math.isnan(high):
            return "not scored"
        return "inconclusive" if low <= 0 <= high else ("above zero" if low > 0
                                                        else "below zero")
    if metric.per_window:
        word = stats.verdict(low, high, a, b, "higher")
        return word.replace(" better", " higher")
    return stats.verdict(low, high, a, b, better)


def side_chunks(scored: dict, cell, ref, seed: int, metric: Metric):
    """One side of a comparison for one seed, chunk by chunk: its cell's values of
    ``metric``, minus its reference cell's (``relative_to``); 0 for no cell (``a`` alone:
    its own values, themselves differences, against zero)."""
    if cell is None:
        return 0.0
    out = metric_chunks(scored[cell.name][seed], metric)
    return out if ref is None else out - metric_chunks(scored[ref.name][seed], metric)


def compare(plan: SweepPlan, scored: dict[str, dict[int, dict]],
            codes: dict[str, list[dict]] | None = None) -> list[dict]:
    """Every declared comparison: its paired differences over seeds x chunks, Holm-corrected
    over the family of those that could be scored (pending ones wait for their cells).
    ``codes``: each cell's code states (``cell.json``); a comparison whose cells were trained
    by more than one is flagged with them."""
    seeds = plan.spec.seeds
    rows, tests = [], []
    for pair in plan.pairs:
        row = {"compare": pair.index, "claim": pair.claim, "a": pair.a_text, "b": pair.b_text,
               "metric": pair.metric.text, "better": pair.better}
        states = {provenance.describe(c) for cell in (pair.a, pair.b, pair.a_ref, pair.b_ref)
                  if cell is not None for c in (codes or {}).get(cell.name, [])}
        if len(states) > 1:
            row["code_states"] = sorted(states)
        # a side: its cell's scores by seed, minus its reference cell's (relative_to); None: 0
        sides = [(pair.a, pair.a_ref), (pair.b, pair.b_ref)]
        needed = [c.name for side in sides for c in side if c is not None]
        if not all(s in scored.get(name, {}) for name in needed for s in seeds):
            rows.append({**row, "verdict": "pending"})
            continue
        d_SC = np.stack([side_chunks(scored, *sides[0], s, pair.metric)
                         - side_chunks(scored, *sides[1], s, pair.metric) for s in seeds])
        result = stats.paired(d_SC)
        p = result.p_value() if pair.margin is None else result.p_equivalence(pair.margin)
        row.update(mean=result.mean, per_seed=result.per_seed.tolist(), p=p,
                   chunks=int(result.d_SC.shape[1]), primary=pair.primary,
                   **({"margin": pair.margin} if pair.margin is not None else {}))
        rows.append(row)
        tests.append((row, result, pair))
    # Holm's family: the primary claims; an exploratory one is read alone, at 95%, unadjusted
    family = [t for t in tests if t[2].primary]
    adjusted, levels = stats.holm([row["p"] for row, _, _ in family])
    alone = [(t, t[0]["p"], stats.ALPHA) for t in tests if not t[2].primary]
    for (row, result, pair), p_holm, level in [
            *zip(family, adjusted, levels, strict=True), *alone]:
        # an equivalence claim's interval: 1 - 2 alpha, the two one-sided tests' at alpha
        width = level if pair.margin is None else 2 * level
        low, high = result.interval(width) if not math.isnan(level) else (math.nan, math.nan)
        if pair.margin is not None:
            word = stats.equivalence_verdict(low, high, pair.margin)
        else:
            word = verdict(low, high, row["a"], row["b"], pair.metric, row["better"])
        row.update(p_holm=p_holm if pair.primary else None,
                   level=1 - width if not math.isnan(level) else math.nan, low=low, high=high,
                   verdict=word if pair.primary else f"{word} (exploratory)")
    return rows


def controls(plan: SweepPlan, scored: dict[str, dict[int, dict]]) -> list[dict]:
    """Each positive control on each cell it bounds: the metric per seed, and "passed" when
    every seed reaches the bound ("failed" otherwise, "pending" until every seed is scored)."""
    rows = []
    for control, cells in plan.controls:
        for cell in cells:
            row = {"control": control.index, "claim": control.claim, "cell": cell.name,
                   "metric": control.metric.text, "bound": control.text}
            by_seed = scored.get(cell.name, {})
            if not all(s in by_seed for s in plan.spec.seeds):
                rows.append({**row, "status": "pending"})
                continue
            values = [metric_mean(by_seed[s], control.metric) for s in plan.spec.seeds]
            rows.append({**row, "per_seed": values, "mean": float(np.mean(values)),
                         "status": "passed" if all(map(control.passes, values)) else "failed"})
    return rows


def gate(plan: SweepPlan, comparisons: list[dict], control_rows: list[dict]) -> None:
    """A comparison whose metric is of a kind a control bounds (passkey, exact, ...) is not
    read where that control failed, or is still pending, on one of its cells or a cell they
    started from: its verdict says so (its interval stays, and in Holm's family)."""
    cells = [p.cell for p in plan.cells]
    kinds = {c.index: c.metric.kinds for c, _ in plan.controls}
    for row, pair in zip(comparisons, plan.pairs, strict=True):
        if row["verdict"] == "pending":
            continue
        chain = {x.name for cell in (pair.a, pair.b, pair.a_ref, pair.b_ref) if cell is not None
                 for x in (cell, *lineage(cells, cell))}
        blocking = [c for c in control_rows if c["cell"] in chain
                    and kinds[c["control"]] & pair.metric.kinds and c["status"] != "passed"]
        if blocking:
            first = blocking[0]
            row["read_as"] = row["verdict"]
            row["verdict"] = (f"not read: control {first['control']} {first['status']} in "
                              f"{first['cell']}")


def cell_summary(plan: SweepPlan, planned: PlannedCell, scores: dict[int, dict]) -> dict:
    spec = plan.spec
    trains = not planned.zero_shot
    out: dict = {"name": planned.cell.name, "values": planned.cell.values,
                 "from": planned.parent.cell.name if planned.parent else None,
                 "zero_shot": planned.zero_shot,
                 "command": shlex.join(["tjax", "train", *train_args(planned)]) if trains
                 else None,
                 "seq_len": planned.train.seq_len, "reference_len": planned.reference_len,
                 "batch_size": planned.train.batch_size if trains else 0,
                 "steps": planned.train.steps if trains else 0, "tokens": planned.tokens,
                 "tokens_seen": planned.tokens_seen,
                 "seeds_scored": sorted(scores), "by_length": []}
    for kind, length_spec in spec.scored():
        means = [scores[s][kind][length_spec.text]["mean"] for s in sorted(scores)]
        out["by_length"].append({
            "kind": kind, "length": length_spec.text,
            "tokens": length_spec.resolve(planned.reference_len),
            "per_seed": means, "mean": float(np.mean(means)) if means else math.nan,
            "std": float(np.std(means, ddof=1)) if len(means) > 1 else math.nan})
    for kind in scored_kinds(spec):
        out.update(kind.cell_summary(plan, scores))
    return out


def baselines(plan: SweepPlan) -> dict[int, dict[str, float]]:
    """For each cell's token budget: unigram (add-one) and Kneser-Ney n-gram losses on the
    held-out stream, fitted on the first that many tokens of the training text in its stored
    order: a reference the size of what a cell reads, not the tokens any seed read (those
    are shuffled: ``seed_baselines`` fits on them). A cell with a parent counts its
    ancestors' tokens too (``tokens_seen``); a zero-shot cell has its parent's."""
    from transformers_jax.study.ngram import KneserNey

    if plan.split is None:  # a task sweep: no held-out text to fit them to
        return {}
    vocab = plan.tokenizer.vocab_size
    out = {}
    # the positions loss_k@L scores, by window length: the n-grams scored there as well
    equal = plan.spec.tables.get("equal_context")
    for budget in sorted({c.tokens_seen for c in plan.cells}):
        train_N = plan.train_N[:budget]
        counts = np.bincount(train_N, minlength=vocab).astype(np.float64) + 1.0
        unigram_N = -np.log(counts / counts.sum())[plan.heldout_N]
        losses = {"unigram": float(unigram_N.mean())}
        by_order = {"unigram": np.concatenate([[np.nan], unigram_N[1:]])}  # as token_losses
        for k in plan.spec.ngram_orders:
            if k > 1:
                token_losses = KneserNey(k, vocab).fit(train_N).token_losses(plan.heldout_N)
                losses[f"{k}-gram"] = float(token_losses.mean())
                by_order[f"{k}-gram"] = np.concatenate([[np.nan], token_losses])
        if equal is not None:
            lengths = sorted({n for c in plan.cells if c.tokens_seen == budget
                              for n in c.lengths(plan.spec)})
            # the positions the model scores: windows from the start, the last one whole
            scored = {n: len(range(0, len(plan.heldout_N) - n, n)) * n + 1 for n in lengths}
            losses["equal_context"] = {str(n): {name: float(np.nanmean(
                with_context(values_N[: scored[n]], n, equal["k"])))
                for name, values_N in by_order.items()} for n in lengths}
        out[budget] = losses
    return out


def seed_baselines(plan: SweepPlan) -> dict[str, dict[str, dict[str, float]]]:
    """For each cell and seed: unigram (add-one) and Kneser-Ney n-gram losses on the held-out
    stream, fitted on the tokens that seed's run read in training (``seed_text``), so that a
    model is held to a baseline that saw exactly its text. Fits are shared by runs that read
    the same tokens."""
    import hashlib

    from transformers_jax.study.ngram import KneserNey
    from transformers_jax.sweep.seed_text import seed_tokens

    if plan.split is None:  # a task sweep: no held-out text
        return {}
    vocab, cache, fits = plan.tokenizer.vocab_size, {}, {}
    out: dict = {}
    for planned in plan.cells:
        for seed in plan.spec.seeds:
            tokens = seed_tokens(planned, seed, plan.tokenizer, cache)
            key = hashlib.sha1(tokens.tobytes()).hexdigest()
            if key not in fits:
                counts = np.bincount(tokens, minlength=vocab).astype(np.float64) + 1.0
                fits[key] = {"tokens": int(tokens.size), "unigram": float(
                    -np.log(counts / counts.sum())[plan.heldout_N].mean())}
                for k in plan.spec.ngram_orders:
                    if k > 1:
                        fits[key][f"{k}-gram"] = KneserNey(k, vocab).fit(tokens).loss(
                            plan.heldout_N)
            out.setdefault(planned.cell.name, {})[str(seed)] = fits[key]
    return out


BASELINES_FILE = "baselines.json"


def fitted_baselines(plan: SweepPlan, out: str) -> tuple[dict, dict]:
    """``baselines`` and ``seed_baselines``, fitted once per sweep folder: kept in
    ``OUT/baselines.json`` under what decides them (the data, the n-gram orders, equal context,
    each cell's budget, parent and training batches for each seed), so that the worker
    processes of ``--workers`` and a later invocation read them back instead of fitting again."""
    from transformers_jax.sweep.seed_text import data_key

    key = digest({"data": plan.data_sha256, "orders": plan.spec.ngram_orders,
                  "equal_context": plan.spec.tables.get("equal_context"),
                  "cells": [[p.cell.name, p.cell.parent, p.tokens_seen,
                             [data_key(p, s) for s in plan.spec.seeds]] for p in plan.cells]})
    path = os.path.join(out, BASELINES_FILE)
    kept = read_json(path)
    if kept is None or kept.get("key") != key:
        kept = {"key": key, "budgets": baselines(plan), "seeds": seed_baselines(plan)}
        os.makedirs(out, exist_ok=True)
        write_json(path, kept)
        kept = read_json(path)  # as a worker reads them: budgets keyed by strings
    return kept["budgets"], kept["seeds"]


def not_past(results: dict, spec) -> list[str]:
    """The seeds whose loss at the first length is not below their own strongest n-gram."""
    lines = []
    first = spec.lengths[0].text
    for c in results["cells"]:
        own = results.get("seed_baselines", {}).get(c["name"], {})
        row = next((e for e in c["by_length"] if (e["kind"], e["length"]) == ("loss", first)),
                   None)
        if not own or row is None or not row["per_seed"]:
            continue
        missed = []
        for seed, loss in zip(c["seeds_scored"], row["per_seed"], strict=True):
            base = {k: v for k, v in own[str(seed)].items() if k != "tokens"}
            best = min(base, key=base.get)
            if loss >= base[best]:
                missed.append(f"seed {seed} {_fmt(loss)} against its {best} {_fmt(base[best])}")
        if missed:
            lines.append(f"{c['name']} ({'; '.join(missed)})")
    return lines


def recorded_overlap(data: dict) -> str:
    """What the dataset itself measured, where it did (the research corpus: over the whole
    training split, which the sweep reads only in part)."""
    recorded = (data.get("dataset_metadata") or {}).get("held_out_overlap")
    if not recorded:
        return ""
    return (" (the dataset's own measure over all of its training text, 64-byte windows: "
            + ", ".join(f"{k} {v:.2%}" for k, v in recorded.items()) + ")")


def markdown(plan: SweepPlan, results: dict) -> str:
    spec = plan.spec
    prov = results["provenance"]
    code = (f"Code {prov['code']['commit'] or 'not a git checkout'}"
            + (" (uncommitted changes)" if prov["code"]["dirty"] else "")
            + (f"; also trained by {len(prov['other_code'])} other code state(s) "
               "(--allow-code-change)" if prov["other_code"] else ""))
    lines = [f"# {spec.title or 'Sweep ' + os.path.basename(spec.path)}", "",
             f"Command: `{results['command']}`", ""]
    if spec.task is not None:
        return "\n".join(lines + task_markdown(plan, results, code)) + "\n"
    lines += [code + f". Data {prov['data']['corpus']} (sha256 {prov['data']['sha256'][:12]}), "
             f"{prov['data']['heldout_tokens']:,} held-out tokens drawn by seed "
             f"{spec.heldout_seed}; {prov['data']['overlap']['share']:.2%} of the held-out "
             f"{prov['data']['overlap']['window_bytes']}-byte windows also occur in training"
              + recorded_overlap(prov["data"]) + f". Seeds {list(spec.seeds)}.", ""]
    done = [c for c in results["cells"] if c["seeds_scored"] == sorted(spec.seeds)]
    lines += [f"{len(done)} of {len(results['cells'])} cells finished.", "", "## Cells", ""]
    chained = any(c.get("from") for c in results["cells"])
    header = ["cell", *(["from"] if chained else []), "steps", "tokens"] + [
        f"{k}@{x.text}" for k, x in spec.scored()]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in results["cells"]:
        by = {(e["kind"], e["length"]): e for e in c["by_length"]}
        cells = []
        for k, x in spec.scored():
            e = by.get((k, x.text))
            cells.append("pending" if not e or not e["per_seed"] else
                         f"{_fmt(e['mean'])} ± {_fmt(e['std'])}")
        start = ""
        if chained:
            start = f"{c['from']} ({'zero-shot' if c['zero_shot'] else 'fine-tune'}) | " \
                if c.get("from") else "| "
        seen = c.get("tokens_seen", c["tokens"])
        tokens = f"{seen:,}" + (f" ({c['tokens']:,} own)" if seen != c["tokens"] else "")
        lines.append(f"| {c['name']} | {start}{c['steps']} | {tokens} | " + " | ".join(cells)
                     + " |")
    notes = ["Mean ± standard deviation over seeds of the held-out loss (nats per token); "
             "loss@L: windows of L tokens side by side"]
    if chained:
        notes.append("a cell with a parent starts from its run of each seed (fine-tune) or "
                     "scores it with its own model options (zero-shot, no training); its "
                     "tokens count its parent's, and its lengths and stride given as multiples "
                     "are of the training length of the first cell of its chain (L0)")
    notes += [note for kind in scored_kinds(spec) for note in kind.notes(spec)]
    lines += ["", "; ".join(notes) + "."]
    own = results.get("seed_baselines")
    if own:
        first = next(iter(next(iter(own.values())).values()))
        names = [k for k in first if k != "tokens"]
        lines += ["", "Each seed's own baselines, fitted on the tokens its run read in "
                  "training (its parent's first), scored on the same held-out tokens:", "",
                  "| cell | seed | tokens read | " + " | ".join(names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        for cell, by_seed in own.items():
            for seed, base in by_seed.items():
                lines.append(f"| {cell} | {seed} | {base['tokens']:,} | " + " | ".join(
                    _fmt(v) for k, v in base.items() if k != "tokens") + " |")
        missed = not_past(results, spec)
        lines += ["", f"**Not past their own strongest n-gram at {spec.lengths[0].text}:** "
                  + "; ".join(missed) + ". A comparison involving them says little about the "
                  "switch: train longer or on more data."] if missed else []
    for budget, every in results["baselines"].items():
        base = {k: v for k, v in every.items() if k != "equal_context"}
        lines += ["", f"Baselines fitted on the first {int(budget):,} tokens of the training "
                  "text in its stored order (a cell's budget, its parents' included; not the "
                  "tokens a seed read, which are shuffled), on the same held-out tokens: "
                  + ", ".join(f"{k} {_fmt(v)}" for k, v in base.items()) + "."]
        for n, same in every.get("equal_context", {}).items():
            lines += ["", f"On the positions loss_k@L scores in windows of {n} tokens: "
                      + ", ".join(f"{k} {_fmt(v)}" for k, v in same.items()) + "."]
        best = min(base, key=base.get)
        short = [c["name"] for c in done if c.get("tokens_seen", c["tokens"]) == int(budget)
                 and c["by_length"] and c["by_length"][0]["mean"] >= base[best]]
        if short and not own:  # (results written before each seed had its own)
            lines += ["", f"**Not past the {best} ({_fmt(base[best])}) at "
                      f"{spec.lengths[0].text}:** {', '.join(short)}. A comparison involving "
                      "them says little about the switch: train longer or on more data."]
    for kind in scored_kinds(spec):
        lines += kind.markdown(plan, results)
    lines += control_markdown(results)
    lines += ["", "## Comparisons", "",
              f"{len(results['comparisons'])} comparison(s), declared before the runs and all "
              "reported, each a paired difference a - b over seeds x held-out chunks of "
              f"{spec.chunk_tokens} tokens (context metrics: over seeds x windows; b = 0: a's "
              "own values, themselves differences, against zero). " + RELATIVE_NOTE * any(
                  p.a_ref is not None for p in plan.pairs) + HOLM_NOTE
              + claim_notes(results["comparisons"]), ""]
    lines += comparison_rows(results)
    for name in results.get("plots", []):
        lines += ["", f"![{name}]({name})"]
    return "\n".join(lines) + "\n"


RELATIVE_NOTE = ("\"X - Y\" as a or b (relative_to): cell X's values minus its reference "
                 "Y's, chunk by chunk, so a - b compares the two changes. ")
HOLM_NOTE = ("The interval is drawn at the level Holm's procedure tests it at (family-wise 95% "
             "over the scored ones); \"inconclusive\" when it holds zero.")


def claim_notes(rows: list[dict]) -> str:
    """What the primary, exploratory and equivalence claims mean, where the spec has them."""
    out = ""
    exploratory = [r["compare"] for r in rows if r.get("primary") is False]
    if exploratory:
        primary = sorted({r["compare"] for r in rows if r.get("primary")})
        out += (f" Holm's family is the primary claims ({', '.join(map(str, primary))}); the "
                f"rest ({', '.join(map(str, sorted(set(exploratory))))}) are exploratory: "
                "each read alone at 95%, unadjusted, not a claim the sweep decides.")
    if any("margin" in r for r in rows):
        out += (" An equivalence claim (margin m) is two one-sided tests in the same family: "
                "its interval is the 1 - 2 alpha one, and it reads \"equivalent within ±m\" "
                "only when that interval lies inside ±m.")
    return out


def control_markdown(results: dict) -> list[str]:
    """The positive controls' table: each bound on each cell, per seed (none: nothing)."""
    rows = results.get("controls") or []
    if not rows:
        return []
    lines = ["", "## Positive controls", "",
             "Declared before the runs: every seed of the cell must reach the bound, else the "
             "comparisons of that score on it, and on the cells started from it, are not read "
             "(their intervals are shown, and stay in Holm's family).", "",
             "| # | claim | cell | bound | per seed | status |", "|---|---|---|---|---|---|"]
    for r in rows:
        seeds = ", ".join(_fmt(v) for v in r.get("per_seed", ()))
        lines.append(f"| {r['control']} | {r['claim']} | {r['cell']} | {r['bound']} | "
                     f"{seeds} | {r['status']} |")
    return lines


def comparison_rows(results: dict) -> list[str]:
    """The comparisons' table."""
    lines = ["| # | claim | a | b | metric | a - b | interval | p (Holm) | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["comparisons"]:
        if r["verdict"] == "pending":
            lines.append(f"| {r['compare']} | {r['claim']} | {r['a']} | {r['b'] or 0} | "
                         f"{r['metric']} | | | | pending |")
            continue
        lines.append(f"| {r['compare']} | {r['claim']} | {r['a']} | {r['b'] or 0} | {r['metric']} "
                     f"| {r['mean']:+.4f} | [{r['low']:+.4f}, {r['high']:+.4f}] "
                     f"({_fmt(100 * r['level'], 2)}%) | {_fmt(r['p_holm'], 4)} | "
                     f"{r['verdict']}" + (f" (cells trained by {len(r['code_states'])} code "
                                          f"states: {', '.join(r['code_states'])})"
                                          if r.get("code_states") else "") + " |")
    return lines


def task_markdown(plan: SweepPlan, results: dict, code: str) -> list[str]:
    """A task sweep's report: exact match by task length, a row per length and a column per
    cell (mean ± sd over seeds), then the comparisons."""
    spec, task = plan.spec, plan.spec.task
    cells = results["cells"]
    done = [c for c in cells if c["seeds_scored"] == sorted(spec.seeds)]
    lines = [code + f". Data {results['provenance']['data']['corpus']}: {task.examples} test "
             f"examples per task length drawn by seed {task.seed}, the same for every cell and "
             f"seed. Seeds {list(spec.seeds)}.", "",
             f"{len(done)} of {len(cells)} cells finished.", "", "## Cells", "",
             "| cell | task | trained on lengths | steps |", "|---|---|---|---|"]
    by_name = {p.cell.name: p for p in plan.cells}
    for c in cells:
        train = by_name[c["name"]].train
        lo, hi = train.train_lengths
        lines.append(f"| {c['name']} | {train.task} | {lo}-{hi} | {c['steps']} |")
    lines += ["", "## Exact match by task length", "",
              "Share of test examples whose answer and eos are all the teacher-forced argmax "
              "(what greedy decoding writes), mean ± standard deviation over seeds.", "",
              "| length | " + " | ".join(c["name"] for c in cells) + " |",
              "|---|" + "---|" * len(cells)]
    for i, n in enumerate(task.lengths):
        entries = []
        for c in cells:
            e = c["by_length"][i]
            entries.append("pending" if not e["per_seed"] else
                           f"{_fmt(e['mean'], 2)} ± {_fmt(e['std'], 2)}")
        lines.append(f"| {n} | " + " | ".join(entries) + " |")
    lines += control_markdown(results)
    lines += ["", "## Comparisons", "",
              f"{len(results['comparisons'])} comparison(s), declared before the runs and all "
              "reported, each a paired difference a - b of exact match over seeds x test "
              "examples (exact@A-B: the examples of every length A to B). " + HOLM_NOTE
              + claim_notes(results["comparisons"]), ""]
    lines += comparison_rows(results)
    for name in results.get("plots", []):
        lines += ["", f"![{name}]({name})"]
    return lines


def plots(plan: SweepPlan, results: dict, out: str) -> list[str]:
    """Each scored kind's figures (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    return [name for kind in scored_kinds(plan.spec)
            for name in kind.plots(plan, results, out, plt)]


def scored_kinds(spec) -> list:
    """The score kinds a seed's scores hold under ``spec``, in the report's order."""
    return [kind for kind in in_order() if kind.in_scores(spec)]


def hparams(results: dict, out: str) -> None:
    """One TensorBoard hparams entry per finished cell (its axis values, its mean losses)."""
    from tensorboardX import SummaryWriter

    for c in results["cells"]:
        rows = [e for e in c["by_length"] if e["per_seed"]]
        if not rows or not c["values"]:
            continue
        folder = os.path.join(out, "hparams", c["name"].replace("/", "_"))
        if os.path.isdir(folder):
            continue  # written when the cell finished; its numbers do not change
        with SummaryWriter(folder) as writer:
            writer.add_hparams(dict(c["values"]),
                               {f"{e['kind']}@{e['length']}": e["mean"] for e in rows},
                               name=".")


def cell_records(plan: SweepPlan, out: str) -> dict[str, dict]:
    """Each cell's ``cell.json`` (its code states, its work), read once for a report."""
    return {p.cell.name: read_json(os.path.join(cell_dir(out, p), CELL_FILE)) or {}
            for p in plan.cells}


def write_report(plan: SweepPlan, out: str, provenance_record: dict, command: str,
                 baseline_losses: dict, own_baselines: dict | None = None) -> dict:
    scored = {p.cell.name: read_scores(plan, p, out) for p in plan.cells}
    records = cell_records(plan, out)
    results = {
        "command": command,
        "provenance": provenance_record,
        "baselines": baseline_losses,
        **({"seed_baselines": own_baselines} if own_baselines else {}),
        # each cell with the work that made it (seeds trained, when, by which code)
        "cells": [{**cell_summary(plan, p, scored[p.cell.name]),
                   "work": records[p.cell.name].get("work", [])} for p in plan.cells],
        "comparisons": compare(plan, scored, {name: record.get("code", [])
                                              for name, record in records.items()}),
        # every seed's scores, unit by unit, for --reanalyse (by position aside: the cells'
        # means are above)
        "scores": {cell: {seed: {k: v for k, v in scores.items() if k != "by_position"}
                          for seed, scores in by_seed.items()}
                   for cell, by_seed in scored.items()},
        "controls": controls(plan, scored),
    }
    gate(plan, results["comparisons"], results["controls"])
    results["plots"] = plots(plan, results, out)
    write_json(os.path.join(out, "results.json"), results)
    tmp = os.path.join(out, f"report.md.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(markdown(plan, results))
    os.replace(tmp, os.path.join(out, "report.md"))
    hparams(results, out)
    return results
