"""A comparison ``relative_to`` an axis value: each cell's metric minus its sibling's with that
value (same on every other axis), chunk by chunk; and a task sweep of a prefix-LM and an
encoder-decoder beside a causal decoder."""

from __future__ import annotations

import functools
import types

import jax
import numpy as np
import pytest
from sweep_runs import TINY_BASE, plots_at_the_end

from transformers_jax.sweep.cells import expand, pairs
from transformers_jax.sweep.report import compare
from transformers_jax.sweep.spec import SpecError, parse_spec

LR = """
title = "lr"
seeds = 2

""" + TINY_BASE + """
[axes]
"model.qk_norm" = [false, true]
"train.learning_rate" = [1e-3, 1e-1]

[[compare]]
a = {qk_norm = "true"}
b = {qk_norm = "false"}
metric = "loss@1x"
relative_to = {learning_rate = "0.001"}

[[compare]]
a = {qk_norm = "false", learning_rate = "0.1"}
metric = "loss@1x"
relative_to = {learning_rate = "0.001"}
"""


def test_relative_to_pairs_each_cell_with_its_sibling_and_skips_the_references():
    spec = parse_spec(LR)
    found = [(p.index, p.a.name, p.a_ref.name, p.b and p.b.name, p.b_ref and p.b_ref.name)
             for p in pairs(spec, expand(spec))]
    # the cells at 0.001 are the references: compared with themselves they would be zero
    assert found == [
        (1, "qk_norm=true,learning_rate=0.1", "qk_norm=true,learning_rate=0.001",
         "qk_norm=false,learning_rate=0.1", "qk_norm=false,learning_rate=0.001"),
        (2, "qk_norm=false,learning_rate=0.1", "qk_norm=false,learning_rate=0.001", None, None)]


def _scores(chunks_by_seed):
    return {s: {"loss": {"1x": {"mean": float(np.mean(c)), "chunks": list(c)}}}
            for s, c in enumerate(chunks_by_seed)}


def test_relative_to_compares_the_changes_chunk_by_chunk():
    spec = parse_spec(LR)
    plan = types.SimpleNamespace(spec=spec, pairs=pairs(spec, expand(spec)))
    scored = {  # two seeds x three chunks each
        "qk_norm=false,learning_rate=0.001": _scores([[3.0, 3.2, 3.1], [3.0, 3.1, 3.3]]),
        "qk_norm=false,learning_rate=0.1": _scores([[4.0, 4.5, 4.1], [4.2, 4.4, 4.6]]),
        "qk_norm=true,learning_rate=0.001": _scores([[3.1, 3.1, 3.0], [2.9, 3.2, 3.2]]),
        "qk_norm=true,learning_rate=0.1": _scores([[3.3, 3.2, 3.2], [3.0, 3.4, 3.3]]),
    }
    one, two = compare(plan, scored)
    # qk_norm's cost of the high rate (+0.1167 mean) minus the plain block's (+1.15)
    assert one["mean"] == pytest.approx(
        np.mean([0.2, 0.1, 0.2, 0.1, 0.2, 0.1]) - np.mean([1.0, 1.3, 1.0, 1.2, 1.3, 1.3]))
    assert one["mean"] == pytest.approx(-1.0333333)
    assert one["per_seed"] == pytest.approx([0.5 / 3 - 3.3 / 3, 0.4 / 3 - 3.8 / 3])
    assert one["a"] == "qk_norm=true,learning_rate=0.1 - qk_norm=true,learning_rate=0.001"
    assert one["low"] < one["mean"] < one["high"] and one["verdict"] != "pending"
    # the plain block against its own converged loss, alone: above zero
    assert two["b"] is None and two["mean"] == pytest.approx(7.1 / 6)
    assert two["low"] < two["mean"] < two["high"] and two["verdict"] != "pending"
    # a reference cell unscored: pending, not a comparison against nothing
    del scored["qk_norm=true,learning_rate=0.001"]
    assert compare(plan, scored)[0]["verdict"] == "pending"


@pytest.mark.parametrize("change, fragments", [
    (('relative_to = {learning_rate = "0.001"}\n\n[[compare]]',
      'relative_to = {learning_rate = "0.001", qk_norm = "false"}\n\n[[compare]]'),
     ["relative_to: one axis and its value"]),
    (('a = {qk_norm = "true"}\nb = {qk_norm = "false"}',
      'against = {qk_norm = "false"}'), ["relative_to goes with a and b"]),
    (('learning_rate = "0.1"}\nmetric', 'learning_rate = "0.001"}\nmetric'),
     ["selects only the cells relative_to names"]),
    (('relative_to = {learning_rate = "0.001"}\n"""', 'relative_to = {learning_rate = "0.01"}'),
     ["learning_rate = '0.01' is not one of the axis's values", "0.001, 0.1"]),
])
def test_relative_to_errors_name_the_problem_and_the_fix(change, fragments):
    text = LR.replace(*change) if change[0] != 'relative_to = {learning_rate = "0.001"}\n"""' \
        else LR.rstrip().rsplit("\n", 1)[0] + '\nrelative_to = {learning_rate = "0.01"}\n'
    with pytest.raises(SpecError) as err:
        spec = parse_spec(text)
        pairs(spec, expand(spec))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_relative_to_needs_cells_of_the_axes():
    text = LR.split("[axes]")[0] + """
[[cell]]
name = "low"
[[cell]]
name = "high"
"train.learning_rate" = 0.1
[[compare]]
a = "high"
metric = "loss@1x"
relative_to = {learning_rate = "0.001"}
"""
    with pytest.raises(SpecError, match=r"'high' is a \[\[cell\]\] listed by hand"):
        spec = parse_spec(text)
        pairs(spec, expand(spec))


FAMILIES_TASK = """
title = "tiny parity, three ways"
seeds = 1

[base]
args = ["--train.task=parity", "--train.train_lengths=1,4", "--train.test_lengths=1,4",
  "--model.d_model=16", "--model.n_layers=1", "--model.n_heads=2", "--train.batch_size=8",
  "--train.learning_rate=1e-2", "--steps=60", "--train.eval_every=1000",
  "--train.checkpoint_every=1000", "--train.log_every=1000", "--train.tensorboard=false"]

[[cell]]
name = "causal"
"train.seq_len" = 8

[[cell]]
name = "prefix"
"model.mask" = "prefix"
"train.seq_len" = 8

[[cell]]
name = "encdec"
"model.family" = "encdec"
"train.seq_len" = 5

[eval.task]
lengths = "1-4"
examples = 8
seed = 1

[[compare]]
a = "prefix"
b = "causal"
metric = "exact@1-4"
"""


@functools.partial(jax.jit, static_argnums=0)
def _argmax(model, params, inputs, extra):
    """The model applied by hand, traced once per model and shape (params an argument)."""
    return jax.numpy.argmax(model.apply({"params": params}, inputs, **extra), -1)


@pytest.mark.slow
def test_a_task_sweep_scores_a_prefix_lm_and_an_encoder_decoder(tmp_path, monkeypatch):
    import json

    from transformers_jax.cli import main
    from transformers_jax.runs.load import load_run
    from transformers_jax.study import provenance
    from transformers_jax.sweep import runner
    from transformers_jax.sweep.tasks import row_tokens, test_batch

    code = {"commit": "a" * 40, "dirty": False, "source_sha256": "1" * 64}
    monkeypatch.setattr(provenance, "code_state", lambda: dict(code))
    plots_at_the_end(monkeypatch)
    spec = tmp_path / "task.toml"
    spec.write_text(FAMILIES_TASK)
    out = tmp_path / "out"
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    stored = {c: json.loads((out / "cells" / c / "seed0" / runner.SCORES_FILE).read_text())
              ["exact"] for c in ("causal", "prefix", "encdec")}
    for cell, keys in (("prefix", ("prefix_len",)), ("encdec", ("encoder_inputs",))):
        model, params, tokenizer, cfg = load_run(str(out / "cells" / cell / "seed0"))
        for n in (2, 4):
            batch = test_batch("parity", cfg.family, tokenizer, n,
                               row_tokens("parity", cfg.family, 4), 8, 1, cell == "prefix")
            if cell == "prefix":  # [bos] n bits [sep]: the prompt the mask shows both ways
                assert batch["prefix_len"].tolist() == [n + 2] * 8
            # the model applied by hand with the inputs its mask or encoder reads
            ids = np.asarray(_argmax(model, params, batch["inputs"],
                                     {k: batch[k] for k in keys}))
            w = batch["weights"] > 0
            right = [float((ids[i][w[i]] == batch["targets"][i][w[i]]).all()) for i in range(8)]
            assert stored[cell][str(n)]["chunks"] == right
    values = [x for table in stored.values() for e in table.values() for x in e["chunks"]]
    assert set(values) == {0.0, 1.0}  # some right, some wrong: numbers a bug would change
    (row,) = json.loads((out / "results.json").read_text())["comparisons"]
    mean = {c: np.mean([x for e in stored[c].values() for x in e["chunks"]])
            for c in ("prefix", "causal")}
    assert row["mean"] == pytest.approx(mean["prefix"] - mean["causal"])


@pytest.mark.slow
def test_a_sweep_of_variant_stages_reports_each_cost_against_its_own_rate(tmp_path,
                                                                         monkeypatch):
    """Variants as [[stage]] tables trained from scratch, a learning-rate axis, and
    comparisons relative_to the low rate: the report's numbers are the stored chunks'."""
    import json

    from sweep_runs import clean_checkout

    from transformers_jax.cli import main
    from transformers_jax.sweep import runner

    clean_checkout(monkeypatch, tmp_path)
    plots_at_the_end(monkeypatch)
    text = ("title = \"stages\"\nseeds = 2\n\n" + TINY_BASE + """
[axes]
"train.learning_rate" = [1e-3, 3e-1]
[[stage]]
name = "baseline"
[[stage]]
name = "qk_norm"
"model.qk_norm" = true
[heldout]
bytes = 4000
[eval]
lengths = ["1x"]
chunk_tokens = 250
[baselines]
ngram = [2]
[[compare]]
a = {stage = "qk_norm"}
b = {stage = "baseline"}
metric = "loss@1x"
relative_to = {learning_rate = "0.001"}
""")
    spec = tmp_path / "stages.toml"
    spec.write_text(text)
    out = tmp_path / "out"
    assert main(["sweep", str(spec), "--out", str(out)]) == 0

    def chunks(stage, lr, seed):
        path = out / "cells" / f"stage={stage},learning_rate={lr}" / f"seed{seed}"
        scores = json.loads((path / runner.SCORES_FILE).read_text())
        return np.array(scores["loss"]["1x"]["chunks"])

    d = [(chunks("qk_norm", 0.3, s) - chunks("qk_norm", 0.001, s))
         - (chunks("baseline", 0.3, s) - chunks("baseline", 0.001, s)) for s in (0, 1)]
    (row,) = json.loads((out / "results.json").read_text())["comparisons"]
    assert row["mean"] == pytest.approx(np.mean(d)) and row["mean"] != 0
    assert row["per_seed"] == pytest.approx([x.mean() for x in d])
    report = (out / "report.md").read_text()
    assert ("| stage=qk_norm,learning_rate=0.3 - stage=qk_norm,learning_rate=0.001 | "
            "stage=baseline,learning_rate=0.3 - stage=baseline,learning_rate=0.001 |") in report
    assert "(relative_to): cell X's values minus its reference" in report
