"""The sweep's score kinds (``sweep/scores/``): every registered kind's terms parse and are
checked against the spec by the kind itself, and docs/experiments.md's recipe for a new kind,
followed: its file written as a contributor would, its one line run, a sweep comparing cells
on its metric end to end."""

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
from sweep_runs import TINY_CELLS, clean_checkout, plots_at_the_end

from transformers_jax.sweep import command, scores
from transformers_jax.sweep.scores import SCORE_KINDS, in_order, kind_of, parse_term
from transformers_jax.sweep.spec import SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[1]
TEXT = TINY_CELLS + """
[eval]
lengths = ["1x", "2x"]
sliding = ["2x"]
chunk_tokens = 250
passkey = {lengths = ["1x"], trials = 2, depths = [0.5], digits = 3}

[eval.context]
window = 24
target = 4
distances = [8]
windows = 8

[baselines]
ngram = [2]
"""
# one term of each built-in kind this text scores, and one it does not
TERMS = {"loss": ("loss@2x", "loss@4x"), "sliding": ("sliding@2x", "sliding@1x"),
         "passkey": ("passkey@1x", "passkey@2x"),
         "context": ("context:shuffle@8", "context:shuffle@9")}


def test_the_built_in_kinds_are_registered_in_the_reports_order():
    assert [kind.name for kind in in_order()] == ["loss", "loss_k", "sliding", "passkey",
                                                   "context", "exact"]
    assert set(SCORE_KINDS.names()) == {kind.name for kind in in_order()}


@pytest.mark.parametrize("name", [k for k in SCORE_KINDS.names() if k in TERMS])
def test_each_kind_checks_its_own_terms_against_the_spec(name):
    scored, unscored = TERMS[name]
    pair = '[[compare]]\na = {position = "alibi"}\nb = {position = "rope"}\nmetric = "%s"\n'
    spec = parse_spec(TEXT + pair % scored)
    assert kind_of(parse_term(scored, "x")[0]) is SCORE_KINDS.get(name)
    kind = kind_of(name)
    assert spec.compares[0].metric.better == ("higher" if kind.higher_is_better
                                              or kind.per_window else "lower")
    with pytest.raises(SpecError, match="needs length|not in|do not include"):
        parse_spec(TEXT + pair % unscored)


def test_equal_context_keeps_the_positions_with_k_tokens_of_context():
    from transformers_jax.sweep.scores.equal_context import with_context

    losses_N = np.arange(13, dtype=float)  # windows of 4 from the start: tokens 1-4, 5-8, ...
    kept = with_context(losses_N, 4, 2)
    assert np.isnan(kept[[1, 5, 9]]).all()  # each window's first: one token of context
    assert not np.isnan(kept[[2, 3, 4, 6, 7, 8, 10, 11, 12]]).any()
    assert np.array_equal(with_context(losses_N, 4, 1)[1:], losses_N[1:])
    spec = parse_spec(TEXT.replace("chunk_tokens = 250", "chunk_tokens = 250\nequal_context = true")
                      + "[[compare]]\na = {position = \"alibi\"}\nb = {position = \"rope\"}\n"
                      "metric = \"loss_k@2x\"\n")
    assert spec.tables["equal_context"] == {"k": 1}  # [baselines] ngram = [2]: k = 2 - 1
    assert ("loss_k", "2x") in [(k, x.text) for k, x in spec.scored()]
    assert spec.eval_settings()["equal_context"] == {"k": 1}
    assert "equal_context" not in parse_spec(TEXT).eval_settings()  # old keys kept
    with pytest.raises(SpecError, match="needs \\[eval\\] equal_context"):
        parse_spec(TEXT + "[[compare]]\na = {position = \"alibi\"}\nmetric = \"loss_k@2x - "
                   "loss_k@1x\"\n")
    with pytest.raises(SpecError, match="equal_context = 0: true"):
        parse_spec(TEXT.replace("chunk_tokens = 250", "chunk_tokens = 250\nequal_context = 0"))
    with pytest.raises(SpecError, match="ngram is empty; give k"):
        parse_spec(TEXT.replace("chunk_tokens = 250", "chunk_tokens = 250\nequal_context = true")
                   .replace("ngram = [2]", "ngram = []"))


def test_a_term_of_no_kind_names_every_kind():
    with pytest.raises(SpecError) as err:
        parse_spec(TEXT + '[[compare]]\na = {position = "alibi"}\nb = {position = "rope"}\n'
                   'metric = "perplexity@1x"\n')
    for kind in in_order():
        assert kind.term_help in str(err.value)


def test_the_spec_scores_what_its_kinds_say():
    spec = parse_spec(TEXT)
    assert [(k, x.text) for k, x in spec.scored()] == [
        ("loss", "1x"), ("loss", "2x"), ("sliding", "2x"), ("passkey", "1x")]
    assert spec.eval_settings()["context"]["distances"] == [8]


def recipe_module(tmp_path):
    """The recipe's file, as docs/experiments.md gives it, imported as a module of its own."""
    text = (ROOT / "docs" / "experiments.md").read_text()
    section = text[text.index("### A new score kind"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "top1.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("toy_top1", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_recipe_for_a_new_score_kind_scores_and_compares_cells(tmp_path, monkeypatch):
    module = recipe_module(tmp_path)
    # the recipe's one line, undone after the test (the registry is the process's)
    monkeypatch.setattr(SCORE_KINDS, "_entries", dict(SCORE_KINDS._entries))
    monkeypatch.setattr(scores, "ORDER", list(scores.ORDER))
    scores.add("top1", module.TopOne())

    # one seed, held-out loss and the new kind only: the kind is what is tested; with equal
    # context at k = 1, which keeps every position: loss_k equals loss
    text = TEXT.split("[eval.context]")[0].replace("seeds = 2", "seeds = 1").replace(
        'passkey = {lengths = ["1x"], trials = 2, depths = [0.5], digits = 3}\n',
        "equal_context = 1\n").replace('sliding = ["2x"]\n', "")
    compare = ('[[compare]]\na = {position = "alibi"}\nb = {position = "rope"}\n'
               'metric = "top1@2x"\nclaim = "a toy"\n')
    with pytest.raises(SpecError, match=r"needs length 4x, which \[eval\] lengths"):
        parse_spec(text + "[baselines]\nngram = [2]\n" + compare.replace("2x", "4x"))
    spec = tmp_path / "top1.toml"
    spec.write_text(text + "[baselines]\nngram = [2]\n" + compare)
    assert parse_spec(spec.read_text()).compares[0].metric.better == "higher"

    clean_checkout(monkeypatch, tmp_path)
    plots_at_the_end(monkeypatch)
    out = tmp_path / "out"
    assert command.main([str(spec), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    (row,) = results["comparisons"]
    assert row["metric"] == "top1@2x" and row["verdict"]
    for cell in results["cells"]:
        tops = [e for e in cell["by_length"] if e["kind"] == "top1"]
        assert [e["length"] for e in tops] == ["1x", "2x"]
        assert all(0 <= v <= 1 for e in tops for v in e["per_seed"])
        by = {(e["kind"], e["length"]): e["mean"] for e in cell["by_length"]}
        assert by[("loss_k", "2x")] == pytest.approx(by[("loss", "2x")], rel=1e-12)
    # what the numbers came from: the tokenizer by content, every library touching them
    from transformers_jax.data.tokenizers import ByteTokenizer
    from transformers_jax.study.provenance import tokenizer_digest

    prov = results["provenance"]
    assert prov["data"]["tokenizer_sha256"] == tokenizer_digest(ByteTokenizer())
    assert {"scipy", "sentencepiece", "tensorflow-datasets"} <= set(prov["versions"])
    (budget,) = results["baselines"].values()
    assert set(budget["equal_context"]) == {"32", "64"}  # the cells' lengths in tokens
    assert budget["equal_context"]["64"]["2-gram"] == pytest.approx(budget["2-gram"], rel=0.05)
    seed_scores = json.loads(next((out / "cells").glob("*/seed0/sweep_scores.json")).read_text())
    top = seed_scores["top1"]["2x"]
    assert top["tokens"] == 64 and top["chunks"] and top["mean"] == pytest.approx(
        sum(top["chunks"]) / len(top["chunks"]))
    assert "top1@2x" in (out / "report.md").read_text()
