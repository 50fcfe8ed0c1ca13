"""Each experiment runs end to end at a tiny scale and writes its JSON, table and plot."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import experiments.common as common
from transformers_jax.config import SHUFFLE_ROWS
from transformers_jax.sweep import workers


@pytest.mark.slow
def test_length_extrapolation_tiny(results_dir, split_cache, monkeypatch, assert_replots):
    from experiments import length_extrapolation

    argv = ["--scale", "tiny", "--seeds", "2", "--schemes", "alibi,learned,fire", "--sliding"]
    length_extrapolation.main(argv)
    out = json.loads((results_dir / "length_extrapolation_tiny.json").read_text())
    assert out["train_lens"] == [16] and out["multiples"] == [1, 2]
    assert out["python"].count(".") == 2 and out["data"]["corpus"] == "default"
    assert out["cores"] == len(os.sched_getaffinity(0))  # the thread count moves the rounding
    assert len(out["data"]["sha256"]) == 64 and out["heldout_tokens"] == 2000
    base = out["baselines"]
    assert base["unigram"] > base["2-gram"] > base["3-gram"] > base["4-gram"]
    runs = out["results"]["16"]
    learned, alibi = runs["learned"][0], runs["alibi"][0]
    assert math.isnan(learned["flat"]["32"]) and not math.isnan(alibi["flat"]["32"])
    assert 0 < alibi["sliding"]["16"] < 10 and len(alibi["flat_blocks"]["16"]) == 2000 // 32
    assert runs["fire"][0]["position"] == {"name": "fire", "init_threshold": 16.0}
    assert [k.rsplit("/", 1)[-1] for k in runs["fire"][0]["learned"]] == ["c", "threshold"]
    claims = [c for c in out["comparisons"] if c["kind"] == "degradation"]
    assert {c["a"] for c in claims} == {"alibi", "fire"}  # learned has no 2x
    table = (results_dir / "length_extrapolation_tiny.md").read_text()
    assert table.startswith("Command: `python -m") and "n/a (beyond table)" in table
    assert "3-gram" in table and "init_threshold" in table
    assert out["shuffle_rows"] == SHUFFLE_ROWS  # the library's default: batches mix documents
    assert f"training rows shuffled in windows of {SHUFFLE_ROWS}" in table
    assert (results_dir / "length_extrapolation_tiny.png").stat().st_size > 10_000
    # where each run attends, at L and at the longest length (the learned table stops at L)
    stats = alibi["attention"]["32"]
    assert stats["length"] == 32 and np.shape(stats["distance"]) == (1, 2)  # layers x heads
    assert 0 < np.min(stats["distance"]) and np.max(stats["distance"]) < 31 / 2 + 1e-6
    assert set(learned["attention"]) == {"16"}
    assert (results_dir / "length_extrapolation_tiny_attention.png").stat().st_size > 10_000
    assert "length_extrapolation_tiny_attention.png" in table
    # a second invocation resumes from the cache: nothing trains again, not even when the
    # evaluation changes (no sliding windows: the kept runs are scored again)
    monkeypatch.setattr(common, "train_and_load",
                        lambda *a, **k: pytest.fail("a cached run was trained again"))
    length_extrapolation.main(argv)
    again = json.loads((results_dir / "length_extrapolation_tiny.json").read_text())
    assert again["results"]["16"]["alibi"][0]["flat"] == alibi["flat"]
    length_extrapolation.main(argv[:-1])
    rescored = json.loads((results_dir / "length_extrapolation_tiny.json").read_text())
    assert rescored["results"]["16"]["alibi"][0]["flat"] == pytest.approx(alibi["flat"])
    assert rescored["results"]["16"]["alibi"][0]["sliding"] == {}
    assert_replots(length_extrapolation, "length_extrapolation_tiny", ["--scale", "tiny"])


def test_cached_run_resumes_by_key(results_dir, monkeypatch):
    calls = []
    key = common.cache_key(model={"d": 1}, seed=0)
    assert key != common.cache_key(model={"d": 2}, seed=0)
    assert common.cached_run("x", key, lambda: calls.append(1) or {"loss": 1.5}) == {"loss": 1.5}
    assert common.cached_run("x", key, lambda: calls.append(1) or {"loss": 9.0}) == {"loss": 1.5}
    assert calls == [1]
    monkeypatch.setattr(common, "FRESH", True)
    assert common.cached_run("x", key, lambda: {"loss": 2.0}) == {"loss": 2.0}


def test_shards_split_the_runs_and_workers_start_one_process_each(monkeypatch):
    from experiments import length_extrapolation

    class Split:
        seed, sha256 = 0, "x"

        def meta(self):
            return {}

    done = []
    monkeypatch.setattr(length_extrapolation, "heldout_split",
                        lambda *a: (Split(), np.zeros(8, np.int32), {}))
    monkeypatch.setattr(length_extrapolation, "one_run", lambda scheme, L, seed, *a: done.append(
        (L, scheme, seed)) or {})
    sweep = ("default", 3, ["alibi", "rope"], None)
    assert length_extrapolation.run(*sweep, shard=(0, 4)) is None  # a shard only caches
    shards = [list(done)]
    for i in (1, 2, 3):
        done.clear()
        length_extrapolation.run(*sweep, shard=(i, 4))
        shards.append(list(done))
    done.clear()
    assert length_extrapolation.run(*sweep)["results"]  # no shard: every run, and the report
    every = sorted(done)
    assert len(every) == 18 and sorted(sum(shards, [])) == every  # each run in one shard
    assert [len(s) for s in shards] == [5, 5, 4, 4]
    assert common.parse_shard("1/2") == (1, 2) and common.parse_shard(None) is None
    for bad in ("2/2", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError, match="expected i/n"):
            common.parse_shard(bad)
    argv = ["--seeds", "2", "--workers", "2", "--workers=3", "--scale", "tiny"]
    assert common.without_option(argv, "--workers") == ["--seeds", "2", "--scale", "tiny"]
    started = []

    class Proc:
        def __init__(self, command):
            started.append(command[command.index("-m") + 1:])
            self.code = 3 if command[-1] == "--shard=1/2" else 0

        def wait(self):
            return self.code

        def poll(self):
            return self.code

    monkeypatch.setattr(workers.subprocess, "Popen", Proc)
    with pytest.raises(SystemExit, match="worker 1/2 \\(exit 3\\) failed"):
        common.run_workers("experiments.length_extrapolation", ["--seeds", "2"], 2)
    assert started == [["experiments.length_extrapolation", "--seeds", "2", f"--shard={s}"]
                       for s in ("0/2", "1/2")]


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


def test_workers_then_one_reading_pass(results_dir, monkeypatch):
    """``--workers 2``: the split once, the workers with the same arguments (less --workers),
    then a pass that reads the cache (FRESH off) and reports once; a run missing from the cache
    after the workers is an error, not a silent retrain."""
    from experiments import length_extrapolation

    calls = []
    monkeypatch.setattr(length_extrapolation, "heldout_split",
                        lambda *a: calls.append(("split", a)))
    monkeypatch.setattr(common, "run_workers", lambda module, argv, n: calls.append(
        ("workers", module, argv, n)) or monkeypatch.setattr(common, "READ_ONLY", True))
    monkeypatch.setattr(length_extrapolation, "run", lambda *a, **k: calls.append(
        ("run", common.FRESH, a[-1])) or {"scale": "tiny"})
    monkeypatch.setattr(length_extrapolation, "report", lambda out: calls.append(("report",)))
    length_extrapolation.main(["--scale", "tiny", "--workers", "2", "--fresh", "--seeds", "2"])
    assert calls == [("split", (None, 2_000, 0)),
                     ("workers", "experiments.length_extrapolation",
                      ["--scale", "tiny", "--fresh", "--seeds", "2"], 2),
                     ("run", False, None), ("report",)]
    assert common.READ_ONLY
    with pytest.raises(RuntimeError, match="not in .* after the workers finished"):
        common.cached_run("x", "missing", lambda: pytest.fail("computed a missing run"))
    with pytest.raises(SystemExit):  # a worker's own pass never starts workers
        length_extrapolation.main(["--scale", "tiny", "--shard", "2/2"])


def test_position_losses_pair_the_same_positions(monkeypatch):
    import numpy as np

    # a "model" whose loss for each target is the target's id: [i] must hold tokens[i]
    monkeypatch.setattr(common, "window_losses",
                        lambda model: lambda params, inputs, targets: targets.astype(float))
    tokens = np.arange(40)
    flat = common.position_losses(None, None, tokens, 8)
    sliding = common.position_losses(None, None, tokens, 8, stride=2)
    for losses in (flat, sliding):
        scored = ~np.isnan(losses)
        assert np.array_equal(losses[scored], tokens[scored]) and not scored[0]
    assert (~np.isnan(flat))[1:33].all() and np.isnan(flat[33:]).all()  # 4 whole windows
    assert (~np.isnan(sliding))[1:39].all()  # windows every 2 tokens score up to the end


def test_position_losses_lead_each_window_with_bos_when_asked(monkeypatch):
    """bos_id replaces each window's first input (the token before its first target) and
    nothing else: the same positions are scored, with the same targets."""
    import numpy as np

    def losses_of(model):
        def losses(params, inputs, targets):
            np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # context untouched
            return targets + 1000.0 * (inputs[:, :1] == 99)

        return losses

    monkeypatch.setattr(common, "window_losses", losses_of)
    tokens = np.arange(40)
    for stride in (None, 2):
        plain = common.position_losses(None, None, tokens, 8, stride=stride)
        led = common.position_losses(None, None, tokens, 8, stride=stride, bos_id=99)
        scored = ~np.isnan(plain)
        assert np.array_equal(scored, ~np.isnan(led))
        np.testing.assert_array_equal(led[scored], plain[scored] + 1000.0)


@pytest.mark.slow
def test_length_extrapolation_bos_per_row_and_shuffled_rows(results_dir, split_cache):
    """--bos-per-row trains with TrainConfig.bos_per_row and scores windows led by bos,
    --shuffle-rows shuffles the training rows; the result and its table say so."""
    from experiments import length_extrapolation

    length_extrapolation.main(["--scale", "tiny", "--seeds", "1", "--schemes", "none",
                               "--bos-per-row", "--shuffle-rows", "64"])
    out = json.loads((results_dir / "length_extrapolation_tiny.json").read_text())
    assert out["bos_per_row"] is True and out["shuffle_rows"] == 64
    assert 0 < out["results"]["16"]["none"][0]["flat"]["16"] < 10
    table = (results_dir / "length_extrapolation_tiny.md").read_text()
    assert "every training and held-out window starts with bos" in table
    assert "training rows shuffled in windows of 64" in table
    runs = os.path.join(str(results_dir), ".cache", "length_extrapolation", "runs")
    [run] = os.listdir(runs)
    train = json.load(open(os.path.join(runs, run, "tjax_config.json")))["train"]
    assert train["bos_per_row"] and train["shuffle_rows"] == 64


def test_split_draws_random_documents_fixed_by_seed(tmp_path, split_cache):
    from transformers_jax.sweep.splits import make_split

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


def _fake_results(folder):
    """Minimal default-scale results of every experiment but one attention part (whose tiny
    result, like every tiny result, must not be shown)."""
    nan = float("nan")
    payloads = {
        "length_extrapolation_default": {
            "train_lens": [4], "multiples": [1, 2], "baselines": {
                "unigram": 3.0, "2-gram": 2.5, "3-gram": 2.2, "4-gram": 2.05, "5-gram": 2.0},
            "results": {"4": {s: [{"flat": {"4": at_l, "8": at_l + 0.1}}] for s, at_l in (
                ("alibi", 2.0), ("rope", 2.1), ("none", 2.3))}},
            "comparisons": [
                {"kind": "degradation", "L": 4, "n": 8, "a": s, "b": None, "verdict": None,
                 "interval": {"mean": m, "low": m - 0.01, "high": m + 0.01}}
                for s, m in (("alibi", 0.01), ("rope", 0.5), ("none", 0.2))] + [
                {"kind": "claim", "L": 4, "n": 8, "a": "alibi", "b": "rope",
                 "verdict": "as published", "interval": {"mean": -0.49, "low": -0.6,
                                                         "high": -0.4}}]},
        "rope_extension_default": {
            "train_len": 16, "eval_len": 64, "fine_tune_steps": 4, "loss_at_train_len": [2.0],
            "references": {"zero_shot": "none", "fine_tuned": "linear"},
            "results": {k: [{"zero_shot": z, "fine_tuned": f}] for k, z, f in (
                ("none", 4.0, 2.5), ("linear", 3.0, 2.2), ("yarn", 2.4, 2.1))},
            "comparisons": {  # paired intervals: one excludes zero, one does not
                "zero_shot: yarn - none": {"mean": -1.6, "low": -1.7, "high": -1.5},
                "fine_tuned: yarn - linear": {"mean": -0.1, "low": -0.3, "high": 0.1}}},
        "context_usage_default": {  # trained on unshuffled rows: the README says so
            "shuffle_rows": 0, "boundaries": [4, 16], "results": {family: [{
                "base": 2.0, "truncate/4": 0.2, "truncate/16": t16, "shuffle/4": 0.2,
                "shuffle/16": s16, "shuffle_spans/4": 0.1, "shuffle_spans/16": 0.0,
                "random/4": 0.3, "random/16": 0.01}] for family, t16, s16 in (
                    ("gpt", 0.05, 0.05), ("lstm", 0.005, 0.0))},
            "comparisons": {  # gpt: order used to b=16 (excludes 0); lstm: inconclusive
                "gpt/shuffle/4": {"mean": 0.2, "low": 0.1, "high": 0.3},
                "gpt/shuffle/16": {"mean": 0.05, "low": 0.01, "high": 0.09},
                "lstm/shuffle/4": {"mean": 0.01, "low": -0.01, "high": 0.03},
                "lstm/shuffle/16": {"mean": 0.0, "low": -0.02, "high": 0.02}}},
        "synthetic_generalisation_default": {
            "train_max": 2, "test_max": 4, "results": {"gpt": {"copy": {
                "none": [{"exact": {"1": 1.0, "2": 1.0, "3": 0.5, "4": 0.0},
                          "token_accuracy": {"1": 1.0, "2": 1.0, "3": 0.8, "4": 0.4}}],
                "learned": [{"exact": {"1": 1.0, "2": 0.5, "3": nan, "4": nan},
                             "token_accuracy": {"1": 1.0, "2": 0.7, "3": nan, "4": nan}}]}}}},
        "attention_variants_heads_default": {
            "decode_batches": [1, 8], "results": {name: {
                "runs": [{"eval_loss": loss}],
                "decode": {"batch_1": {"decode_tokens_per_s": 100.0},
                           "batch_8": {"decode_tokens_per_s": speed}}} for name, loss, speed in (
                    ("MHA", 2.00, 400.0), ("GQA-2", 2.01, 700.0), ("MQA", 2.05, 800.0))}},
        "attention_variants_prefix_default": {
            "task": {"name": "reverse", "train_max": 6, "steps": 10}, "results": {
                name: {"runs": [{"exact_match": em, "eval_loss": loss} for em in ems]}
                for name, ems, loss in (
                    ("causal LM", (0.5,), 0.4), ("prefix LM", (0.8, 0.6), 0.2),
                    ("encoder-decoder", (0.9,), 0.1))}},
        "attention_variants_stability_default": {
            "lrs": [0.01, 0.1], "results": {name: {
                "0.01": [{"eval_loss": 2.0, "diverged": False}],
                "0.1": [{"eval_loss": high, "diverged": high > 3}]} for name, high in (
                    ("baseline", 3.5), ("qk_norm", 2.2))}},
        "attention_variants_window_tiny": {"results": {}},
    }
    for name, payload in payloads.items():
        command = f"python -m experiments.{name.rsplit('_', 1)[0]}"
        (folder / f"{name}.json").write_text(json.dumps({"command": command, **payload}))
        (folder / f"{name}.md").write_text(f"Command: `{command}`\n\n| FAKE {name} |")
    (folder / "synthetic_generalisation_default.png").write_bytes(b"\x89PNG fake")


def test_run_all_rebuilds_the_readme_from_results(tmp_path):
    from experiments import run_all

    results = tmp_path / "results"
    results.mkdir()
    _fake_results(results)
    readme = tmp_path / "README.md"
    assert run_all.main(["--rebuild-only", "--results", str(results),
                         "--readme", str(readme)]) == 0
    text = readme.read_text()
    for exp in run_all.EXPERIMENTS:
        assert f". {exp.title}" in text and exp.published[:40] in text
    assert "| FAKE synthetic_generalisation_default |" in text
    assert "![synthetic_generalisation (default)](results/synthetic_generalisation_default.png)" \
        in text
    # the findings are computed from the JSON
    assert "none 0.25" in text  # mean exact match over lengths 3-4
    assert ("Trained at 4: at 8 tokens (2x) the loss changes by alibi +0.010 [+0.000, +0.020]"
            ", none +0.200") in text
    assert "alibi degrades less than rope: as published" in text
    assert "Warning: none do not beat the 3-gram (2.200)" in text
    assert "yarn zero-shot better than no scaling: as published (-1.600 [-1.700, -1.500]" in text
    assert "yarn better than linear after the fine-tune: inconclusive (-0.100 [-0.300, +0.100]" \
        in text
    assert "lstm: truncating beyond b=4 costs +20%, beyond b=16 less than 1% (+0.5%)" in text
    assert "gpt: it still uses context beyond b=16" in text
    assert "shuffling the context beyond b=16 still costs +5.0% [+1.0, +9.0]" in text
    assert "lstm: truncating beyond b=4 costs +20%" in text and (
        "shuffling's effect is inconclusive at every boundary" in text)
    assert "The transformer uses more distant context than the LSTM (truncation costs over " \
        "1%: transformer beyond b=16, LSTM beyond b=4), as expected" in text
    assert "this one stops using context within 4-16 tokens" in text
    assert "GQA-2 is within 2% of MHA's loss" in text
    assert "The prefix LM beats the causal LM" in text
    assert "The seeds disagree (prefix LM exact match per seed 0.800, 0.600)" in text
    assert "QK-norm lowers the high-rate loss" in text and "baseline at lr 0.1" in text
    for name in ("length_extrapolation", "rope_extension", "context_usage",
                 "attention_variants_heads"):
        assert f"| FAKE {name}_default |" in text
    # missing results say how to produce them; tiny results are never shown
    assert "Not run yet: `python -m experiments.attention_variants --part window`" in text
    assert "FAKE attention_variants_window_tiny" not in text
    assert text.count("Not run yet") == 1
    # a caveat under the one section trained on unshuffled rows, and only there
    assert text.count(run_all.UNSHUFFLED_CAVEAT) == 1
    assert run_all.UNSHUFFLED_CAVEAT in text[text.index("## 4."):text.index("## 5.")]


def test_findings_read_the_paired_intervals_and_the_passkey_control():
    """Results with paired intervals: GQA is an equivalence claim (within 2% of MHA's loss),
    MQA and the stability variants sign claims, and passkey beyond L is read only when the
    positive control passed."""
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
    stability = {"lrs": [0.01, 0.1], "results": {name: {
        "0.01": [{"eval_loss": 2.0, "diverged": False}],
        "0.1": [{"eval_loss": high, "diverged": False}]} for name, high in (
            ("baseline", 2.5), ("qk_norm", 2.2))},
        "comparisons": {"qk_norm - baseline @ 0.1": iv(-0.3, 0.1),
                        "qk_norm - baseline @ 0.01": iv(float("nan"), 0.0)}}
    text = run_all.finding_attention_stability(stability)
    assert "qk_norm at lr 0.1 -0.300 [-0.400, -0.200] nats: as published" in text
    def copy_runs(exact_at_3):  # train_max 2: lengths 3-4 are the near test lengths
        return [{"exact": {"1": 1.0, "2": 1.0, "3": x, "4": x / 2}} for x in exact_at_3]

    synthetic = {"train_max": 2, "test_max": 4, "results": {"gpt": {"copy": {
        "t5": copy_runs((0.9, 0.8, 0.85)), "rope": copy_runs((0.1, 0.2, 0.1)),
        "alibi": copy_runs((0.5, 0.1, 0.9))}}}}
    text = run_all.finding_synthetic_generalisation(synthetic)
    assert "t5 better than rope: as published (+0.538 [" in text
    assert "alibi better than rope: inconclusive" in text  # one seed below rope
    assert "Caveat" not in text  # every run fits lengths 1-2
    synthetic["results"]["gpt"]["copy"]["rope"][1]["exact"]["2"] = 0.5  # one seed: 0.75 on 1-2
    synthetic["results"]["gpt"]["copy"]["rope"][2]["exact"]["1"] = 0.0  # another: 0.5
    text = run_all.finding_synthetic_generalisation(synthetic)
    assert "Caveat: rope did not fit" in text and "rope 2 of 3)" in text
    window = {"seq_len": 64, "results": {str(w): {"window": w, "full": w == 64, "runs": [
        {"eval_loss": loss}]} for w, loss in ((4, 1.6), (16, 1.5), (64, 1.5))},
        "comparisons": {"4 - full": iv(0.1, 0.05), "16 - full": iv(0.0, 0.02)}}
    text = run_all.finding_attention_window(window)
    assert "window 4 +0.100 [+0.050, +0.150] nats: as published" in text
    assert "window 16 +0.000 [-0.020, +0.020] nats: inconclusive" in text
    assert "falls as the window grows" not in text and "No window" not in text
    window["comparisons"]["4 - full"] = iv(-0.004, 0.01)
    assert "No window from 4 keys on costs a measurable loss" in \
        run_all.finding_attention_window(window)
    prefix = {"task": {"name": "reverse", "train_max": 12, "steps": 600}, "results": {
        name: {"runs": [{"exact_match": 1.0, "eval_loss": loss}]} for name, loss in (
            ("causal LM", 0.011), ("prefix LM", 0.004), ("encoder-decoder", 0.002))}}
    text = run_all.finding_attention_prefix(prefix)
    assert "Every model solves the task at this budget" in text and "beats" not in text

    def grid(hit):
        return {str(n): {"0.5": [hit, hit]} for n in (16, 64)}

    rope = {"train_len": 16, "eval_len": 64, "fine_tune_steps": 4, "loss_at_train_len": [2.0],
            "multiples": [1, 4], "passkey": {"control_passed_by_seed": [False]},
            "references": {"zero_shot": "none", "fine_tuned": None},
            "results": {k: [{"zero_shot": 2.0, "fine_tuned": 2.0, "zero_shot_passkey": grid(0.0),
                             "fine_tuned_passkey": grid(0.0)}] for k in ("none", "yarn")}}
    text = run_all.finding_rope_extension(rope)
    assert "Passkey retrieval is not measurable at this scale: the positive control failed " \
        "(the unscaled model retrieves 0% of keys at its training length 16)" in text
    del rope["references"]  # written before they were stored: the same rule finds them
    assert run_all.finding_rope_extension(rope) == text
    rope["passkey"]["control_passed_by_seed"] = [True]
    for runs in rope["results"].values():
        runs[0]["zero_shot_passkey"] = runs[0]["fine_tuned_passkey"] = grid(1.0)
    text = run_all.finding_rope_extension(rope)
    assert "Passkey retrieval (control: 100% at L=16) at 64 tokens: none 100% zero-shot" in text


def test_length_finding_refuses_results_without_the_sweep():
    """Results of one training length without intervals are not read by threshold rules: the
    finding asks for a re-run."""
    from experiments import run_all

    old = {"train_len": 64, "lengths": [64, 512], "unigram_loss": 3.2,
           "results": {"alibi": [{"flat": {"64": 2.0, "512": 2.0}, "sliding": {}}]}}
    assert "re-run python -m experiments.length_extrapolation" in \
        run_all.finding_length_extrapolation(old)


def test_findings_give_no_verdict_without_paired_intervals():
    """Context usage without shuffle intervals and synthetic results whose seeds do not pair
    get no threshold verdict on means: the finding asks for a re-run (with intervals they are
    read, above)."""
    from experiments import run_all

    effects = {f"{kind}/{b}": 0.05 for kind in ("truncate", "shuffle") for b in (5, 10)}
    usage = {"units": "bytes", "boundaries": [5, 10],
             "results": {"gpt": [{"base": 1.5, **effects}]}}
    text = run_all.finding_context_usage(usage)
    assert "word order is not judged: re-run python -m experiments.context_usage" in text
    assert "order used" not in text
    synthetic = {"train_max": 2, "test_max": 4, "results": {"gpt": {"copy": {
        "t5": [{"exact": {"1": 1.0, "2": 1.0, "3": 0.9, "4": 0.5}}] * 2,
        "rope": [{"exact": {"1": 1.0, "2": 1.0, "3": 0.1, "4": 0.0}}]}}}}  # unpaired seeds
    text = run_all.finding_synthetic_generalisation(synthetic)
    assert "t5 vs rope: no paired interval in these results (re-run" in text
    assert "as published" not in text.split("Published")[0]


def test_run_all_runs_each_experiment_as_its_own_command(tmp_path, monkeypatch):
    from experiments import run_all

    calls = []
    monkeypatch.setattr(run_all.subprocess, "call",
                        lambda cmd, cwd, env: calls.append((cmd[1:], env)) or 0)
    readme = tmp_path / "README.md"
    assert run_all.main(["--only", "attention_variants,context_usage", "--scale", "tiny",
                         "--results", str(tmp_path), "--readme", str(readme)]) == 0
    assert [c[0] for c in calls] == [
        ["-m", "experiments.context_usage", "--scale", "tiny"],
        ["-m", "experiments.attention_variants", "--scale", "tiny"]]
    assert all(env["TJAX_RESULTS_DIR"] == str(tmp_path) for _, env in calls)
    assert readme.exists()
    calls.clear()  # --workers reaches only the experiments that train in parallel processes
    assert run_all.main(["--only", "length_extrapolation,context_usage", "--scale", "tiny",
                         "--results", str(tmp_path), "--readme", str(readme),
                         "--workers", "2"]) == 0
    assert [c[0] for c in calls] == [  # (context_usage finished above: skipped)
        ["-m", "experiments.length_extrapolation", "--scale", "tiny", "--workers", "2"]]


def test_run_all_replot_replots_what_it_finds_then_the_readme(tmp_path, monkeypatch, capsys):
    from experiments import run_all

    calls = []
    monkeypatch.setattr(run_all.subprocess, "call",
                        lambda cmd, cwd, env, stdout: calls.append(cmd[1:]) or 0)
    for name in ("length_extrapolation_tiny", "attention_variants_window_tiny",
                 "attention_variants_heads_tiny", "context_usage_default"):
        (tmp_path / f"{name}.json").write_text("{}")
    readme = tmp_path / "README.md"
    assert run_all.main(["--replot", "--scale", "tiny", "--results", str(tmp_path),
                         "--readme", str(readme)]) == 0
    assert calls == [  # only what has tiny results, attention_variants only its parts found
        ["-m", "experiments.length_extrapolation", "--scale", "tiny", "--replot"],
        ["-m", "experiments.attention_variants", "--scale", "tiny", "--replot",
         "--part", "heads,window"]]
    assert readme.exists() and "nothing to replot" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run_all.main(["--replot", "--rebuild-only", "--results", str(tmp_path)])


def test_run_all_skips_experiments_it_finished(tmp_path, monkeypatch):
    from experiments import run_all

    calls, rcs = [], {"experiments.context_usage": 0, "experiments.attention_variants": 1}
    monkeypatch.setattr(run_all.subprocess, "call",
                        lambda cmd, cwd, env: calls.append(cmd[2]) or rcs[cmd[2]])
    argv = ["--only", "attention_variants,context_usage", "--scale", "tiny",
            "--results", str(tmp_path), "--readme", str(tmp_path / "README.md")]
    assert run_all.main(argv) == 1  # attention_variants failed
    assert run_all.main(argv) == 1  # an interrupted/failed run_all continues where it stopped
    assert calls == ["experiments.context_usage", "experiments.attention_variants",
                     "experiments.attention_variants"]
    calls.clear()
    run_all.main([*argv, "--fresh"])
    assert calls == ["experiments.context_usage", "experiments.attention_variants"]


def test_attention_statistics_of_uniform_attention():
    """With zero query and key projections every causal query spreads its weight evenly over
    its prefix: entropy log(q + 1) and mean distance q / 2 at query q (0-based), averaged over
    the T queries; a layer and a head each, as the model has."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from experiments.attention_maps import attention_statistics
    from transformers_jax import ModelConfig
    from transformers_jax.models import build_model

    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_len=8,
                      position="rope", attention="chunked", dropout=0.0)
    model = build_model(cfg)
    tokens = np.arange(16).reshape(2, 8) % 32
    params = model.init(jax.random.key(0), tokens)["params"]
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if any(getattr(k, "key", None) in ("query", "key")
                                                  for k in path) else x, params)
    got = attention_statistics(model, params, tokens)
    assert got["length"] == 8 and np.shape(got["entropy"]) == np.shape(got["distance"]) == (2, 2)
    entropy = np.mean([math.log(q + 1) for q in range(8)])
    np.testing.assert_allclose(got["entropy"], entropy, rtol=1e-5)
    np.testing.assert_allclose(got["distance"], np.mean([q / 2 for q in range(8)]), rtol=1e-5)
    # ALiBi's slopes pull the weight toward the query: shorter distance, lower entropy
    alibi = build_model(cfg.replace(position="alibi"))
    near = attention_statistics(alibi, params, tokens)
    assert np.all(np.array(near["distance"]) < np.mean([q / 2 for q in range(8)]))
