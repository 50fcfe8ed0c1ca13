"""Paired intervals and verdicts on synthetic numbers whose answers are known."""

import math

import numpy as np
import pytest

from experiments.stats import (
    AS_PUBLISHED,
    INCONCLUSIVE,
    UNLIKE,
    Interval,
    block_means,
    paired_interval,
    t_quantile_975,
    verdict,
)


def test_t_interval_over_seeds_when_seeds_disagree():
    # per-seed means 1, 2, 3 (chunks identical within a seed): mean 2, sd 1, so the t interval
    # is 2 +- 4.303 / sqrt(3) = 2 +- 2.484; the bootstrap over {1, 2, 3} is narrower
    d = np.repeat(np.array([[1.0], [2.0], [3.0]]), 50, axis=1)
    iv = paired_interval(d)
    assert iv.method == "t" and iv.mean == pytest.approx(2.0)
    assert (iv.low, iv.high) == pytest.approx((2 - 2.484, 2 + 2.484), abs=2e-3)
    assert iv.per_seed == pytest.approx((1.0, 2.0, 3.0))
    assert t_quantile_975(2) == pytest.approx(4.303, abs=1e-3)


def test_bootstrap_over_chunks_when_seeds_agree():
    # every seed sees the same chunk differences (seed spread 0): the interval is the chunk
    # bootstrap, close to mean +- 1.96 sd/sqrt(C)
    rng = np.random.default_rng(0)
    chunks = 0.05 + 0.1 * rng.standard_normal(400)
    d = np.tile(chunks, (3, 1))
    iv = paired_interval(d, n_boot=4000)
    assert iv.method == "bootstrap"
    se = chunks.std() / math.sqrt(chunks.size)
    assert iv.low == pytest.approx(chunks.mean() - 1.96 * se, abs=0.3 * se)
    assert iv.high == pytest.approx(chunks.mean() + 1.96 * se, abs=0.3 * se)


def test_coverage_of_a_true_zero_is_about_95_percent():
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(200):
        d = rng.standard_normal((3, 1))[:, :] * 0.02 + 0.01 * rng.standard_normal((3, 40))
        hits += not paired_interval(d, n_boot=300, seed=int(rng.integers(1 << 30))).excludes_zero()
    assert 0.9 <= hits / 200 <= 1.0  # conservative by design, never anti-conservative


def test_nan_chunks_are_dropped_for_every_seed():
    d = np.array([[1.0, np.nan, 1.0], [1.0, 5.0, 1.0]])
    assert paired_interval(d).mean == 1.0


@pytest.mark.parametrize(("low", "high", "sign", "want"), [
    (0.1, 0.3, +1, AS_PUBLISHED), (0.1, 0.3, -1, UNLIKE), (-0.3, -0.1, -1, AS_PUBLISHED),
    (-0.3, -0.1, +1, UNLIKE), (-0.1, 0.3, +1, INCONCLUSIVE), (-0.3, 0.1, -1, INCONCLUSIVE)])
def test_verdict_needs_the_interval_to_exclude_zero(low, high, sign, want):
    iv = Interval((low + high) / 2, low, high, (), "t")
    assert verdict(iv, sign) == want


def test_block_means_average_scored_positions_and_drop_the_tail():
    x = np.array([1.0, np.nan, 3.0, np.nan, np.nan, np.nan, 5.0])
    out = block_means(x, 3)
    assert out[0] == 2.0 and math.isnan(out[1]) and out.size == 2
