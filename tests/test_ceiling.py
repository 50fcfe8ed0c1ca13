"""benchmarks/ceiling.py: the FLOPs a side-by-side shape's step must do, worked by hand, and the
arithmetic that turns peaks and measured speeds into shares of the peak. Nothing here is timed
(the matmul worker runs once at a toy size, and only its output's form is checked)."""

from __future__ import annotations

import pytest
from benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def ceiling():
    return load_benchmark("ceiling")


def test_needed_flops_of_config_a_by_hand(ceiling):
    flops = ceiling.needed_flops_per_token(ceiling.SHAPES["a"])
    # weights: 4 layers x 12 x 128^2 + the 128 x 65 head = 794,752 multiply-adds per token
    assert flops["weights"] == 6 * 794_752
    # attention: 4 layers x 2 products x 256 keys x 128 = 262,144; causal sees 257/512 of it
    assert flops["attention_full"] == 6 * 262_144
    assert flops["attention_visible"] == 6 * 131_584
    assert flops["needed"] == 5_558_016
    assert flops["palm_convention"] == 6_341_376  # issue 17's "6.34 MFLOP/token"


def test_palm_convention_matches_the_library_count(ceiling):
    from transformers_jax.bench import DEFAULT_MODEL
    from transformers_jax.train.flops import flops_per_token

    shape = ceiling.SHAPES["a"]  # config a: tjax bench's default model
    assert ceiling.needed_flops_per_token(shape)["palm_convention"] == pytest.approx(
        flops_per_token(DEFAULT_MODEL, shape["train_len"]), rel=1e-12)


def test_bert_sees_every_key_and_has_a_head_transform(ceiling):
    from transformers_jax.bench import DEFAULT_MODEL
    from transformers_jax.train.flops import flops_per_token

    shape = ceiling.SHAPES["b"]
    flops = ceiling.needed_flops_per_token(shape)
    assert flops["attention_visible"] == flops["attention_full"]
    assert flops["weights"] == 6 * (4 * 12 * 128 ** 2 + 128 * 65 + 128 ** 2)
    bert = DEFAULT_MODEL.replace(family="bert", mask={"name": "bidirectional"})
    assert flops["palm_convention"] == pytest.approx(
        flops_per_token(bert, shape["train_len"]), rel=1e-12)


def test_shares_of_the_peak_and_what_targets_ask(ceiling):
    def speed(*rounds):
        return {"training_tokens_per_s": {"median": sorted(rounds)[len(rounds) // 2],
                                          "per_round": list(rounds)}}

    side_by_side = {"summary": {"per_contender": {
        "jax_float32": speed(12_000.0, 9_000.0, 13_000.0),
        "jax_bfloat16": speed(16_000.0, 15_000.0, 17_000.0),
        "jax_bfloat16_g2": speed(18_000.0, 17_000.0, 19_000.0),
        "torch": speed(10_000.0, 10_000.0, 8_000.0), "hf": speed(8_000.0, 7_000.0, 9_000.0)}}}
    runs = [{"library": "jax", "rates": {"float32": {"8": 100e9}, "bfloat16": {"8": 200e9}}},
            {"library": "torch", "rates": {"float32": {"8": 80e9}, "bfloat16": {"8": 150e9}}}]
    best = ceiling.machine_peak(ceiling.peaks_over_rounds(runs))
    assert best == {"float32": 100e9, "bfloat16": 200e9}
    out = ceiling.against_contenders(side_by_side, {"needed": 5e6}, best)
    assert out["fastest_pytorch"] == "torch"
    assert out["share_of_peak"]["torch"] == pytest.approx(10_000 * 5e6 / 100e9)
    assert out["share_of_peak"]["jax_bfloat16"] == pytest.approx(16_000 * 5e6 / 200e9)
    assert out["share_of_peak"]["jax_bfloat16_g2"] == pytest.approx(18_000 * 5e6 / 200e9)
    assert out["targets"]["jax_bfloat16_g2"]["measured_ratio"]["per_round"] == pytest.approx(
        [1.8, 1.7, 2.375])
    assert "measured_ratio" not in out["targets"]["jax_float32_g2"]  # not in this run
    f32, bf16 = out["targets"]["jax_float32"], out["targets"]["jax_bfloat16"]
    # float32 ceiling 100e9 / 5e6 = 20k tokens/s: 2x torch; 1.5x torch needs 15k of it
    assert f32["ceiling_ratio"] == pytest.approx(2.0)
    assert f32["share_of_peak_needed"] == pytest.approx(0.75)
    # the median of the per-round ratios 1.2, 0.9, 1.625 (not 12k / 10k of the medians)
    assert f32["measured_ratio"]["median"] == pytest.approx(1.2)
    assert f32["measured_ratio"]["min"] == pytest.approx(0.9)
    assert f32["measured_ratio"]["max"] == pytest.approx(1.625)
    # bfloat16 ceiling 40k tokens/s; 2x torch float32 needs 20k of it
    assert bf16["ceiling_ratio"] == pytest.approx(4.0)
    assert bf16["share_of_peak_needed"] == pytest.approx(0.5)
    assert bf16["measured_ratio"]["per_round"] == pytest.approx([1.6, 1.5, 2.125])


def test_without_a_pytorch_contender_no_target_is_judged(ceiling):
    side_by_side = {"summary": {"per_contender": {"jax_float32": {
        "training_tokens_per_s": {"median": 1.0, "per_round": [1.0]}}}}}
    out = ceiling.against_contenders(side_by_side, {"needed": 1.0},
                                     {"float32": 2.0, "bfloat16": 4.0})
    assert out["targets"] is None and "no PyTorch contender" in out["note"]


def test_peaks_are_the_fastest_product_of_every_round(ceiling):
    runs = [{"library": "jax", "rates": {"float32": {"64": 1.0, "128": 3.0},
                                         "bfloat16": {"64": 2.0, "128": 5.0}},
             "products": {"float32": {"p": 3.5}, "bfloat16": {"p": 6.0}}},
            {"library": "torch", "rates": {"float32": {"64": 2.0}, "bfloat16": {"64": 4.0}}},
            {"library": "jax", "rates": {"float32": {"64": 4.0, "128": 2.0},
                                         "bfloat16": {"64": 1.0, "128": 1.0}}}]
    peaks = ceiling.peaks_over_rounds(runs)
    assert peaks["jax"]["float32"] == {"best": 4.0, "median": 3.75, "per_round": [3.5, 4.0]}
    assert peaks["jax"]["bfloat16"]["best"] == 6.0  # a product faster than any square
    assert peaks["torch"]["float32"]["per_round"] == [2.0]


def test_unknown_shape_kind_is_refused(ceiling):
    with pytest.raises(ValueError, match="kind 'lstm'"):
        ceiling.needed_flops_per_token({**ceiling.SHAPES["a"], "kind": "lstm"})


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "at least 1"),
    (["--sizes", "0,2048"], "positive square"),
    (["--side-by-side", "/no/such.json"], "--side-by-side"),
])
def test_bad_options_are_refused_with_the_fix(ceiling, argv, message, capsys):
    with pytest.raises(SystemExit):
        ceiling.main(argv)
    assert message in capsys.readouterr().err


def test_the_jax_worker_reports_a_rate_per_dtype_size_and_product(ceiling):
    out = ceiling.worker("jax", [32], repeats=1, products={"p": (16, 8, 24)})
    assert out["library"] == "jax"
    assert set(out["rates"]) == set(out["products"]) == {"float32", "bfloat16"}
    assert all(r["32"] > 0 for r in out["rates"].values())
    assert all(r["p"] > 0 for r in out["products"].values())


def test_dense_products_of_config_a_and_their_share_of_the_peak(ceiling):
    assert ceiling.dense_products(ceiling.SHAPES["a"]) == {
        "projection": (4096, 128, 128), "mlp_up": (4096, 128, 512),
        "mlp_down": (4096, 512, 128), "head": (4096, 128, 65)}
    runs = [{"library": "jax", "rates": {"float32": {"8": 10.0}, "bfloat16": {"8": 20.0}},
             "products": {"float32": {"p": 4.0}, "bfloat16": {"p": 5.0}}},
            {"library": "jax", "rates": {"float32": {"8": 8.0}, "bfloat16": {"8": 16.0}},
             "products": {"float32": {"p": 6.0}, "bfloat16": {"p": 4.0}}}]
    own = ceiling.products_over_rounds(runs, {"float32": 10.0, "bfloat16": 20.0})
    assert own["jax"]["float32"]["p"] == {"best": 6.0, "share_of_peak": 0.6}
    assert own["jax"]["bfloat16"]["p"] == {"best": 5.0, "share_of_peak": 0.25}
    assert "torch" not in own  # no PyTorch rounds: nothing reported for it
