"""The attention-variants experiment runs end to end at a tiny scale, each part writing its
JSON, table and plot. (A file of its own: pytest-xdist hands out whole files.)"""

import json
import os

import pytest

from transformers_jax.config import SHUFFLE_ROWS


@pytest.mark.slow
def test_attention_variants_heads_and_window_tiny(results_dir):
    from experiments import attention_variants

    attention_variants.main(["--scale", "tiny", "--part", "heads,window", "--shuffle-rows", "32"])
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
    window = json.loads((results_dir / "attention_variants_window_tiny.json").read_text())
    assert [r["window"] for r in window["results"].values()] == [4, 16]
    assert (results_dir / "attention_variants_window_tiny.png").exists()
    assert not (results_dir / "attention_variants_prefix_tiny.json").exists()


@pytest.mark.slow
def test_attention_variants_prefix_and_stability_tiny(results_dir, assert_replots):
    from experiments import attention_variants

    attention_variants.main(["--scale", "tiny", "--part", "prefix,stability"])
    prefix = json.loads((results_dir / "attention_variants_prefix_tiny.json").read_text())
    masks = {k: (v["family"], v["mask"]) for k, v in prefix["results"].items()}
    assert "shuffle_rows" not in prefix  # a synthetic task: its examples are independent
    assert masks == {"causal LM": ("gpt", "causal"), "prefix LM": ("gpt", "prefix"),
                     "encoder-decoder": ("encdec", "causal")}
    stability = json.loads((results_dir / "attention_variants_stability_tiny.json").read_text())
    assert list(stability["results"]) == ["baseline", "qk_norm", "softcap"]
    losses = {k: v["0.02"][0]["eval_loss"] for k, v in stability["results"].items()}
    assert losses["baseline"] != losses["qk_norm"]  # the switch changes the model
    assert stability["shuffle_rows"] == SHUFFLE_ROWS  # the library's default
    table = (results_dir / "attention_variants_stability_tiny.md").read_text()
    assert table.startswith("Command: `python -m") and "lr 0.02" in table

    # --replot rebuilds each part's table and plot from its JSON alone
    for part in ("prefix", "stability"):
        assert_replots(attention_variants, f"attention_variants_{part}_tiny",
                       ["--scale", "tiny", "--part", part])
    with pytest.raises(SystemExit):  # a part never run: says so rather than plotting nothing
        attention_variants.main(["--scale", "tiny", "--part", "heads", "--replot"])
