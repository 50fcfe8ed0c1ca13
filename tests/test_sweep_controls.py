"""Positive controls (``[[control]]``): a bound every seed of a cell must reach before the
comparisons of that kind of score on it, and on the cells started from it, are read."""

from __future__ import annotations

import types

import numpy as np
import pytest
from sweep_runs import TINY_BASE

from transformers_jax.sweep.cells import controlled, expand, pairs
from transformers_jax.sweep.report import compare, control_markdown, controls, gate
from transformers_jax.sweep.spec import SpecError, parse_spec

PASSKEY = """
title = "passkey"
seeds = 3

""" + TINY_BASE + """
[[cell]]
name = "base"

[axes]
"model.position.scaling" = ["none", {name = "linear", factor = 4, original_max_len = "1x"}]

[[stage]]
name = "tuned"
from = "base"
tokens = 512
"train.seq_len" = "4x"

[eval]
lengths = ["1x", "4x"]
passkey = {lengths = ["1x", "4x"], trials = 2}

[[compare]]
a = {stage = "tuned", scaling = "linear"}
b = {stage = "tuned", scaling = "none"}
metric = "passkey@4x"

[[compare]]
a = {stage = "tuned", scaling = "linear"}
b = {stage = "tuned", scaling = "none"}
metric = "loss@4x"

[[control]]
cells = "base"
metric = "passkey@1x"
at_least = 0.9
claim = "retrieves within the training length"
"""

LINEAR, NONE = "stage=tuned,scaling=linear", "stage=tuned,scaling=none"


def _seed(passkey_1x: float, passkey_4x: list[float], loss_4x: list[float]) -> dict:
    return {"passkey": {"1x": {"mean": passkey_1x, "chunks": [passkey_1x]},
                        "4x": {"mean": float(np.mean(passkey_4x)), "chunks": passkey_4x}},
            "loss": {"4x": {"mean": float(np.mean(loss_4x)), "chunks": loss_4x}}}


def _plan(spec):
    cells = expand(spec)
    return types.SimpleNamespace(spec=spec, pairs=pairs(spec, cells),
                                 controls=controlled(spec, cells),
                                 cells=[types.SimpleNamespace(cell=c) for c in cells])


def _scored(base_1x: list[float]) -> dict:
    return {
        "base": {s: _seed(v, [0.0, 0.0], [3.0, 3.0]) for s, v in enumerate(base_1x)},
        LINEAR: {s: _seed(1.0, [1.0, 0.5 + 0.25 * s], [3.0, 3.1 + 0.1 * s]) for s in range(3)},
        NONE: {s: _seed(1.0, [0.0, 0.25 * s], [3.5, 3.4 + 0.2 * s]) for s in range(3)},
    }


def test_a_failed_control_stops_the_comparisons_of_its_score_on_the_cells_started_from_it():
    plan = _plan(parse_spec(PASSKEY))
    scored = _scored([1.0, 0.95, 0.85])  # seed 2 below 0.9: failed, though the mean is 0.93
    rows, found = compare(plan, scored), controls(plan, scored)
    assert [(r["cell"], r["status"]) for r in found] == [("base", "failed")]
    assert found[0]["per_seed"] == [1.0, 0.95, 0.85] and found[0]["bound"] == "passkey@1x >= 0.9"
    read = [r["verdict"] for r in rows]
    gate(plan, rows, found)
    passkey, loss = rows
    # the children's passkey comparison is not read; its numbers stay, and what it would say
    assert passkey["verdict"] == "not read: control 1 failed in base"
    assert passkey["read_as"] == read[0] and passkey["mean"] == pytest.approx(
        np.mean([1.0 - 0.0, 0.5 - 0.0, 1.0 - 0.0, 0.75 - 0.25, 1.0, 1.0 - 0.5]))
    assert loss["verdict"] == read[1] != "pending"  # a loss is no passkey score: read
    assert "| 1 | retrieves within the training length | base | passkey@1x >= 0.9 | " \
           "1.000, 0.950, 0.850 | failed |" in "\n".join(control_markdown({"controls": found}))


def test_a_passed_control_leaves_every_verdict_and_a_pending_one_holds_them():
    plan = _plan(parse_spec(PASSKEY))
    scored = _scored([1.0, 0.95, 0.9])  # the bound itself passes
    rows, found = compare(plan, scored), controls(plan, scored)
    before = [r["verdict"] for r in rows]
    gate(plan, rows, found)
    assert found[0]["status"] == "passed" and [r["verdict"] for r in rows] == before
    del scored["base"][2]  # a seed of the control's cell unscored
    rows, found = compare(plan, scored), controls(plan, scored)
    gate(plan, rows, found)
    assert found[0]["status"] == "pending"
    assert rows[0]["verdict"] == "not read: control 1 pending in base"


def test_a_control_on_every_cell_and_at_most_a_loss():
    spec = parse_spec(PASSKEY.replace('cells = "base"\n', "").replace(
        'metric = "passkey@1x"\nat_least = 0.9', 'metric = "loss@4x"\nat_most = 3.2'))
    plan = _plan(spec)
    found = controls(plan, _scored([1.0, 1.0, 1.0]))
    assert [(r["cell"], r["status"]) for r in found] == [
        ("base", "passed"), (NONE, "failed"), (LINEAR, "passed")]  # 3.45-3.65; 3.05-3.15


@pytest.mark.parametrize("change, fragment", [
    (("at_least = 0.9", "at_least = 0.9\nat_most = 1.0"), "give one bound"),
    (("at_least = 0.9", ""), "give one bound"),
    (("at_least = 0.9", 'at_least = "high"'), "at_least = 'high': a number"),
    (('metric = "passkey@1x"', 'metric = "passkey@2x"'),
     "needs length 2x, which [eval] passkey lengths"),
    (('metric = "passkey@1x"', 'metric = "loss@4x - loss@1x"'), "is a difference"),
    (('metric = "passkey@1x"\n', ""), "give the metric every seed must reach"),
    (("claim = \"retrieves", "threshold = 1\nclaim = \"retrieves"), "unknown key 'threshold'"),
    (('passkey = {lengths = ["1x", "4x"], trials = 2}', ""), "needs passkey retrieval"),
])
def test_control_errors_name_the_problem_and_the_fix(change, fragment):
    with pytest.raises(SpecError, match=None) as err:
        parse_spec(PASSKEY.replace(*change))
    assert fragment in str(err.value)


def test_a_control_that_selects_no_cell_is_an_error():
    spec = parse_spec(PASSKEY.replace('cells = "base"', 'cells = "bse"'))
    with pytest.raises(SpecError, match="no cell is named 'bse'"):
        controlled(spec, expand(spec))
