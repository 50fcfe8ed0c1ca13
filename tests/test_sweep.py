"""tjax sweep: the spec's errors, the cells and their pairings, the statistics on numbers with
known answers, and a whole sweep of tiny models: its report, resuming, refusing mixed code or
changed configs, locks and shards."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from sweep_runs import TINY_CELLS, clean_checkout, plots_at_the_end, record_trained

from transformers_jax.cli import main
from transformers_jax.runs.lock import RunLock
from transformers_jax.study import provenance, stats
from transformers_jax.sweep import report as report_module
from transformers_jax.sweep import runner
from transformers_jax.sweep.cells import controlled, expand, pairs
from transformers_jax.sweep.plan import make_plan
from transformers_jax.sweep.spec import SpecError, parse_spec
from transformers_jax.train_options import build_configs

TINY = """
title = "tiny"
""" + TINY_CELLS + """
[eval]
lengths = ["1x", "2x"]
sliding = true
chunk_tokens = 250

[baselines]
ngram = [2, 3]

[[compare]]
a = {position = "alibi"}
b = {position = "rope"}
metric = "loss@2x - loss@1x"
claim = "ALiBi degrades less"

[[compare]]
against = {position = "rope"}
metric = "sliding@2x"
"""


# ---------------------------------------------------------------------------- statistics


def test_holm_adjusts_and_levels_by_rank():
    adjusted, levels = stats.holm([0.01, 0.04, 0.03])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06])
    # the smallest p is tested at alpha/3; the next fails at alpha/2 and fixes the rest there
    assert levels == pytest.approx([0.05 / 3, 0.025, 0.025])
    adjusted, levels = stats.holm([0.001, float("nan"), 0.02])
    assert adjusted[0] == pytest.approx(0.002) and math.isnan(adjusted[1])
    assert adjusted[2] == pytest.approx(0.02) and levels == pytest.approx([0.025, math.nan,
                                                                         0.05], nan_ok=True)


def test_paired_interval_and_p_agree_with_t_on_seed_means():
    d = np.array([[0.10] * 8, [0.12] * 8, [0.14] * 8])  # chunks agree: seeds decide
    result = stats.paired(d)
    assert result.mean == pytest.approx(0.12)
    t_half = 4.302653 * 0.02 / math.sqrt(3)  # t(0.975, 2) * sd / sqrt(S)
    low, high = result.interval(0.05)
    assert low == pytest.approx(0.12 - t_half, abs=1e-6)
    assert high == pytest.approx(0.12 + t_half, abs=1e-6)
    # the t-test's p: t = 0.12 / (0.02 / sqrt 3) = 10.39 on 2 df -> 0.00913
    assert result.p_value() == pytest.approx(0.009134, rel=1e-3)
    # zero lies outside the 95% interval, inside the 99.5% one (p 0.009 > 0.005)
    assert result.interval(0.005)[0] < 0 < result.interval(0.05)[0]


def test_bootstrap_decides_with_one_seed_and_drops_unscored_chunks():
    rng = np.random.default_rng(0)
    d = rng.normal(0.5, 0.1, (1, 400))
    d[0, 3] = np.nan
    result = stats.paired(d)
    assert result.d_SC.shape == (1, 399)
    low, high = result.interval()
    assert low < 0.5 < high and high - low == pytest.approx(2 * 1.96 * 0.1 / 20, rel=0.2)
    assert result.p_value() == pytest.approx(2 / (stats.N_BOOT + 1))


@pytest.mark.parametrize("low, high, expected", [
    (-0.2, -0.1, "A better"), (0.1, 0.2, "B better"), (-0.1, 0.1, "inconclusive"),
    (float("nan"), 0.0, "not scored")])
def test_verdict_words(low, high, expected):
    assert stats.verdict(low, high, "A", "B", "lower") == expected
    flipped = {"A better": "B better", "B better": "A better"}.get(expected, expected)
    assert stats.verdict(low, high, "A", "B", "higher") == flipped


# ---------------------------------------------------------------------------- spec and cells


@pytest.mark.parametrize("change, fragments", [
    (("[eval]", "[evaluate]"), ["unknown key 'evaluate'", "did you mean 'eval'"]),
    (('"model.position" = ["rope", "alibi"]', '"model.position" = []'),
     ["is empty", "no cell"]),
    (('metric = "sliding@2x"', 'metric = "sliding@4x"'), ["needs length 4x", "[eval] lengths"]),
    (("sliding = true", "sliding = false"), ["needs sliding windows"]),
    (('b = {position = "rope"}', 'b = {position = "rop"}'),
     ["'rop' is not one of the axis's values", "rope, alibi"]),
    (('b = {position = "rope"}', 'b = {mask = "causal"}'), ["'mask' is not an axis"]),
    (('metric = "loss@2x - loss@1x"', 'metric = "accuracy"'), ["not a metric"]),
    (("seeds = 2", "seeds = [1, 1]"), ["listed twice"]),
    (("tokens = 1536", "tokens = 1536\nargs2 = 1"), ["unknown key 'args2'"]),
    (('"model.position"', '"train.seed"'), ["train.seed is the sweep's to set"]),
    (("title = \"tiny\"", "title = \"tiny\"\nseeds = 3"), ["not valid TOML"]),
])
def test_spec_errors_name_the_key_and_the_fix(change, fragments):
    text = TINY.replace(*change)
    with pytest.raises(SpecError) as err:
        spec = parse_spec(text, "spec.toml")
        pairs(spec, expand(spec))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_base_args_may_not_set_what_the_sweep_sets():
    with pytest.raises(SpecError, match="--run-dir is the sweep's to set"):
        parse_spec(TINY.replace('"--train.seq_len=32"', '"--run-dir=x", "--train.seq_len=32"'))


def test_cells_are_the_product_and_comparisons_pair_on_the_other_axes():
    spec = parse_spec(TINY.replace(
        '"model.position" = ["rope", "alibi"]',
        '"model.position" = ["rope", "alibi", {name = "t5", num_buckets = 8}]\n'
        '"train.seq_len" = [32, 64]'))
    cells = expand(spec)
    assert [c.name for c in cells] == [
        "position=rope,seq_len=32", "position=rope,seq_len=64", "position=alibi,seq_len=32",
        "position=alibi,seq_len=64", "position=t5,seq_len=32", "position=t5,seq_len=64"]
    assert cells[4].args[-3:] == ("--model.position=t5", "--model.position.num_buckets=8",
                                  "--train.seq_len=32")
    found = [(p.index, p.a.name, p.b.name) for p in pairs(spec, cells)]
    assert found == [
        (1, "position=alibi,seq_len=32", "position=rope,seq_len=32"),
        (1, "position=alibi,seq_len=64", "position=rope,seq_len=64"),
        (2, "position=alibi,seq_len=32", "position=rope,seq_len=32"),
        (2, "position=alibi,seq_len=64", "position=rope,seq_len=64"),
        (2, "position=t5,seq_len=32", "position=rope,seq_len=32"),
        (2, "position=t5,seq_len=64", "position=rope,seq_len=64")]


def test_switch_values_sharing_a_name_are_labelled_by_their_settings():
    spec = parse_spec(TINY.replace(
        '"model.position" = ["rope", "alibi"]',
        '"model.position" = [{name = "t5", num_buckets = 8}, {name = "t5", num_buckets = 16}]'
    ).split("[[compare]]")[0])
    assert [c.name for c in expand(spec)] == ["position=t5(num_buckets=8)",
                                              "position=t5(num_buckets=16)"]


# ---------------------------------------------------------------------------- whole sweeps


@pytest.fixture
def sweep_env(tmp_path, monkeypatch):
    code = clean_checkout(monkeypatch, tmp_path)
    plots_at_the_end(monkeypatch)
    spec = tmp_path / "tiny.toml"
    spec.write_text(TINY)
    return tmp_path, spec, code


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """The TINY sweep killed in its second cell, then started again: trained once for the
    tests that read it. Returns ``(root, spec, code, report after the kill, seeds trained by
    the second start)``."""
    root = tmp_path_factory.mktemp("tiny")
    spec = root / "tiny.toml"
    spec.write_text(TINY)
    out = root / "out"
    with pytest.MonkeyPatch.context() as mp:
        code = clean_checkout(mp, root)
        # killed after its first cell: the second cell's training raises
        real = runner.train_seeds_of

        def dies_in_second_cell(planned, seeds, run_dirs, log, apart=False):
            if planned.cell.name == "position=alibi":
                raise KeyboardInterrupt
            return real(planned, seeds, run_dirs, log, apart)

        mp.setattr(runner, "train_seeds_of", dies_in_second_cell)
        with pytest.raises(KeyboardInterrupt):
            main(["sweep", str(spec), "--out", str(out)])
        killed = (out / "report.md").read_text()
        mp.setattr(runner, "train_seeds_of", real)
        plots_at_the_end(mp)  # (the killed start drew them after its cell: one pending)
        calls = record_trained(mp)
        assert main(["sweep", str(spec), "--out", str(out)]) == 0
    return root, spec, code, killed, calls


@pytest.mark.slow
def test_a_sweep_reports_every_comparison_and_resumes_without_retraining(
        resumed, monkeypatch, capsys):
    tmp_path, spec, code, report, calls = resumed
    out = tmp_path / "out"
    clean_checkout(monkeypatch, tmp_path)
    plots_at_the_end(monkeypatch)
    assert "1 of 2 cells finished" in report and "| pending |" in report
    assert calls == ["position=alibi/0", "position=alibi/1"]  # only what was missing

    results = json.loads((out / "results.json").read_text())
    assert results["provenance"]["code"] == code
    assert results["provenance"]["data"]["overlap"]["heldout_windows"] > 0
    assert results["provenance"]["spec"] == TINY
    assert set(results["baselines"]["1536"]) == {"unigram", "2-gram", "3-gram"}
    # each seed's own n-grams, fitted on the 12 steps x 4 rows x 33 tokens its run read
    own = results["seed_baselines"]
    assert set(own) == {"position=rope", "position=alibi"} and set(own["position=rope"]) == {
        "0", "1"}
    assert own["position=rope"]["0"]["tokens"] == 12 * 4 * 33
    assert own["position=rope"]["0"] == own["position=alibi"]["0"]  # the same text read
    assert own["position=rope"]["0"]["2-gram"] != own["position=rope"]["1"]["2-gram"]
    # each cell's work: its seeds trained once, by this code, with their times (rope by the
    # killed start, alibi by the second)
    for c in results["cells"]:
        (work,) = c["work"]
        assert work["trained"] == [0, 1] and work["code"] == "a" * 12
        assert work["started"] <= work["finished"]
    rows = results["comparisons"]
    assert [(r["compare"], r["a"], r["b"]) for r in rows] == [
        (1, "position=alibi", "position=rope"), (2, "position=alibi", "position=rope")]
    for r in rows:
        assert r["verdict"] in ("inconclusive", "position=alibi better", "position=rope better")
        assert r["low"] <= r["mean"] <= r["high"] and 0 < r["p_holm"] <= 1
    # each seed's scores: chunk means of 250 tokens over the held-out stream
    scores = json.loads((out / "cells/position=rope/seed1" / runner.SCORES_FILE).read_text())
    n = results["provenance"]["data"]["heldout_tokens"]
    assert len(scores["loss"]["1x"]["chunks"]) == n // 250
    assert len(scores["by_position"]["2x"]) == 64
    assert scores["sliding"]["2x"]["stride"] == 8
    report = (out / "report.md").read_text()
    assert "2 of 2 cells finished" in report and "ALiBi degrades less" in report
    assert "Each seed's own baselines" in report
    assert "Command: `tjax sweep" in report
    assert (out / "hparams" / "position=rope").is_dir()

    # a seed run is an ordinary run directory, and its README's command trains it alone
    plan = make_plan(parse_spec(TINY), str(out / "data"))
    planned = plan.cells[0]
    model_cfg, train_cfg = build_configs(runner.train_args(planned))
    assert (model_cfg, train_cfg) == (planned.model, planned.train.replace(progress=True))
    assert runner.train_args(planned)[-3] in (out / "cells/position=rope/seed0/README.md"
                                              ).read_text()
    assert main(["sample", "--run", str(out / "cells/position=rope/seed0"), "--prompt", "The",
                 "--max-new-tokens", "4"]) == 0

    # started again: nothing trains, nothing is rescored, no baseline is fitted again
    before = os.path.getmtime(out / "cells/position=rope/seed1" / runner.SCORES_FILE)
    calls = record_trained(monkeypatch)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("baselines", "seed_baselines"):
            mp.setattr(report_module, name, lambda plan: pytest.fail("baselines fitted again"))
        assert main(["sweep", str(spec), "--out", str(out)]) == 0
    assert calls == []
    assert os.path.getmtime(out / "cells/position=rope/seed1" / runner.SCORES_FILE) == before

    # other code: refused unless asked, then recorded
    monkeypatch.setattr(provenance, "code_state",
                        lambda: {"commit": "b" * 40, "dirty": False, "source_sha256": "2" * 64})
    capsys.readouterr()
    assert main(["sweep", str(spec), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "trained by code aaaaaaaaaaaa" in err and "--allow-code-change" in err
    assert main(["sweep", str(spec), "--out", str(out), "--allow-code-change"]) == 0
    other = json.loads((out / "results.json").read_text())["provenance"]["other_code"]
    assert other == [code]
    # each comparison says its cells were trained by two code states
    rows = json.loads((out / "results.json").read_text())["comparisons"]
    assert all(r["code_states"] == ["a" * 12, "b" * 12] for r in rows)
    assert "cells trained by 2 code states" in (out / "report.md").read_text()

    # another config under the same cell name: refused, naming the difference
    spec.write_text(TINY.replace("--train.batch_size=4", "--train.batch_size=8"))
    assert main(["sweep", str(spec), "--out", str(out), "--allow-code-change"]) == 2
    err = capsys.readouterr().err
    assert "trained with another config" in err and "batch_size" in err


@pytest.mark.slow
def test_reanalysis_rebuilds_the_report_from_the_stored_scores(resumed, tmp_path, capsys):
    """--reanalyse on a copy of the sweep's folder without its runs: the same comparisons
    from results.json's per-chunk scores; then with the claims re-declared (one primary, one
    exploratory, an equivalence margin), read as the new spec says, nothing trained."""
    root, spec, _, _, _ = resumed
    out = tmp_path / "out"
    out.mkdir()
    for name in ("results.json", "report.md"):
        shutil.copy(root / "out" / name, out / name)
    before = json.loads((out / "results.json").read_text())
    assert set(before["scores"]) == {"position=rope", "position=alibi"}
    assert main(["sweep", str(spec), "--out", str(out), "--reanalyse"]) == 0
    after = json.loads((out / "results.json").read_text())
    for old, new in zip(before["comparisons"], after["comparisons"], strict=True):
        assert new == old  # the same statistics on the same scores
    text = (out / "report.md").read_text()
    assert text.split("\n", 3)[3] == (root / "out" / "report.md").read_text().split("\n", 3)[3]
    redeclared = tmp_path / "claims.toml"
    redeclared.write_text(TINY.replace('claim = "ALiBi degrades less"',
                                       'claim = "ALiBi degrades less"\nprimary = true')
                          .replace('metric = "sliding@2x"', 'metric = "sliding@2x"\nmargin = 0.5\n'
                                   'primary = false'))
    assert main(["sweep", str(redeclared), "--out", str(out), "--reanalyse"]) == 0
    rows = json.loads((out / "results.json").read_text())["comparisons"]
    assert rows[0]["primary"] and rows[0]["level"] == pytest.approx(0.95)  # a family of one
    assert not rows[1]["primary"] and rows[1]["verdict"].endswith("(exploratory)")
    assert "equivalent within ±0.5" in rows[1]["verdict"]
    assert "exploratory" in (out / "report.md").read_text()
    other = tmp_path / "other.toml"  # other cells: refused, naming them
    other.write_text(TINY.replace('["rope", "alibi"]', '["rope", "alibi", "t5"]'))
    assert main(["sweep", str(other), "--out", str(out), "--reanalyse"]) == 2
    assert "are not the ones the sweep ran" in capsys.readouterr().err


def test_the_report_command_reruns_from_any_checkout(tmp_path):
    """Absolute paths under the folder the sweep ran in are recorded relative to it; others,
    and every other argument, as given."""
    from transformers_jax.sweep.command import typed_command

    root = str(tmp_path / "repo")
    argv = [f"{root}/experiments/specs/x.toml", "--out", f"{root}/sweeps/x", "--workers", "2",
            f"--out={root}/sweeps/y", "/elsewhere/z.toml", f"{root}-other/a", "--seeds-apart"]
    assert typed_command(argv, root) == (
        "tjax sweep experiments/specs/x.toml --out sweeps/x --workers 2 --out=sweeps/y "
        f"/elsewhere/z.toml {root}-other/a --seeds-apart")


def test_a_dirty_checkout_is_refused(sweep_env, monkeypatch, capsys):
    tmp_path, spec, _ = sweep_env
    monkeypatch.setattr(provenance, "code_state",
                        lambda: {"commit": "c" * 40, "dirty": True, "source_sha256": "3" * 64})
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out")]) == 2
    assert "uncommitted changes" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_dry_run_lists_cells_budgets_and_comparisons(sweep_env, monkeypatch, capsys):
    """The estimates are measured (a step and a batch of each length compiled and timed); the
    two cells' models, alike in cost, are timed as one shape: each compile once."""
    from transformers_jax.sweep import command

    tmp_path, spec, _ = sweep_env
    timed = []
    monkeypatch.setattr(command, "_shape_key", lambda model: timed.append(model) or "tiny")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 cells x 2 seeds = 4 runs; 2 comparisons declared" in out
    assert "position=alibi" in out and "1,536" in out and "est. min" in out
    assert "compare 1: position=alibi vs position=rope: loss@2x - loss@1x" in out
    assert not (tmp_path / "out").exists()
    assert {m.position.name for m in timed} == {"rope", "alibi"}  # both cells estimated


def test_more_than_an_epoch_is_refused(sweep_env, capsys):
    tmp_path, spec, _ = sweep_env
    spec.write_text(TINY.replace("tokens = 1536", "tokens = 100_000_000"))
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
    assert "epochs of the" in capsys.readouterr().err


def test_a_masked_lm_cell_is_refused(sweep_env, capsys):
    tmp_path, spec, _ = sweep_env
    spec.write_text(TINY.replace('"--model.d_model=16"', '"--family=bert", "--model.d_model=16"'))
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
    assert "sweep a causal LM" in capsys.readouterr().err


@pytest.mark.slow
def test_a_locked_cell_is_skipped_and_a_shard_trains_its_share(sweep_env, monkeypatch):
    tmp_path, spec, _ = sweep_env
    out = tmp_path / "out"
    calls = record_trained(monkeypatch)
    spec.write_text(TINY.replace("seeds = 2", "seeds = 1"))
    assert main(["sweep", str(spec), "--out", str(out), "--shard", "1/2"]) == 0
    assert calls == ["position=alibi/0"]
    with RunLock(str(out / "cells" / "position=rope")):  # another worker holds it
        assert main(["sweep", str(spec), "--out", str(out)]) == 0
    assert calls == ["position=alibi/0"]
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    assert calls == ["position=alibi/0", "position=rope/0"]


# ---------------------------------------------------------------------------- fuzzed specs

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from profiles import examples  # noqa: E402

from transformers_jax.sweep import spec as spec_module  # noqa: E402

SCALAR = st.one_of(st.integers(-3, 5000), st.floats(allow_nan=True), st.booleans(),
                   st.sampled_from(["1x", "0.5x", "loss@1x", "sliding@2x", "loss@2x - loss@1x",
                                    "rope", "alibi", "x", "", "--steps=3", "--run-dir=a"]))
VALUE = st.recursive(SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(
        ["name", "position", "label", "num_buckets", "junk"]), inner, max_size=3)), max_leaves=6)


def _section(keys) -> st.SearchStrategy:
    return st.one_of(st.dictionaries(st.sampled_from(sorted(keys) + ["junk"]), VALUE,
                                     max_size=4), VALUE)


SPEC_DICT = st.fixed_dictionaries({}, optional={
    "title": VALUE, "seeds": VALUE, "base": _section(spec_module.BASE_KEYS),
    "axes": st.one_of(st.dictionaries(st.sampled_from(
        ["model.position", "train.seq_len", "position", "train.seed"]), VALUE, max_size=2),
        VALUE),
    "cell": st.lists(_section({"name", "model.position"}), max_size=2),
    "heldout": _section(spec_module.HELDOUT_KEYS), "eval": _section(spec_module.EVAL_KEYS),
    "baselines": _section(spec_module.BASELINE_KEYS),
    "compare": st.one_of(st.lists(_section(spec_module.COMPARE_KEYS), max_size=3), VALUE),
    "control": st.one_of(st.lists(_section(spec_module.CONTROL_KEYS), max_size=2), VALUE),
})


@settings(max_examples=examples(ci=60, thorough=300), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(SPEC_DICT)
def test_any_spec_is_read_or_refused_with_a_spec_error(raw):
    try:
        spec = spec_module.spec_from_dict(raw)
        pairs(spec, expand(spec))
        controlled(spec, expand(spec))
    except SpecError as err:
        assert str(err)


@pytest.mark.slow
def test_workers_train_the_cells_in_processes_of_their_own(sweep_env, monkeypatch):
    tmp_path, spec, _ = sweep_env
    from subprocess_env import single_device_env

    monkeypatch.setenv("XLA_FLAGS", single_device_env()["XLA_FLAGS"])  # a user's one device
    spec.write_text(TINY.replace("seeds = 2", "seeds = 1"))
    out = tmp_path / "out"
    # the workers compute their own code state: a checkout under edit passes with the flag
    assert main(["sweep", str(spec), "--out", str(out), "--workers", "2",
                 "--allow-code-change"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [c["seeds_scored"] for c in results["cells"]] == [[0], [0]]
    assert all(r["verdict"] != "pending" for r in results["comparisons"])


def test_settings_given_as_multiples_of_seq_len_follow_each_cell(sweep_env):
    from transformers_jax.sweep.plan import resolve_cell

    spec = parse_spec(TINY.replace(
        '"model.position" = ["rope", "alibi"]',
        '"model.position" = [{name = "t5", num_buckets = 8, max_distance = "2x"}]\n'
        '"train.seq_len" = [32, 64]').split("[[compare]]")[0])
    found = [resolve_cell(spec, c) for c in expand(spec)]
    assert [p.model.position.max_distance for p in found] == [64, 128]
    assert "--model.position.max_distance=128" in found[1].cell.args
    bad = parse_spec(TINY.replace('"model.position" = ["rope", "alibi"]',
                                  '"model.position" = [{name = "t5", max_distance = "0.3x"}]'
                                  ).split("[[compare]]")[0])
    with pytest.raises(SpecError, match="9.6 tokens at seq_len 32"):
        resolve_cell(bad, expand(bad)[0])


def test_a_cell_key_holds_what_trains_not_how_it_reports(sweep_env):
    """Settings of how a run reports (a profile, logging, TensorBoard) leave a cell's key as it
    was, so its finished runs stay valid; one that changes the training gives another key."""
    import dataclasses

    tmp_path, spec_path, _ = sweep_env
    plan = make_plan(parse_spec(spec_path.read_text()), str(tmp_path / "data"))
    planned = plan.cells[0]

    def key(**train) -> str:
        changed = dataclasses.replace(planned, train=planned.train.replace(**train))
        return runner.cell_record(plan, changed)["key"]

    same = key()
    assert key(profile="1:1", log_every=3, tensorboard=True, progress=True) == same
    assert key(learning_rate=planned.train.learning_rate / 2) != same
    # settings added since sweeps began count only when set: older cells keep their keys
    record = runner.cell_record(plan, planned)["train"]
    assert "lora" not in record and "data_download" not in record
    assert key(data_download=True) != same


@pytest.mark.slow
def test_passkey_retrieval_is_scored_and_compared_trial_by_trial(sweep_env, capsys):
    tmp_path, spec, _ = sweep_env
    text = TINY.replace("seeds = 2", "seeds = 1").replace(
        "chunk_tokens = 250", 'chunk_tokens = 250\npasskey = {lengths = ["4x"], trials = 2, '
        "depths = [0.5]}").split("[[compare]]")[0]
    # a control no model this small passes: the passkey comparison is reported, not read
    spec.write_text(text + '[[compare]]\na = {position = "alibi"}\nb = {position = "rope"}\n'
                    'metric = "passkey@4x"\n[[control]]\ncells = {position = "rope"}\n'
                    'metric = "passkey@4x"\nat_least = 0.5\n')
    out = tmp_path / "out"
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    scores = json.loads((out / "cells/position=alibi/seed0" / runner.SCORES_FILE).read_text())
    assert scores["passkey"]["4x"]["tokens"] == 128
    assert len(scores["passkey"]["4x"]["chunks"]) == 2
    assert set(scores["passkey"]["4x"]["chunks"]) <= {0.0, 1.0}
    results = json.loads((out / "results.json").read_text())
    (row,), (control,) = results["comparisons"], results["controls"]
    assert row["better"] == "higher" and row["read_as"] != "pending"
    assert control["status"] == "failed" and control["per_seed"] == [0.0]
    assert row["verdict"] == "not read: control 1 failed in position=rope"
    report = (out / "report.md").read_text()
    assert "passkey@4x" in report and "## Positive controls" in report
    spec.write_text(text.replace('lengths = ["4x"]', 'lengths = ["1x"]'))
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out2"), "--dry-run"]) == 2
    assert "a passkey prompt needs more than 32 tokens" in capsys.readouterr().err


def test_the_readme_shows_the_committed_example_spec():
    import re
    from pathlib import Path

    from transformers_jax.sweep.spec import tomllib

    root = Path(__file__).resolve().parents[1]
    (block,) = re.findall(r"^```toml\n(.*?)^```", (root / "README.md").read_text(), re.S | re.M)
    committed = (root / "experiments/specs/readme_positions.toml").read_text()
    assert tomllib.loads(block) == tomllib.loads(committed)
    parse_spec(committed)


@pytest.mark.slow
def test_seeds_trained_together_score_as_seeds_trained_apart(resumed, sweep_env):
    """The ALiBi cell of the resumed sweep, its two seeds trained as one program, against the
    same cell trained seed after seed."""
    root, _, _, _, _ = resumed
    tmp_path, spec, _ = sweep_env
    spec.write_text(TINY.split("[[compare]]")[0].replace(
        '"model.position" = ["rope", "alibi"]', '"model.position" = ["alibi"]'))
    out = tmp_path / "apart"
    assert main(["sweep", str(spec), "--out", str(out), "--seeds-apart"]) == 0
    scores, how = {}, {}
    for name, folder in (("together", root / "out"), ("apart", out)):
        seeds = [folder / f"cells/position=alibi/seed{s}" for s in (0, 1)]
        scores[name] = [json.loads((d / runner.SCORES_FILE).read_text())["loss"]["2x"]["mean"]
                        for d in seeds]
        how[name] = [json.loads((d / runner.DONE_FILE).read_text()).get("seeds_together")
                     for d in seeds]
    assert how == {"together": [2, 2], "apart": [None, None]}
    assert scores["together"] == pytest.approx(scores["apart"], rel=1e-5)
    assert scores["together"][0] != scores["together"][1]  # two seeds, two models


SPECS = sorted((Path(__file__).resolve().parents[1] / "experiments" / "specs").glob("*.toml"))


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_committed_spec_expands_to_its_cells_comparisons_and_controls(path):
    """A committed spec (some are for an accelerator and never run here) stays valid as the
    spec language changes: every cell's options build configs, every comparison and control
    selects cells."""
    from transformers_jax.sweep.plan import resolve_cells

    spec = parse_spec(path.read_text(), str(path))
    cells = [c.cell for c in resolve_cells(spec)]
    assert pairs(spec, cells)
    assert len(controlled(spec, cells)) == len(spec.controls)
