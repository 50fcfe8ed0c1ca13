"""tjax sweep on synthetic tasks ([eval.task]): the spec's errors, and a whole tiny sweep whose
stored exact match per example agrees with greedy decoding, and whose comparisons are the
means of the stored values."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sweep_runs import plots_at_the_end

from transformers_jax.cli import main
from transformers_jax.study import provenance
from transformers_jax.sweep import runner
from transformers_jax.sweep.plan import make_plan
from transformers_jax.sweep.spec import SpecError, parse_spec

TASK = """
title = "tiny parity"
seeds = 2

[base]
args = ["--task", "parity", "--train.train_lengths=1,4", "--model.d_model=16",
  "--model.n_layers=1", "--model.n_heads=2", "--train.seq_len=8", "--train.batch_size=8",
  "--train.learning_rate=1e-2", "--steps=60", "--train.eval_every=1000",
  "--train.checkpoint_every=1000", "--train.log_every=1000", "--train.tensorboard=false"]

[axes]
"model.position" = ["none", "rope"]

[eval.task]
lengths = "1-6"
examples = 5
seed = 3

[[compare]]
a = {position = "none"}
b = {position = "rope"}
metric = "exact@5-6"
claim = "NoPE extrapolates further"

[[compare]]
a = {position = "none"}
metric = "exact@5-6 - exact@3-4"
"""


@pytest.mark.parametrize(
    "change, fragments",
    [
        (("examples = 5", "examples = 0"), ["[eval.task] examples = 0", "positive integer"]),
        (('lengths = "1-6"', 'lengths = "6-1"'), ["'6-1' is an empty range", "LOW-HIGH"]),
        (('lengths = "1-6"', "lengths = [1.5]"), ["give task lengths as a range"]),
        (("seed = 3", "seeds = 3"), ["unknown key 'seeds'", "did you mean 'seed'"]),
        (
            ('metric = "exact@5-6"', 'metric = "exact@5-9"'),
            ["task length 7 is not scored", "[eval.task] lengths (now 1-6)"],
        ),
        (
            ('metric = "exact@5-6"', 'metric = "loss@1x"'),
            ["a task sweep ([eval.task]) scores no held-out text", "exact@N"],
        ),
        (
            ('metric = "exact@5-6"', 'metric = "exact@5-6 - loss@1x"'),
            ["subtracts a loss from an accuracy"],
        ),
        (
            ("seed = 3", "seed = 3\n[heldout]\nbytes = 9"),
            ["[heldout] would do nothing", "drop [eval.task]"],
        ),
        (("[eval.task]\n", "[eval]\nsliding = true\n[eval.task]\n"), ["sliding would do nothing"]),
        (
            ("exact@5-6 - exact@3-4", "exact@5-6 - exact@1-4"),
            ["ranges of as many lengths", "exact@5-6 - exact@1-2"],
        ),
    ],
)
def test_task_spec_errors_name_the_key_and_the_fix(change, fragments):
    with pytest.raises(SpecError) as err:
        parse_spec(TASK.replace(*change))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_exact_metrics_need_a_task_and_cells_need_one(tmp_path):
    text = TASK.replace('"--task", "parity", ', "")
    with pytest.raises(SpecError, match="give --task NAME"):
        make_plan(parse_spec(text), str(tmp_path))
    plain = (
        TASK.split("[eval.task]")[0] + '[[compare]]\na = {position = "none"}\n'
        'b = {position = "rope"}\nmetric = "exact@3"\n'
    )
    with pytest.raises(SpecError, match=r"add an \[eval.task\] table"):
        parse_spec(plain)
    learned = TASK.replace('"rope"]', '"learned"]').replace(
        'b = {position = "rope"}', 'b = {position = "learned"}'
    )
    with pytest.raises(SpecError, match="raise --model.max_len to 9"):
        make_plan(
            parse_spec(
                learned.replace("--train.seq_len=8", '--train.seq_len=8", "--model.max_len=8')
            ),
            str(tmp_path),
        )


@pytest.fixture
def task_env(tmp_path, monkeypatch):
    code = {"commit": "a" * 40, "dirty": False, "source_sha256": "1" * 64}
    monkeypatch.setattr(provenance, "code_state", lambda: dict(code))
    plots_at_the_end(monkeypatch)
    spec = tmp_path / "task.toml"
    spec.write_text(TASK)
    return tmp_path, spec


@pytest.mark.slow
def test_a_task_sweep_dry_run_lists_its_test(task_env, monkeypatch, capsys):
    """A step and a test batch are compiled and timed; the two cells' models, alike in cost,
    as one shape: each compiles once."""
    from transformers_jax.sweep import command

    tmp_path, spec = task_env
    timed = []
    monkeypatch.setattr(command, "_shape_key", lambda model: timed.append(model) or "tiny")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "data synthetic task(s) parity: 5 test examples at each of 6 task lengths" in out
    assert "compare 1: position=none vs position=rope: exact@5-6" in out
    assert {m.position.name for m in timed} == {"none", "rope"}  # both cells estimated


def greedy_right(run, prompt: str, answer: str, steps: int) -> bool:
    """Greedy decoding from ``[bos] prompt [sep]`` writes the answer, then eos (``run``:
    ``load_run``'s answer)."""
    from transformers_jax.sample import SamplingConfig, generate

    model, params, tokenizer, _ = run
    ids = [tokenizer.bos_id, *tokenizer.encode(prompt), tokenizer.sep_id]
    (new,) = generate(
        model,
        params,
        [ids],
        SamplingConfig(max_new_tokens=steps, temperature=0.0, stop_tokens=(tokenizer.eos_id,)),
    )
    return new == [*tokenizer.encode(answer), tokenizer.eos_id]


@pytest.mark.slow
def test_a_task_sweep_scores_exact_match_example_by_example(task_env):
    from transformers_jax.data.synthetic import TaskSource
    from transformers_jax.runs.load import load_run

    tmp_path, spec = task_env
    out = tmp_path / "out"
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    scores = {
        (c, s): json.loads(
            (out / "cells" / f"position={c}" / f"seed{s}" / runner.SCORES_FILE).read_text()
        )["exact"]
        for c in ("none", "rope")
        for s in (0, 1)
    }
    assert sorted(scores["none", 0], key=int) == [str(n) for n in range(1, 7)]

    # the stored values against greedy decoding of the same test examples (some right, some
    # wrong: a parity bit is a guess this early)
    values = [x for table in scores.values() for e in table.values() for x in e["chunks"]]
    assert set(values) == {0.0, 1.0}
    for cell, n in (("none", 2), ("rope", 5)):
        run = load_run(str(out / f"cells/position={cell}/seed0"))  # once per run
        source = TaskSource("parity", "test", lengths=(n, n), num_examples=5, seed=3)
        stored = scores[cell, 0][str(n)]["chunks"]
        assert len(stored) == 5
        for i in range(5):
            ex = source[i]
            assert stored[i] == float(greedy_right(run, ex["prompt"], ex["answer"], 3))

    # comparisons: the mean over seeds x examples of the stored values
    def exact(cell, seed, lo, hi):
        return np.concatenate([scores[cell, seed][str(n)]["chunks"] for n in range(lo, hi + 1)])

    one, two = results["comparisons"]
    assert one["metric"] == "exact@5-6" and one["better"] == "higher"
    assert one["chunks"] == 10
    assert one["mean"] == pytest.approx(
        np.mean([exact("none", s, 5, 6) - exact("rope", s, 5, 6) for s in (0, 1)])
    )
    assert one["per_seed"] == pytest.approx(
        [np.mean(exact("none", s, 5, 6) - exact("rope", s, 5, 6)) for s in (0, 1)]
    )
    assert two["b"] is None and two["mean"] != 0  # a value the test can get wrong
    assert two["mean"] == pytest.approx(
        np.mean([np.mean(exact("none", s, 5, 6)) - np.mean(exact("none", s, 3, 4)) for s in (0, 1)])
    )

    # the report: exact match by length, mean ± sd over seeds, and the plot
    report = (out / "report.md").read_text()
    assert "## Exact match by task length" in report and "NoPE extrapolates further" in report
    cell = next(c for c in results["cells"] if c["name"] == "position=rope")
    means = [np.mean([scores["rope", s][str(n)]["mean"] for s in (0, 1)]) for n in range(1, 7)]
    assert [e["mean"] for e in cell["by_length"]] == pytest.approx(means)
    assert (out / "exact_by_length.png").exists()


def test_the_committed_spec_plans_every_scheme_on_both_tasks(tmp_path):
    from pathlib import Path

    from transformers_jax.sweep.spec import read_spec

    path = Path(__file__).resolve().parents[1] / "experiments/specs/synthetic_generalisation.toml"
    plan = make_plan(read_spec(str(path)), str(tmp_path))
    assert len(plan.cells) == 20 and len(plan.pairs) == 12
    assert {c.train.task for c in plan.cells} == {"copy", "reverse"}
    assert {(c.train.seq_len, c.model.max_len, c.train.train_lengths) for c in plan.cells} == {
        (42, 84, (1, 20))
    }
    t5 = next(c.model.position for c in plan.cells if c.cell.values["position"] == "t5")
    assert (t5.num_buckets, t5.max_distance) == (32, 42)
