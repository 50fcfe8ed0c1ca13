"""The attention-variants experiment (MHA vs GQA vs MQA) runs end to end at a tiny scale,
writing its JSON, table and plot. (A file of its own: pytest-xdist hands out whole files.)"""

import json
import os

import pytest


@pytest.mark.slow
def test_attention_variants_heads_tiny(results_dir, assert_replots, capsys, monkeypatch):
    from experiments import attention_variants
    from transformers_jax.train import lane

    # the greedy text preview each run logs to TensorBoard at its evaluation is no part of
    # the experiment's results (a fifth of this test's time: a decode loop compiled per run)
    monkeypatch.setattr(lane, "_make_sampler", lambda *args: None)

    attention_variants.main(["--scale", "tiny", "--shuffle-rows", "32"])
    heads = json.loads((results_dir / "attention_variants_heads_tiny.json").read_text())
    # --shuffle-rows reaches every text run, and the result and its table say so
    runs = results_dir / ".cache" / "attention_variants" / "runs"
    trained = [json.loads((d / "tjax_config.json").read_text())["train"] for d in runs.iterdir()]
    assert trained and {t["shuffle_rows"] for t in trained} == {32}
    assert heads["shuffle_rows"] == 32
    assert "training rows shuffled in windows of 32" in (
        results_dir / "attention_variants_heads_tiny.md").read_text()
    assert list(heads["results"]) == ["MHA", "GQA-2", "MQA"]
    # the decode speeds say on how many cores they were timed
    assert heads["decode_cores"] == len(os.sched_getaffinity(0))
    assert f"on {heads['decode_cores']} CPU core(s)" in (
        results_dir / "attention_variants_heads_tiny.md").read_text()
    kv_bytes = [r["kv_cache_bytes_per_token"] for r in heads["results"].values()]
    assert kv_bytes[0] == 2 * kv_bytes[1] == 4 * kv_bytes[2]
    params = [r["runs"][0]["params"] for r in heads["results"].values()]
    assert params[0] > params[1] > params[2]  # fewer k/v projections
    for r in heads["results"].values():
        assert r["decode"]["batch_2"]["decode_tokens_per_s"] > 0
        assert 0 < r["runs"][0]["eval_loss"] < 10
    assert set(heads["comparisons"]) == {"GQA-2 - MHA", "MQA - MHA"}

    # --replot rebuilds the table and plot from the JSON alone; --part heads, the committed
    # results' command, still names this run
    assert_replots(attention_variants, "attention_variants_heads_tiny", ["--scale", "tiny"])
    assert_replots(attention_variants, "attention_variants_heads_tiny",
                   ["--scale", "tiny", "--part", "heads"])
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a retired part says where it went
        attention_variants.main(["--scale", "tiny", "--part", "window"])
    assert "experiments/specs/attention_variants.toml" in capsys.readouterr().err
