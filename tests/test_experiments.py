"""The experiments' shared pieces (the run cache, held-out scoring, the split), the sweep's
worker processes, and run_all, which runs each experiment and rebuilds experiments/README.md
from the results."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import experiments.common as common
from transformers_jax.study import workers


def test_cached_run_resumes_by_key(results_dir, monkeypatch):
    calls = []
    key = common.cache_key(model={"d": 1}, seed=0)
    assert key != common.cache_key(model={"d": 2}, seed=0)
    assert common.cached_run("x", key, lambda: calls.append(1) or {"loss": 1.5}) == {"loss": 1.5}
    assert common.cached_run("x", key, lambda: calls.append(1) or {"loss": 9.0}) == {"loss": 1.5}
    assert calls == [1]
    monkeypatch.setattr(common, "FRESH", True)
    assert common.cached_run("x", key, lambda: {"loss": 2.0}) == {"loss": 2.0}


def test_shard_and_worker_arguments():
    """What ``tjax sweep --workers`` hands each worker: its shard ``i/n``, parsed strictly, and
    the command's arguments less ``--workers``, in either spelling."""
    assert workers.parse_shard("1/2") == (1, 2) and workers.parse_shard(None) is None
    for bad in ("2/2", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError, match="expected i/n"):
            workers.parse_shard(bad)
    argv = ["--seeds", "2", "--workers", "2", "--workers=3", "--scale", "tiny"]
    assert workers.without_option(argv, "--workers") == ["--seeds", "2", "--scale", "tiny"]


def test_workers_get_disjoint_cores(monkeypatch):
    """Each worker on its own cores (its XLA pool sized to them), contiguous, all cores used;
    none pinned where there are fewer cores than workers; the pin really applies."""
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 1})
    assert workers.worker_cores(2) == [[0], [1]]
    assert workers.worker_cores(3) == [[], [], []]
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: set(range(4, 20)))
    assert workers.worker_cores(3) == [list(range(4, 10)), list(range(10, 15)),
                                      list(range(15, 20))]
    monkeypatch.undo()
    core = min(os.sched_getaffinity(0))
    show = [sys.executable, "-c", "import os, sys; print(os.sched_getaffinity(0), sys.argv[1:])",
            "--shard", "0/2"]
    assert workers.pinned(show, []) == show
    shown = subprocess.run(workers.pinned(show, [core]), capture_output=True, text=True,
                           check=True).stdout
    assert shown.strip() == f"{ {core} } ['--shard', '0/2']"


def test_position_losses_pair_the_same_positions(monkeypatch):
    # a "model" whose loss for each target is the target's id: [i] must hold tokens[i]
    monkeypatch.setattr(common, "window_losses",
                        lambda model: lambda params, inputs, targets: targets.astype(float))
    tokens = np.arange(40)
    flat = common.position_losses(None, None, tokens, 8, batch_size=3)  # a ragged last batch
    scored = ~np.isnan(flat)
    assert np.array_equal(flat[scored], tokens[scored]) and not scored[0]
    assert scored[1:33].all() and not scored[33:].any()  # 4 whole windows
    assert common.eval_loss(None, None, tokens, 8) == pytest.approx(np.mean(np.arange(1, 33)))


def test_split_draws_random_documents_fixed_by_seed(tmp_path, split_cache):
    from transformers_jax.study.splits import make_split

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(150):
        (corpus / f"{i:03d}.txt").write_text(f"document {i} " + "word " * (20 + i % 7) + "\n")
    a, b = make_split(str(corpus), seed=0, heldout_bytes=2000), make_split(str(corpus), seed=0,
                                                                          heldout_bytes=2000)
    other = make_split(str(corpus), seed=1, heldout_bytes=2000)
    assert a.unit == "document" and a.heldout == b.heldout and a.heldout != other.heldout
    held = {int(t.split()[1]) for t in a.heldout}
    assert 1900 <= a.meta()["heldout_bytes"] <= 2000
    assert min(held) < 100  # drawn from everywhere, not the alphabetical tail
    train = {int(t.split()[1]) for t in a.train_texts()}
    assert train.isdisjoint(held) and train | held == set(range(150))
    assert a.meta()["train_units"] == 150 - len(held)
    # a one-file corpus splits by chunks, capped at max_fraction of the text
    one = tmp_path / "one.txt"
    one.write_text("".join(f"line {i} of a long single document\n" for i in range(4000)))
    c = make_split(str(one), seed=0, heldout_bytes=10**6, max_fraction=0.2)
    assert c.unit == "chunk" and 0.1 < c.meta()["heldout_bytes"] / one.stat().st_size <= 0.2
    assert sum(map(len, c.train_texts())) + c.meta()["heldout_bytes"] == one.stat().st_size


def _with_a_second_experiment(monkeypatch):
    """run_all's registry holds one experiment now; what it does across several (their order,
    one section each, skipping those it finished) is tested with a stand-in second one,
    ``demo``, whose finding reads its JSON."""
    import dataclasses

    from experiments import run_all

    demo = dataclasses.replace(
        run_all.EXPERIMENTS[0], module="demo", title="A demo experiment", specs=(),
        tests="What the demo tests.", published="Demo et al. 2026: a published demo result.",
        sections=(run_all.Section("demo", None, lambda out: f"demo scored {out['score']}."),))
    monkeypatch.setattr(run_all, "EXPERIMENTS", (demo, *run_all.EXPERIMENTS))
    return run_all


def _fake_results(folder):
    """Minimal default-scale results of each experiment (the real one and ``demo``), and a
    tiny one (which, like every tiny result, must not be shown)."""
    payloads = {
        "demo_default": {"score": 0.25},
        "attention_variants_heads_default": {  # trained on unshuffled rows: the README says so
            "shuffle_rows": 0, "decode_batches": [1, 8], "results": {name: {
                "runs": [{"eval_loss": loss}],
                "decode": {"batch_1": {"decode_tokens_per_s": 100.0},
                           "batch_8": {"decode_tokens_per_s": speed}}} for name, loss, speed in (
                    ("MHA", 2.00, 400.0), ("GQA-2", 2.01, 700.0), ("MQA", 2.05, 800.0))}},
        "attention_variants_heads_tiny": {"results": {}},
    }
    for name, payload in payloads.items():
        command = f"python -m experiments.{name.rsplit('_', 1)[0]}"
        (folder / f"{name}.json").write_text(json.dumps({"command": command, **payload}))
        (folder / f"{name}.md").write_text(f"Command: `{command}`\n\n| FAKE {name} |")
    (folder / "attention_variants_heads_default.png").write_bytes(b"\x89PNG fake")


def test_run_all_rebuilds_the_readme_from_results(tmp_path, monkeypatch):
    run_all = _with_a_second_experiment(monkeypatch)
    results = tmp_path / "results"
    results.mkdir()
    _fake_results(results)
    readme = tmp_path / "README.md"
    assert run_all.main(["--rebuild-only", "--results", str(results),
                         "--readme", str(readme)]) == 0
    text = readme.read_text()
    for exp in run_all.EXPERIMENTS:
        assert f". {exp.title}" in text and exp.published[:40] in text
    assert "| FAKE demo_default |" in text
    assert ("![attention_variants_heads (default)](results/attention_variants_heads_default.png)"
            in text)
    assert text.count("![") == 1  # demo has no plot: none shown for it
    # the findings are computed from the JSON
    assert "**Finding.** demo scored 0.25." in text
    assert "GQA-2 is within 2% of MHA's loss" in text
    assert "| FAKE attention_variants_heads_default |" in text
    assert "FAKE attention_variants_heads_tiny" not in text  # tiny results are never shown
    assert "Not run yet" not in text
    # a caveat under the one result trained on unshuffled rows, and only there
    assert text.count(run_all.UNSHUFFLED_CAVEAT) == 1
    assert run_all.UNSHUFFLED_CAVEAT in text[text.index("## 2. Attention variants"):]
    # no sweep report, no experiment superseded: neither is mentioned
    assert "Sweeps on the research corpus" not in text and "Superseded" not in text
    # missing results say how to produce them (a tiny result does not count)
    (results / "attention_variants_heads_default.json").unlink()
    text = run_all.build_readme(str(results), str(readme))
    assert "Not run yet: `python -m experiments.attention_variants`\n" in text
    assert text.count("Not run yet") == 1 and "FAKE attention_variants_heads" not in text


def test_run_all_lists_the_sweep_reports_and_marks_a_superseded_experiment(tmp_path,
                                                                           monkeypatch):
    """Each committed sweep report is listed with its title and the command heading it; an
    experiment replaced by a sweep says so above its own (older) results."""
    import dataclasses

    run_all = _with_a_second_experiment(monkeypatch)
    results = tmp_path / "results"
    (results / "sweeps" / "demo").mkdir(parents=True)
    (results / "sweeps" / "demo" / "report.md").write_text(
        "# A demo sweep\n\nCommand: `tjax sweep experiments/specs/demo.toml --out sweeps/demo`"
        "\n\nbody\n")
    (results / "sweeps" / "unfinished").mkdir()  # no report yet: not listed
    first, *rest = run_all.EXPERIMENTS
    monkeypatch.setattr(run_all, "EXPERIMENTS",
                        (dataclasses.replace(first, superseded_by="demo"), *rest))
    text = run_all.build_readme(str(results), str(tmp_path / "README.md"))
    assert ("- [A demo sweep](results/sweeps/demo/report.md): "
            "`tjax sweep experiments/specs/demo.toml --out sweeps/demo`") in text
    assert "unfinished" not in text
    section = text[text.index("## 1."):text.index("## 2.")]
    assert "**Superseded** by the sweep [`demo`](results/sweeps/demo/report.md)" in section
    assert text.count("**Superseded**") == 1
    # the sweeps that took over an experiment's parts, under that experiment only: by their
    # command while no report is committed, then by their report
    attention = text[text.index("## 2. Attention variants"):]
    assert ("stability, each rate against the variant's own converged loss: `tjax sweep "
            "experiments/specs/attention_stability.toml --out sweeps/attention_stability` (not "
            "yet run)") in attention
    assert ("prefix-LM vs causal LM: `tjax sweep experiments/specs/attention_prefix.toml "
            "--out sweeps/attention_prefix` (not yet run)") in attention
    assert text.count("**Sweeps** on the research corpus") == 1
    (results / "sweeps" / "attention_prefix").mkdir()
    (results / "sweeps" / "attention_prefix" / "report.md").write_text("# Prefix\n")
    text = run_all.build_readme(str(results), str(tmp_path / "README.md"))
    attention = text[text.index("## 2. Attention variants"):]
    assert ("prefix-LM vs causal LM: [report](results/sweeps/attention_prefix/report.md) "
            "(`experiments/specs/attention_prefix.toml`)") in attention
    assert "--out sweeps/attention_prefix` (not yet run)" not in text
    assert "--out sweeps/attention_stability` (not yet run)" in attention


@pytest.mark.slow
def test_the_committed_readme_is_built_from_the_committed_results(tmp_path):
    """experiments/README.md is what run_all builds from experiments/results/: a sweep report
    committed under results/sweeps/ is listed there, a retired script's section is gone."""
    from experiments import run_all

    (tmp_path / "results").symlink_to(os.path.join(run_all.HERE, "results"))
    built = run_all.build_readme(str(tmp_path / "results"), str(tmp_path / "README.md"))
    with open(run_all.README) as f:
        assert f.read() == built, ("experiments/README.md is stale: rebuild it with "
                                   "python -m experiments.run_all --rebuild-only")
    assert "](results/sweeps/context_usage/report.md)" in built
    # the attention script's retired parts point at their sweeps' reports
    attention = built[built.index("## 1. Attention variants"):]
    for name in ("attention_variants", "attention_prefix"):
        assert f"[report](results/sweeps/{name}/report.md)" in attention


def test_findings_read_the_paired_intervals():
    """Results with paired intervals: GQA is an equivalence claim (within 2% of MHA's loss),
    MQA a sign claim."""
    from experiments import run_all

    def iv(mean, half):
        return {"mean": mean, "low": mean - half, "high": mean + half, "per_seed": [mean]}

    heads = {"decode_batches": [1], "results": {name: {
        "runs": [{"eval_loss": loss}], "decode": {"batch_1": {"decode_tokens_per_s": 1.0}}}
        for name, loss in (("MHA", 2.0), ("GQA-2", 2.01), ("GQA-4", 2.2), ("MQA", 2.05))},
        "comparisons": {"GQA-2 - MHA": iv(0.01, 0.01), "GQA-4 - MHA": iv(0.2, 0.05),
                        "MQA - MHA": iv(0.05, 0.01)}}
    text = run_all.finding_attention_heads(heads)
    assert "GQA-2 +0.010 [+0.000, +0.020] nats: as published" in text  # within +-0.040
    assert "GQA-4 +0.200 [+0.150, +0.250] nats: unlike the paper" in text
    assert "MQA +0.050 [+0.040, +0.060] nats: as published" in text


def test_run_all_runs_each_experiment_as_its_own_command(tmp_path, monkeypatch):
    run_all = _with_a_second_experiment(monkeypatch)
    calls = []
    monkeypatch.setattr(run_all.subprocess, "call",
                        lambda cmd, cwd, env: calls.append((cmd[1:], env)) or 0)
    readme = tmp_path / "README.md"
    assert run_all.main(["--only", "attention_variants,demo", "--scale",
                         "tiny", "--results", str(tmp_path), "--readme", str(readme)]) == 0
    assert [c[0] for c in calls] == [
        ["-m", "experiments.demo", "--scale", "tiny"],
        ["-m", "experiments.attention_variants", "--scale", "tiny"]]
    assert all(env["TJAX_RESULTS_DIR"] == str(tmp_path) for _, env in calls)
    assert readme.exists()
    calls.clear()
    assert run_all.main(["--only", "demo,attention_variants", "--scale",
                         "tiny", "--results", str(tmp_path), "--readme", str(readme)]) == 0
    assert calls == []  # both finished above: skipped
    assert run_all.main(["--only", "demo,attention_variants", "--scale",
                         "tiny", "--results", str(tmp_path), "--readme", str(readme),
                         "--fresh"]) == 0
    assert [c[0] for c in calls] == [
        ["-m", "experiments.demo", "--scale", "tiny"],
        ["-m", "experiments.attention_variants", "--scale", "tiny"]]
    assert all(env["TJAX_FRESH"] == "1" for _, env in calls)


def test_run_all_replot_replots_what_it_finds_then_the_readme(tmp_path, monkeypatch, capsys):
    run_all = _with_a_second_experiment(monkeypatch)
    calls = []
    monkeypatch.setattr(run_all.subprocess, "call",
                        lambda cmd, cwd, env, stdout: calls.append(cmd[1:]) or 0)
    for name in ("demo_tiny", "attention_variants_heads_tiny",
                 "attention_variants_heads_default"):
        (tmp_path / f"{name}.json").write_text("{}")
    readme = tmp_path / "README.md"
    assert run_all.main(["--replot", "--scale", "tiny", "--results", str(tmp_path),
                         "--readme", str(readme)]) == 0
    assert calls == [  # only what has tiny results
        ["-m", "experiments.demo", "--scale", "tiny", "--replot"],
        ["-m", "experiments.attention_variants", "--scale", "tiny", "--replot"]]
    assert readme.exists() and "nothing to replot" not in capsys.readouterr().out
    calls.clear()  # no large results at all: nothing runs, and each experiment says so
    assert run_all.main(["--replot", "--scale", "large", "--results", str(tmp_path),
                         "--readme", str(readme)]) == 0
    assert calls == [] and capsys.readouterr().out.count("nothing to replot") == 2
    with pytest.raises(SystemExit):
        run_all.main(["--replot", "--rebuild-only", "--results", str(tmp_path)])


def test_run_all_skips_experiments_it_finished(tmp_path, monkeypatch):
    run_all = _with_a_second_experiment(monkeypatch)
    calls, rcs = [], {"experiments.demo": 0,
                      "experiments.attention_variants": 1}
    monkeypatch.setattr(run_all.subprocess, "call",
                        lambda cmd, cwd, env: calls.append(cmd[2]) or rcs[cmd[2]])
    argv = ["--only", "attention_variants,demo", "--scale", "tiny",
            "--results", str(tmp_path), "--readme", str(tmp_path / "README.md")]
    assert run_all.main(argv) == 1  # attention_variants failed
    assert run_all.main(argv) == 1  # an interrupted/failed run_all continues where it stopped
    assert calls == ["experiments.demo", "experiments.attention_variants",
                     "experiments.attention_variants"]
    calls.clear()
    run_all.main([*argv, "--fresh"])
    assert calls == ["experiments.demo", "experiments.attention_variants"]
