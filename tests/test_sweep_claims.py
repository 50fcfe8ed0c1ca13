"""Primary, exploratory and equivalence claims: the Holm family is the primary claims alone,
an exploratory one is read alone and labelled, and a "no difference" claim is two one-sided
tests against its margin (its 1 - 2 alpha interval inside the margin). The tests of the
statistics are by hand (t) and by simulation (type I error at the margin)."""

import types

import numpy as np
import pytest
from scipy import stats as scipy_stats

from transformers_jax.study import stats
from transformers_jax.sweep.cells import expand, pairs
from transformers_jax.sweep.report import compare
from transformers_jax.sweep.spec import SpecError, parse_spec

SPEC = """
seeds = 4
[base]
tokens = 1000
[axes]
"model.position" = ["rope", "alibi", "t5"]
[eval]
lengths = ["1x"]
"""
CLAIMS = """
[[compare]]
a = {position = "alibi"}
b = {position = "rope"}
metric = "loss@1x"
primary = true

[[compare]]
a = {position = "t5"}
b = {position = "rope"}
metric = "loss@1x"
margin = 0.05
primary = true

[[compare]]
a = {position = "t5"}
b = {position = "alibi"}
metric = "loss@1x"
primary = false
"""


def test_tost_is_the_larger_one_sided_t_test_when_the_seeds_decide():
    d_S = np.array([0.10, 0.20, 0.15, 0.12])  # one chunk per seed: the t-test decides
    result = stats.paired(d_S[:, None])
    se = d_S.std(ddof=1) / np.sqrt(4)
    by_hand = max(scipy_stats.t.sf((d_S.mean() + 0.5) / se, 3),
                  scipy_stats.t.sf((0.5 - d_S.mean()) / se, 3))
    assert result.p_equivalence(0.5) == pytest.approx(by_hand, rel=1e-9)
    assert by_hand > 1 / (stats.N_BOOT + 1)  # the bootstrap's floor is below it
    # a margin inside the mean: not equivalent, p near 1
    assert result.p_equivalence(0.05) > 0.99


def test_equivalence_reads_the_interval_against_the_margin():
    assert stats.equivalence_verdict(-0.01, 0.02, 0.05) == "equivalent within ±0.05"
    assert stats.equivalence_verdict(-0.01, 0.06, 0.05) == "not shown equivalent within ±0.05"
    assert stats.equivalence_verdict(float("nan"), 0.0, 0.05) == "not scored"


def test_tost_at_the_margin_is_wrong_at_most_alpha_of_the_time():
    """Data whose true mean sits on the margin: the interval (1 - 2 alpha) falls inside it in
    at most alpha of the draws (plus the simulation's error)."""
    rng = np.random.default_rng(0)
    margin, runs = 0.1, 400
    inside = 0
    for _ in range(runs):
        seed_effects = rng.normal(margin, 0.05, size=(5, 1))
        d_SC = seed_effects + rng.normal(0, 0.1, size=(5, 20))
        result = stats.paired(d_SC, n_boot=2000, seed=int(rng.integers(1 << 30)))
        low, high = result.interval(2 * stats.ALPHA)
        inside += -margin < low and high < margin
    assert inside / runs <= stats.ALPHA + 3 * np.sqrt(stats.ALPHA * (1 - stats.ALPHA) / runs)


def test_primary_and_margin_are_checked():
    parse_spec(SPEC + CLAIMS)
    with pytest.raises(SpecError, match="primary = 'yes': true"):
        parse_spec(SPEC + CLAIMS.replace("primary = true", 'primary = "yes"'))
    with pytest.raises(SpecError, match="margin = -0.05: a positive number"):
        parse_spec(SPEC + CLAIMS.replace("margin = 0.05", "margin = -0.05"))
    with pytest.raises(SpecError, match="no claim is primary"):
        parse_spec(SPEC + CLAIMS.replace("primary = true", "primary = false"))
    # unmarked claims beside a primary one are exploratory
    spec = parse_spec(SPEC + CLAIMS.replace("margin = 0.05\nprimary = true", "margin = 0.05"))
    assert [c.primary for c in spec.compares] == [True, None, False]


def scores(effects: dict[str, float], seeds: int, rng) -> dict:
    """Each cell's scores by seed: one loss@1x with 10 chunks around its effect."""
    return {cell: {s: {"loss": {"1x": {"mean": None, "chunks": (
        effect + 0.02 * s + rng.normal(0, 0.01, 10)).tolist()}}} for s in range(seeds)}
        for cell, effect in effects.items()}


def test_the_family_is_the_primary_claims_and_the_rest_are_read_alone():
    spec = parse_spec(SPEC + CLAIMS)
    plan = types.SimpleNamespace(spec=spec, pairs=pairs(spec, expand(spec)))
    assert [p.primary for p in plan.pairs] == [True, True, False]
    rng = np.random.default_rng(1)
    scored = scores({"position=rope": 3.0, "position=alibi": 2.9, "position=t5": 3.01}, 4, rng)
    rows = compare(plan, scored)
    first, equivalence, exploratory = rows
    # a family of two: the smaller p tested at alpha / 2, the other at alpha once it passes;
    # an equivalence claim's interval at 1 - 2 alpha
    assert first["level"] in (pytest.approx(1 - 0.025), pytest.approx(0.95))
    assert equivalence["level"] in (pytest.approx(1 - 0.05), pytest.approx(0.9))
    assert first["verdict"] == "position=alibi better" and first["p_holm"] <= 2 * first["p"]
    assert equivalence["margin"] == 0.05
    assert equivalence["verdict"] == "equivalent within ±0.05"
    assert -0.05 < equivalence["low"] and equivalence["high"] < 0.05
    assert exploratory["p_holm"] is None and exploratory["level"] == pytest.approx(0.95)
    assert exploratory["verdict"].endswith("(exploratory)")
    # unmarked, every claim is in the family (the specs written before primary existed)
    spec = parse_spec(SPEC + CLAIMS.replace("primary = true", "").replace("primary = false", ""))
    assert all(p.primary for p in pairs(spec, expand(spec)))


# ---------------------------------------------------------------------------- power


def test_t_power_gives_the_figures_the_review_simulated():
    """Power at alpha = 0.05/36 (a Holm family of 36): 10% for 5 seed sds with 3 seeds, 90%
    with 5; 90% at 2 sds with 10 seeds (issue 64's simulation)."""
    alpha = 0.05 / 36
    assert stats.t_power(5.0, 1.0, 3, alpha) == pytest.approx(0.10, abs=0.01)
    assert stats.t_power(5.0, 1.0, 5, alpha) == pytest.approx(0.90, abs=0.01)
    assert stats.t_power(2.0, 1.0, 10, alpha) == pytest.approx(0.90, abs=0.01)
    effect = stats.detectable_effect(1.0, 5, 0.05)
    assert stats.t_power(effect, 1.0, 5, 0.05) == pytest.approx(0.8, abs=1e-6)


def test_the_sweeps_test_has_the_power_the_dry_run_predicts():
    """Seeds x chunks with a true effect at the predicted 80% point: the sweep's own test
    (bootstrap and t, the larger p) rejects in about 80% of draws."""
    rng = np.random.default_rng(3)
    seeds, chunks, sd_s, sd_c = 5, 20, 0.03, 0.1
    sd_seed = np.sqrt(sd_s**2 + sd_c**2 / chunks)  # of a seed's mean difference
    effect = stats.detectable_effect(sd_seed, seeds, stats.ALPHA)
    runs = 300
    found = sum(stats.paired(effect + rng.normal(0, sd_s, (seeds, 1))
                             + rng.normal(0, sd_c, (seeds, chunks)), n_boot=1000,
                             seed=k).p_value() <= stats.ALPHA for k in range(runs))
    assert found / runs == pytest.approx(0.8, abs=0.08)


def test_holm_keeps_the_family_wise_error_under_the_null():
    rng = np.random.default_rng(4)
    runs, family = 300, 5
    wrong = 0
    for k in range(runs):
        ps = [stats.paired(rng.normal(0, 0.03, (4, 1)) + rng.normal(0, 0.1, (4, 10)),
                           n_boot=1000, seed=k * family + i).p_value() for i in range(family)]
        wrong += min(stats.holm(ps)[0]) <= stats.ALPHA
    assert wrong / runs <= stats.ALPHA + 3 * np.sqrt(stats.ALPHA * (1 - stats.ALPHA) / runs)


def test_the_design_reads_the_pilots_spread_and_refuses_weak_primary_claims():
    from transformers_jax.sweep import power

    spec = parse_spec(SPEC + CLAIMS.replace("margin = 0.05\n", "effect = 0.02\n")
                      + '[pilot]\nresults = "pilot/results.json"\n')
    assert spec.pilot == "pilot/results.json" and spec.compares[1].effect == 0.02
    plan = types.SimpleNamespace(spec=spec, pairs=pairs(spec, expand(spec)))
    pilot = {"comparisons": [{"a": "position=alibi", "b": "position=rope", "metric": "loss@1x",
                              "per_seed": [0.10, 0.12, 0.08]}],
             "cells": [{"name": name, "by_length": [{"kind": "loss", "length": "1x",
                                                      "per_seed": [3.0, 3.01, 3.02]}]}
                       for name in ("position=rope", "position=t5", "position=alibi")]}
    first, second, third = power.design(plan, pilot)
    assert first["seed_sd"] == pytest.approx(0.02) and first["alpha"] == 0.05 / 2
    assert first["detectable"] == pytest.approx(stats.detectable_effect(0.02, 4, 0.025))
    assert second["source"] == "the pilot's cells, unpaired"  # no comparison of its own
    assert second["seed_sd"] == pytest.approx(np.sqrt(2) * 0.01)
    assert third["alpha"] == 0.05 and not third["primary"]
    lines = power.describe([first, second, third], 4)
    assert "with 4 seeds detects a difference of" in lines[0]
    assert "power at the claim's effect 0.02" in lines[1]
    with pytest.raises(SpecError, match="compare 2 .* --accept-low-power"):
        power.refuse_low_power([first, second, third], 4)
    assert "power unknown" in power.describe(power.design(plan, None), 4)[0]
    with pytest.raises(SpecError, match="effect = 0: a positive number"):
        parse_spec(SPEC + CLAIMS.replace("margin = 0.05\n", "effect = 0\n"))
    with pytest.raises(SpecError, match=r"\[pilot\] results = 3"):
        parse_spec(SPEC + "[pilot]\nresults = 3\n")


def test_auto_seeds_are_the_fewest_that_give_the_primary_claims_their_power(tmp_path):
    from transformers_jax.sweep import power

    text = (SPEC.replace("seeds = 4", 'seeds = "auto"\nmax_seeds = 12')
            + CLAIMS.replace("primary = true\n", "primary = true\neffect = 0.05\n", 1)
            + '[pilot]\nresults = "results.json"\n')
    pilot = {"comparisons": [{"a": "position=alibi", "b": "position=rope", "metric": "loss@1x",
                              "per_seed": [0.10, 0.14, 0.06]}]}  # sd 0.04
    spec = parse_spec(text, str(tmp_path / "spec.toml"))
    chosen = power.resolve_seeds(spec, pilot)
    fewest = next(n for n in range(2, 13)
                  if stats.t_power(0.05, 0.04, n, 0.05 / 2) >= power.POWER)
    assert chosen.seeds == tuple(range(fewest)) and fewest > 2
    # none enough: max_seeds, and the low-power check speaks from there
    assert power.resolve_seeds(spec, {"comparisons": [{**pilot["comparisons"][0],
                                                       "per_seed": [0.0, 1.0, 2.0]}]}
                               ).seeds == tuple(range(12))
    for change, message in [(("max_seeds = 12\n", ""), "give max_seeds"),
                            (('seeds = "auto"\n', ""), "max_seeds bounds seeds"),
                            (('[pilot]\nresults = "results.json"\n', ""), "reads the seed-to-"),
                            (("effect = 0.05\n", ""), "state one")]:
        with pytest.raises(SpecError, match=message):
            parse_spec(text.replace(*change))


def test_the_guides_example_spec_reads_as_it_says():
    """docs/experiments.md's spec: it parses, its first claim primary with an effect, the
    second exploratory with a margin, equal context at the largest n-gram order less one."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "experiments.md").read_text()
    spec = parse_spec(re.search(r"```toml\n(.*?)```", text, re.S).group(1))
    assert [(c.primary, c.margin, c.effect) for c in spec.compares] == [
        (True, None, 0.05), (None, 0.02, None)]
    assert [p.primary for p in pairs(spec, expand(spec))] == [True, True, False]
    assert spec.tables["equal_context"] == {"k": 4} and spec.pilot
