"""The synthetic length-generalisation experiment runs end to end at a tiny scale and writes
its JSON, table and plot; and the pieces it rests on. (A file of its own: pytest-xdist hands
out whole files.)"""

import json
import math

import pytest


@pytest.mark.slow
def test_synthetic_generalisation_tiny(results_dir, monkeypatch, assert_replots):
    from experiments import synthetic_generalisation

    synthetic_generalisation.main(["--scale", "tiny"])
    out = json.loads((results_dir / "synthetic_generalisation_tiny.json").read_text())
    assert set(out["results"]) == {"gpt", "encdec"}
    assert (out["train_max"], out["test_max"]) == (4, 8)
    gpt = out["results"]["gpt"]["reverse"]
    assert set(gpt) == {"none", "learned"}
    none, learned = gpt["none"][0], gpt["learned"][0]
    assert set(none["exact"]) == {str(n) for n in range(1, 9)}  # every length scored
    assert all(0.0 <= v <= 1.0 for v in none["exact"].values())
    assert math.isnan(learned["exact"]["5"]) and not math.isnan(learned["exact"]["4"])
    encdec = out["results"]["encdec"]["reverse"]["t5"][0]
    assert not math.isnan(encdec["exact"]["8"])
    table = (results_dir / "synthetic_generalisation_tiny.md").read_text()
    assert table.startswith("Command: `python -m") and "n/a (beyond table)" in table
    assert (results_dir / "synthetic_generalisation_tiny.png").stat().st_size > 10_000
    # an interrupted or repeated run resumes from the cached runs: nothing trains again, and
    # the results read back are the same numbers
    monkeypatch.setattr(synthetic_generalisation, "train_and_load",
                        lambda *a: pytest.fail("retrained a cached run"))
    synthetic_generalisation.main(["--scale", "tiny"])
    again = json.loads((results_dir / "synthetic_generalisation_tiny.json").read_text())
    assert again["results"] == out["results"]
    assert_replots(synthetic_generalisation, "synthetic_generalisation_tiny", ["--scale", "tiny"])


def test_synthetic_generalisation_workers_split_the_runs_then_one_pass_reports(monkeypatch):
    """``--workers 2``: each worker gets the same arguments (less --workers) and its own shard
    of the runs; the reporting pass then reads the cache (FRESH off) and reports once."""
    from experiments import common, synthetic_generalisation

    calls = []
    monkeypatch.setattr(common, "run_workers", lambda module, argv, n: calls.append(
        ("workers", module, argv, n)) or monkeypatch.setattr(common, "READ_ONLY", True))
    monkeypatch.setattr(synthetic_generalisation, "run", lambda *a: calls.append(
        ("run", common.FRESH, a[-1])) or {"scale": "tiny"})
    monkeypatch.setattr(synthetic_generalisation, "report", lambda out: calls.append(("report",)))
    synthetic_generalisation.main(["--scale", "tiny", "--workers", "2", "--fresh"])
    assert calls == [("workers", "experiments.synthetic_generalisation",
                      ["--scale", "tiny", "--fresh"], 2), ("run", False, None), ("report",)]
    calls.clear()
    synthetic_generalisation.main(["--scale", "tiny", "--shard", "1/2"])  # a worker's own pass
    assert calls == [("run", False, (1, 2)), ("report",)]


def test_synthetic_generalisation_shards_cover_every_run_once(results_dir, monkeypatch):
    """Shards 0/2 and 1/2 together train each run exactly once and report nothing; the pass
    after them reads every run from the cache."""
    from experiments import synthetic_generalisation

    trained = []

    def fake(model_cfg, train_cfg, test_max, per_length, cache):
        trained.append((model_cfg.family, train_cfg.task, model_cfg.position.name,
                        train_cfg.seed))
        return {"train_loss": 0.0, "eval_loss": 0.0, "exact": {"1": 1.0},
                "token_accuracy": {"1": 1.0}}

    monkeypatch.setattr(synthetic_generalisation, "train_and_score", fake)
    assert synthetic_generalisation.run("tiny", shard=(0, 2)) is None
    first = list(trained)
    assert synthetic_generalisation.run("tiny", shard=(1, 2)) is None
    assert first and len(trained) > len(first) and len(set(trained)) == len(trained)
    out = synthetic_generalisation.run("tiny")
    assert len(trained) == 3  # gpt none, gpt learned, encdec t5 (tiny: 1 seed, reverse)
    assert sum(len(runs) for tasks in out["results"].values() for schemes in tasks.values()
               for runs in schemes.values()) == 3


def test_synthetic_exact_match_is_greedy_decoding():
    """The teacher-forced argmax over answer + eos is right exactly when greedy decoding
    reproduces the answer: score a random model on its own greedy continuation (all correct),
    then on that continuation with one token changed (wrong)."""
    import flax.linen as nn
    import jax
    import numpy as np

    from experiments.synthetic_generalisation import accuracy_of
    from transformers_jax import ModelConfig, build_model
    from transformers_jax.sample import SamplingConfig, generate

    model = build_model(ModelConfig(vocab_size=262, d_model=32, n_layers=1, n_heads=2))
    params = nn.meta.unbox(model.init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"])
    prompts = [[256, 97, 98, 99, 260], [256, 120, 121, 260]]  # [bos] prompt [sep]
    answers = generate(model, params, prompts, SamplingConfig(max_new_tokens=4, temperature=0))
    T = 10
    rows = {k: np.zeros((4, T), np.int32) for k in ("inputs", "targets", "segment_ids")}
    weights = np.zeros((4, T), np.float32)
    for i in range(4):
        prompt, answer = prompts[i % 2], list(answers[i % 2])
        if i >= 2:  # corrupt the last answer token
            answer[-1] = (answer[-1] + 1) % 256
        seq = prompt + answer
        rows["inputs"][i, : len(seq) - 1] = seq[:-1]
        rows["targets"][i, : len(seq) - 1] = seq[1:]
        rows["segment_ids"][i, : len(seq) - 1] = 1
        weights[i, len(prompt) - 1 : len(seq) - 1] = 1
    batch = {**rows, "weights": weights, "lengths": np.array([1, 2, 3, 4], np.int32)}
    exact, tokens = accuracy_of(model, params, batch, "gpt")
    assert exact == {1: 1.0, 2: 1.0, 3: 0.0, 4: 0.0}
    assert tokens[1] == 1.0 and tokens[3] == 0.75


def test_length_bins():
    from experiments.synthetic_generalisation import length_bins, summarise_bins

    assert length_bins(8, 32) == [(1, 8), (9, 10), (11, 12), (13, 14), (15, 16), (17, 24),
                                  (25, 32)]
    assert length_bins(20, 40) == [(1, 20), (21, 25), (26, 30), (31, 35), (36, 40)]
    assert summarise_bins({"1": 1.0, "2": 0.5, "3": 0.0, "4": float("nan")}, 2, 4) == {
        "1-2 (train)": 0.75, "3": 0.0, "4": pytest.approx(float("nan"), nan_ok=True)}
