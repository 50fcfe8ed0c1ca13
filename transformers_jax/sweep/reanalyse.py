"""``tjax sweep SPEC --out OUT --reanalyse``: the report rebuilt from what ``OUT/results.json``
stores (every seed's scores, chunk by chunk), with today's statistics and the spec's claims as
they are now: no training, no scoring, no corpus. The cells must be the ones that were run;
the claims (``[[compare]]``, ``[[control]]``: primary, margins, effects) may be re-declared,
which is how a study's claims are corrected after the fact, in a commit the report names.

The figures of each cell (its means by length, its context usage) are kept as stored: they do
not depend on the statistics. The comparisons, the controls and their gating are computed
again, and report.md written again; the plots are kept."""

from __future__ import annotations

import dataclasses
import json
import os

from transformers_jax.sweep.cells import controlled, expand, pairs
from transformers_jax.sweep.report import compare, controls, gate, markdown
from transformers_jax.sweep.runner import write_json
from transformers_jax.sweep.spec import Spec, SpecError


@dataclasses.dataclass(frozen=True)
class _Cell:
    """What the report reads of a planned cell when nothing is trained or scored."""

    cell: object  # cells.Cell
    train: object  # config.TrainConfig (a task sweep's report reads its task and lengths)


@dataclasses.dataclass(frozen=True)
class StoredPlan:
    """The plan of a sweep already run, from its spec alone: its cells, comparisons and
    controls, and the context windows' size as the results stored it."""

    spec: Spec
    cells: list
    pairs: list
    controls: list
    context: object | None


def stored_plan(spec: Spec, results: dict) -> StoredPlan:
    from types import SimpleNamespace

    from transformers_jax.train_options import build_configs

    cells = expand(spec)
    stored = [c["name"] for c in results["cells"]]
    if [c.name for c in cells] != stored:
        raise SpecError(f"{spec.path}: its cells ({[c.name for c in cells]}) are not the ones "
                        f"the sweep ran ({stored}); --reanalyse re-reads the claims, not the "
                        "design: give the spec the sweep ran, its claims changed as needed")
    window = next((c["context"]["window"] for c in results["cells"] if c.get("context")), None)
    return StoredPlan(spec, [_Cell(c, build_configs(list(c.args))[1]) for c in cells],
                      pairs(spec, cells), controlled(spec, cells),
                      None if window is None else SimpleNamespace(window=window))


def reanalyse(spec: Spec, out: str, command: str) -> dict:
    path = os.path.join(out, "results.json")
    try:
        with open(path) as f:
            results = json.load(f)
    except FileNotFoundError:
        raise SpecError(f"{path}: no results to reanalyse (run the sweep first)") from None
    if "scores" not in results:
        raise SpecError(f"{path} stores no per-chunk scores (written before they were kept): "
                        "run the sweep again with its --out, which rescores from the runs "
                        "without training them")
    plan = stored_plan(spec, results)
    scored = {cell: {int(seed): scores for seed, scores in by_seed.items()}
              for cell, by_seed in results["scores"].items()}
    codes = {(r["a"], r["b"]): r["code_states"] for r in results.get("comparisons", [])
             if r.get("code_states")}
    rows = compare(plan, scored)
    for row in rows:  # the code states the run found, kept
        if (row["a"], row["b"]) in codes:
            row["code_states"] = codes[row["a"], row["b"]]
    results = {**results, "command": command, "comparisons": rows,
               "controls": controls(plan, scored),
               "reanalysed": {"spec": spec.text, "spec_file": spec.path}}
    gate(plan, results["comparisons"], results["controls"])
    write_json(path, results)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(plan, results))
    return results
