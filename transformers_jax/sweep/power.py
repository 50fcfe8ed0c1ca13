"""What a sweep's design can detect, before the compute: for each declared comparison, the
smallest true difference its test finds with 80% probability, given the seeds, the level
Holm's family gives it, and how much that difference varies from seed to seed in a pilot
(``[pilot] results``: a previous sweep's ``results.json``, the same cells or some of them).

The seed-to-seed spread is the pilot's own for the same comparison (the standard deviation of
its per-seed differences); else, for a metric of one term, that of the two cells' per-seed
values combined as if unpaired (an overestimate where seeds pair); else unknown. The level is
alpha over the number of primary claims for a primary one (Holm's first step, its strictest)
and alpha for an exploratory one. The power is the t-test's over the seed means
(``stats.t_power``), which decides with a few seeds."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from transformers_jax.study import stats
from transformers_jax.sweep.terms import SpecError

POWER = 0.8


def read_pilot(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise SpecError(f"[pilot] results = {path!r}: no such file; give a previous sweep's "
                        "results.json (OUT/results.json)") from None
    except json.JSONDecodeError as err:
        raise SpecError(f"[pilot] results = {path!r}: not a sweep's results.json ({err})") \
            from None


def seed_spread(pilot: dict, pair) -> tuple[float, str]:
    """The pilot's seed-to-seed standard deviation of ``pair``'s difference, and where it
    came from (NaN, "" when the pilot cannot say)."""
    for row in pilot.get("comparisons", []):
        if (row.get("a"), row.get("b"), row.get("metric")) == (pair.a_text, pair.b_text,
                                                              pair.metric.text):
            values = row.get("per_seed") or []
            if len(values) >= 2:
                return float(np.std(values, ddof=1)), "the pilot's same comparison"
    if len(pair.metric.terms) != 1 or pair.a_ref is not None:
        return math.nan, ""
    kind, length = pair.metric.terms[0]
    cells = {c["name"]: c for c in pilot.get("cells", [])}
    variances = []
    for cell in (pair.a, pair.b):
        if cell is None:
            continue
        rows = [e for e in cells.get(cell.name, {}).get("by_length", [])
                if (e["kind"], e["length"]) == (kind, length.text) and len(e["per_seed"]) >= 2]
        if not rows:
            return math.nan, ""
        variances.append(float(np.var(rows[0]["per_seed"], ddof=1)))
    return math.sqrt(sum(variances)), "the pilot's cells, unpaired"


def design(plan, pilot: dict | None, detectable: bool = True) -> list[dict]:
    """For each pair: its level, the pilot's spread, the effect detectable at 80% power with
    the spec's seeds (unless not ``detectable``: the search takes a moment), and its power at
    the claim's ``effect`` (when it states one)."""
    seeds = len(plan.spec.seeds)
    family = sum(p.primary for p in plan.pairs) or 1
    effects = {c.index: c.effect for c in plan.spec.compares}
    out = []
    for pair in plan.pairs:
        alpha = stats.ALPHA / family if pair.primary else stats.ALPHA
        sd, source = seed_spread(pilot, pair) if pilot is not None else (math.nan, "")
        effect = effects.get(pair.index)
        out.append({"compare": pair.index, "title": pair.title, "primary": pair.primary,
                    "alpha": alpha, "seed_sd": sd, "source": source,
                    "detectable": stats.detectable_effect(sd, seeds, alpha, POWER)
                    if detectable and sd == sd and sd > 0 else math.nan,
                    "effect": effect,
                    "power": stats.t_power(effect, sd, seeds, alpha)
                    if effect is not None and sd == sd and sd > 0 else math.nan})
    return out


def describe(rows: list[dict], seeds: int) -> list[str]:
    """The dry run's lines."""
    lines = []
    for r in rows:
        where = f"compare {r['compare']} ({'primary' if r['primary'] else 'exploratory'}, " \
                f"alpha {r['alpha']:.2g})"
        if math.isnan(r["seed_sd"]):
            lines.append(f"{where}: power unknown (no pilot spread for it: give [pilot] "
                         "results, a previous sweep's results.json)")
            continue
        text = (f"{where}: with {seeds} seeds detects a difference of "
                f"{r['detectable']:.4g} at {POWER:.0%} power (seed sd {r['seed_sd']:.4g}, "
                f"{r['source']})")
        if r["effect"] is not None:
            text += f"; power at the claim's effect {r['effect']:g}: {r['power']:.0%}"
        lines.append(text)
    return lines


def low_power(rows: list[dict]) -> list[dict]:
    """The primary claims whose power at their stated effect is below one half."""
    return [r for r in rows if r["primary"] and r["effect"] is not None
            and r["power"] == r["power"] and r["power"] < 0.5]


def refuse_low_power(rows: list[dict], seeds: int) -> None:
    """``SpecError`` naming the primary claims the design cannot decide, and the fixes."""
    weak = low_power(rows)
    if weak:
        listed = ", ".join(f"compare {r['compare']} ({r['power']:.0%} at {r['effect']:g})"
                           for r in weak)
        raise SpecError(f"with {seeds} seeds the primary claims {listed} would more likely "
                        "be missed than found (power under 50% at their stated effect, from "
                        "the [pilot]); add seeds (--dry-run shows the detectable effects), "
                        "mark fewer claims primary, or pass --accept-low-power (recorded)")


def resolve_seeds(spec, pilot: dict):
    """``spec`` with the seeds of ``seeds = "auto"`` chosen: the fewest, up to ``max_seeds``,
    that give every primary claim stating an effect 80% power at it (``max_seeds`` when none
    does: the low-power check then says so). A spec with its own seeds is returned as it is."""
    from transformers_jax.sweep.cells import expand, pairs

    if spec.max_seeds is None:
        return spec
    found = pairs(spec, expand(spec))
    for n in range(2, spec.max_seeds + 1):
        trial = dataclasses.replace(spec, seeds=tuple(range(n)))
        rows = design(_Plan(trial, found), pilot, detectable=False)
        if all(r["power"] >= POWER for r in rows if r["primary"] and r["effect"] is not None):
            return trial
    return dataclasses.replace(spec, seeds=tuple(range(spec.max_seeds)))


@dataclasses.dataclass(frozen=True)
class _Plan:  # what ``design`` reads of a plan
    spec: object
    pairs: list


def pilot_path(spec) -> str | None:
    """The spec's ``[pilot] results``, relative to the spec's folder."""
    if spec.pilot is None:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(spec.path)), spec.pilot)
