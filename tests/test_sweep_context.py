"""Context usage as a sweep evaluation: the perturbations (only the far context changes, each
as it says), windows drawn alike for every cell and seed, the spec's keys and metrics, and a
tiny sweep of a GPT and an LSTM scored and compared on the same perturbed windows."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from sweep_runs import TINY_BASE, clean_checkout, plots_at_the_end

from transformers_jax.sweep.context import (
    PERTURBATIONS,
    Far,
    Sources,
    draw_windows,
    perturb,
    rng_for,
)

EOS = 1
VOCAB = 50


def _sources(n_docs: int = 6, doc_len: int = 40) -> Sources:
    """Held-out documents of random ids 10-49, each ended by eos, and training tokens that
    use only the ids 2-5 (3 twice as often as the others)."""
    rng = np.random.default_rng(0)
    docs = [np.r_[rng.integers(10, VOCAB, doc_len - 1), EOS] for _ in range(n_docs)]
    heldout_N = np.concatenate(docs).astype(np.int32)
    train_N = np.array([2, 3, 3, 4, 5] * 100, np.int32)
    return Sources.of(train_N, heldout_N, EOS, VOCAB)


def _window(n: int = 41) -> np.ndarray:
    return np.arange(100, 100 + n, dtype=np.int32)


@pytest.mark.parametrize("name", PERTURBATIONS.names())
def test_only_the_far_context_changes_and_the_same_seed_draws_the_same(name):
    sources = _sources()
    w_T = _window()
    first, b = 36, 10  # the targets are w_T[36:], the near context w_T[26:36]
    where = Far(80, 80 + len(w_T), sources, span=4)
    out = perturb(name, w_T, first, b, rng_for(0, name, b), where)
    cut = first - b
    keep = len(w_T) - cut
    np.testing.assert_array_equal(out[-keep:], w_T[cut:])  # near context and targets as they were
    again = perturb(name, w_T, first, b, rng_for(0, name, b), where)
    np.testing.assert_array_equal(out, again)
    if name != "truncate":
        assert len(out) == len(w_T) and not np.array_equal(out[:cut], w_T[:cut])
        other = perturb(name, w_T, first, b, rng_for(1, name, b), where)
        assert not np.array_equal(out, other)  # another seed, another draw


def test_truncate_keeps_exactly_the_b_nearest_context_tokens():
    w_T = _window()
    out = perturb("truncate", w_T, 36, 10, rng_for(0, "truncate", 10), Far(0, 41, _sources(), 4))
    np.testing.assert_array_equal(out, w_T[26:])
    assert len(out) == 10 + 5  # b context tokens, then the 5 tokens from the first target on


def test_shuffles_permute_the_far_context_and_the_local_one_within_spans():
    w_T = _window()
    where = Far(0, 41, _sources(), span=4)
    cut = 26
    out = perturb("shuffle", w_T, 36, 10, rng_for(0, "shuffle", 10), where)
    assert sorted(out[:cut]) == list(w_T[:cut])
    local = perturb("shuffle_local", w_T, 36, 10, rng_for(0, "shuffle_local", 10), where)
    # spans of 4 counted back from the boundary: [22, 26), [18, 22), ..., [2, 6), [0, 2)
    for stop in range(cut, 0, -4):
        lo = max(stop - 4, 0)
        assert sorted(local[lo:stop]) == list(w_T[lo:stop])
    assert not np.array_equal(local[:cut], w_T[:cut])


def test_unigram_replacements_follow_the_training_tokens():
    sources = _sources()
    w_T = _window(401)
    out = perturb(
        "replace_unigram", w_T, 396, 5, rng_for(0, "replace_unigram", 5), Far(0, 401, sources, 4)
    )
    drawn = out[:391]
    assert set(drawn.tolist()) <= {2, 3, 4, 5}  # ids never seen in training are never drawn
    share = np.mean(drawn == 3)
    assert 0.3 < share < 0.5  # 3 is 2 in 5 of the training tokens


def test_elsewhere_takes_consecutive_text_of_documents_the_window_does_not_touch():
    sources = _sources(n_docs=6, doc_len=40)
    heldout_N = sources.heldout_N
    start, stop = 70, 111  # the window spans documents 1 and 2 (positions 40-119)
    touched = set(sources.document_N[start:stop].tolist())
    assert touched == {1, 2}
    for seed in range(20):
        span = sources.elsewhere(30, start, stop, np.random.default_rng(seed))
        at = [i for i in range(len(heldout_N) - 29) if np.array_equal(heldout_N[i : i + 30], span)]
        assert at and all(not touched & set(sources.document_N[i : i + 30].tolist()) for i in at)
    with pytest.raises(ValueError, match="hold out more text"):
        sources.elsewhere(150, start, stop, np.random.default_rng(0))


def test_windows_are_drawn_alike_whatever_else_the_spec_lists():
    sources = _sources(n_docs=10)
    one = draw_windows(sources, 40, 4, [5, 20], ["shuffle", "truncate"], 30, seed=3, span=4)
    two = draw_windows(sources, 40, 4, [20], ["truncate", "shuffle"], 30, seed=3, span=4)
    np.testing.assert_array_equal(one.intact_WT, two.intact_WT)
    np.testing.assert_array_equal(one.perturbed[("shuffle", 20)], two.perturbed[("shuffle", 20)])
    assert one.intact_WT.shape == (30, 41) and len(set(one.starts_W.tolist())) == 30
    assert one.perturbed[("truncate", 5)].shape == (30, 5 + 4)
    assert (
        one.digest
        == draw_windows(sources, 40, 4, [5, 20], ["shuffle", "truncate"], 30, seed=3, span=4).digest
    )
    assert (
        one.digest
        != draw_windows(sources, 40, 4, [5, 20], ["shuffle", "truncate"], 30, seed=4, span=4).digest
    )
    with pytest.raises(ValueError, match="fewer than the 500"):
        draw_windows(sources, 40, 4, [5], ["shuffle"], 500, seed=0, span=4)


# ---------------------------------------------------------------------------- the spec

TINY = """
title = "context usage, tiny"
seeds = 2

""" + TINY_BASE + """
[axes]
"model.family" = ["gpt", "lstm"]

[heldout]
bytes = 6000

[eval]
lengths = ["1x"]
chunk_tokens = 250
by_position = false

[eval.context]
window = "1.5x"
target = 4
distances = [4, 16]
perturbations = ["truncate", "shuffle", "replace_unigram", "replace_elsewhere"]
windows = 12

[baselines]
ngram = []

[[compare]]
a = {family = "gpt"}
metric = "context:truncate@4"
claim = "the GPT uses the context beyond 4 tokens"

[[compare]]
a = {family = "gpt"}
b = {family = "lstm"}
metric = "context:shuffle@16 - context:truncate@16"
"""


@pytest.mark.parametrize(
    "change, fragments",
    [
        (("windows = 12", "windows = 12\nspan = 0"), ["span = 0", "positive integer"]),
        (
            ('"replace_unigram"', '"replace_unigam"'),
            ["'replace_unigam' is not one", "did you mean 'replace_unigram'"],
        ),
        (("distances = [4, 16]", "distances = [4, 4]"), ["listed twice"]),
        (("distances = [4, 16]", "distances = [0, 16]"), ["1 or more"]),
        (('window = "1.5x"', "window = 18"), ["distance 16 leaves no context", "below 15"]),
        (('window = "1.5x"', "window = 4"), ["target = 4 scores the whole window"]),
        (("windows = 12", "windows = 12\nwidth = 3"), ["unknown key 'width'"]),
        (
            ('metric = "context:truncate@4"', 'metric = "context:truncate@8"'),
            ["distance 8 is not in [eval.context] distances"],
        ),
        (
            ('metric = "context:truncate@4"', 'metric = "context:shuffle_local@4"'),
            ["do not include 'shuffle_local'"],
        ),
        (
            ('metric = "context:truncate@4"', 'metric = "context:truncate@4 - loss@1x"'),
            ["subtract like from like"],
        ),
        (
            ('metric = "context:truncate@4"', 'metric = "loss@1x"'),
            ["a alone tests its metric against zero", "no difference"],
        ),
    ],
)
def test_context_spec_errors_name_the_key_and_the_fix(change, fragments):
    from transformers_jax.sweep.cells import expand, pairs
    from transformers_jax.sweep.spec import SpecError, parse_spec

    with pytest.raises(SpecError) as err:
        spec = parse_spec(TINY.replace(*change), "spec.toml")
        if spec.context.window.tokens is None:
            spec.context.check(spec.context.window.resolve(32), "[eval.context]")
        pairs(spec, expand(spec))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_a_context_metric_needs_the_context_table():
    from transformers_jax.sweep.spec import SpecError, parse_spec

    no_context = TINY.split("[eval.context]")[0] + "[baselines]" + TINY.split("[baselines]")[1]
    with pytest.raises(SpecError, match="add an \\[eval.context\\] table"):
        parse_spec(no_context)


def test_a_spec_without_context_keeps_its_score_keys():
    """A sweep scored before context usage existed is not scored again."""
    from transformers_jax.sweep.spec import parse_spec

    plain = TINY.split("[eval.context]")[0] + "[baselines]" + TINY.split("[baselines]")[1]
    plain = plain.split("[[compare]]")[0]
    assert "context" not in parse_spec(plain).eval_settings()
    assert parse_spec(TINY).eval_settings()["context"]["distances"] == [4, 16]


# ---------------------------------------------------------------------------- a whole sweep


@functools.partial(jax.jit, static_argnums=0)
def _log_probs(model, params, inputs_BT):
    """The oracle's log-probabilities, traced once per model config and window shape (the
    seeds of a cell share the trace; params are an argument)."""
    return jax.nn.log_softmax(model.apply({"params": params}, inputs_BT), axis=-1)


@pytest.mark.slow
def test_a_gpt_and_an_lstm_are_scored_on_the_same_perturbed_windows(tmp_path, monkeypatch):
    import json

    from transformers_jax.cli import main
    from transformers_jax.runs import load_run
    from transformers_jax.sweep import runner
    from transformers_jax.sweep.plan import make_plan
    from transformers_jax.sweep.spec import parse_spec

    clean_checkout(monkeypatch, tmp_path)
    plots_at_the_end(monkeypatch)
    spec = tmp_path / "ctx.toml"
    spec.write_text(TINY)
    out = tmp_path / "out"
    assert main(["sweep", str(spec), "--out", str(out)]) == 0

    plan = make_plan(parse_spec(TINY), str(out / "data"))
    windows = plan.context
    assert windows.window == 48 and windows.intact_WT.shape == (12, 49)
    scores = {
        (cell, seed): json.loads(
            (out / f"cells/family={cell}/seed{seed}" / runner.SCORES_FILE).read_text()
        )["context"]
        for cell in ("gpt", "lstm")
        for seed in (0, 1)
    }
    # every seed of both cells scored the windows the plan draws again now
    for (cell, seed), found in scores.items():
        model, params, _, _ = load_run(str(out / f"cells/family={cell}/seed{seed}"))

        def targets(w_WT, model=model, params=params):
            """The last 4 targets' mean loss per window, worked here from the logits (the
            sweep's own scorer is not the oracle)."""
            logp = _log_probs(model, params, w_WT[:, :-1])
            losses = -np.take_along_axis(np.asarray(logp), w_WT[:, 1:, None], axis=-1)[..., 0]
            return losses[:, -4:].mean(1)

        intact_W = targets(windows.intact_WT)
        np.testing.assert_allclose(found["intact"]["chunks"], intact_W, rtol=2e-5, atol=2e-6)
        for (name, b), w_WT in windows.perturbed.items():
            up_W = targets(w_WT) - intact_W
            entry = found[name][str(b)]
            np.testing.assert_allclose(entry["chunks"], up_W, rtol=1e-4, atol=1e-5)
            assert entry["relative"] == pytest.approx(up_W.mean() / intact_W.mean(), abs=1e-6)
    assert scores[("gpt", 0)]["shuffle"]["16"] != scores[("gpt", 1)]["shuffle"]["16"]

    results = json.loads((out / "results.json").read_text())
    zero, between = results["comparisons"]
    assert (zero["a"], zero["b"], zero["better"]) == ("family=gpt", None, "higher")
    gpt = [np.array(scores[("gpt", s)]["truncate"]["4"]["chunks"]) for s in (0, 1)]
    assert zero["mean"] == pytest.approx(np.mean(gpt))
    assert zero["verdict"] in ("above zero", "below zero", "inconclusive")
    d = [
        np.array(scores[(c, s)]["shuffle"]["16"]["chunks"])
        - np.array(scores[(c, s)]["truncate"]["16"]["chunks"])
        for c in ("gpt", "lstm")
        for s in (0, 1)
    ]
    assert between["mean"] == pytest.approx(np.mean(d[:2]) - np.mean(d[2:]))
    assert between["verdict"] in ("family=gpt higher", "family=lstm higher", "inconclusive")
    assert between["chunks"] == 12  # the windows are the units
    (row,) = [
        r
        for r in results["cells"][1]["context"]["rows"]
        if (r["perturbation"], r["b"]) == ("replace_elsewhere", 4)
    ]
    assert row["low"] <= row["mean"] <= row["high"]
    report = (out / "report.md").read_text()
    assert "## Context usage" in report and "**replace_unigram**" in report
    assert "| family=gpt | 0 | context:truncate@4 |" in report
    assert "context_usage.png" in results["plots"]


def test_the_committed_context_usage_spec_reads_and_pairs():
    from pathlib import Path

    from transformers_jax.sweep.cells import expand, pairs
    from transformers_jax.sweep.spec import read_spec

    path = Path(__file__).resolve().parents[1] / "experiments/specs/context_usage.toml"
    spec = read_spec(str(path))
    cells = expand(spec)
    assert [c.name for c in cells] == ["transformer", "lstm"]
    assert set(spec.context.perturbations) == set(PERTURBATIONS.names())
    spec.context.check(spec.context.window.resolve(384), "[eval.context]")
    found = pairs(spec, cells)
    assert len(found) == 18 and sum(p.b is None for p in found) == 14
