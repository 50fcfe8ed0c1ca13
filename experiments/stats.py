"""Paired differences with 95% intervals, and the verdict a finding may state.

Every comparison here is *paired*: two conditions (scheme A vs baseline B at one length, or
one scheme at length L vs its training length) are scored on the same held-out tokens with
the same seeds, so the unit of analysis is the difference ``d[s, c]`` for seed ``s`` and
held-out chunk ``c`` (a fixed block of the held-out stream, the same for every condition).
Contrasts of contrasts ("A degrades less than B") are differences of such arrays.

The interval (``paired_interval``) is the wider of two 95% intervals for the mean of ``d``:

1. a two-level percentile bootstrap: each replicate draws S seeds with replacement and C chunk
   indices with replacement (the *same* chunk indices for every drawn seed, which keeps the
   pairing across seeds) and averages ``d`` over that grid. It captures how much the answer
   depends on which held-out text was drawn, and the seed-to-seed spread.
2. a Student-t interval over the S per-seed mean differences (S - 1 degrees of freedom).

Why both: with the 3-5 seeds an experiment can afford, a bootstrap over seeds alone is too
narrow (three values have ten distinct resamples, and the percentile interval ignores the
t-quantile's small-sample widening: about 4.3 vs 1.96 standard errors at S = 3). The
t-interval treats per-seed means (each an average over ~10^5 tokens, so near normal) honestly,
while the bootstrap covers a single seed or a case where chunk variation dominates. Taking
the wider is conservative: a finding that survives both is one a reviewer can accept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from transformers_jax.study.stats import block_means  # noqa: F401  (the experiments' import)

AS_PUBLISHED, UNLIKE, INCONCLUSIVE = "as published", "unlike the paper", "inconclusive"


@dataclass(frozen=True)
class Interval:
    mean: float  # mean of d over seeds and chunks
    low: float
    high: float
    per_seed: tuple[float, ...]  # each seed's mean difference
    method: str  # which interval was the wider: "bootstrap" or "t"

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    @classmethod
    def from_dict(cls, d: dict) -> Interval:
        """The interval ``as_dict`` stored (older results lack ``per_seed`` and ``method``)."""
        return cls(d["mean"], d["low"], d["high"], tuple(d.get("per_seed", ())),
                   d.get("method", ""))

    def as_dict(self) -> dict:
        return {"mean": self.mean, "low": self.low, "high": self.high,
                "per_seed": list(self.per_seed), "method": self.method}

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def t_quantile_975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (scipy if present)."""
    try:
        from scipy.stats import t

        return float(t.ppf(0.975, df))
    except ImportError:  # table for the seed counts used here, normal beyond
        table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365,
                 8: 2.306, 9: 2.262, 10: 2.228}
        return table.get(df, 1.96 + 2.4 / df)


def paired_interval(diff_SC, n_boot: int = 2000, seed: int = 0) -> Interval:
    """95% interval for the mean of paired differences ``diff_SC`` [seeds, chunks] (see the
    module docstring). NaN chunks (a condition not scored there) are dropped for all seeds."""
    d = np.asarray(diff_SC, np.float64)
    if d.ndim == 1:
        d = d[None]
    d = d[:, ~np.isnan(d).any(axis=0)]
    S, C = d.shape
    if C == 0:
        nan = float("nan")
        return Interval(nan, nan, nan, tuple([nan] * S), "none")
    per_seed = d.mean(axis=1)
    mean = float(per_seed.mean())
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, S, (n_boot, S))
    chunks = rng.integers(0, C, (n_boot, C))
    # mean over the drawn grid = mean over drawn seeds of each seed's mean over drawn chunks
    boot = np.empty(n_boot)
    for b in range(n_boot):
        boot[b] = d[seeds[b]][:, chunks[b]].mean()
    low, high = np.percentile(boot, [2.5, 97.5])
    method = "bootstrap"
    if S >= 2:
        half = t_quantile_975(S - 1) * per_seed.std(ddof=1) / math.sqrt(S)
        if 2 * half > high - low:
            low, high, method = mean - half, mean + half, "t"
    return Interval(mean, float(low), float(high), tuple(float(x) for x in per_seed), method)


def verdict(interval: Interval, published_sign: int) -> str:
    """"as published" when the interval excludes zero on the side the paper reports
    (``published_sign`` +1: the paper finds d > 0, -1: d < 0), "unlike the paper" when it
    excludes zero on the other side, else "inconclusive"."""
    if published_sign not in (-1, 1):
        raise ValueError(f"published_sign={published_sign}: use +1 or -1")
    if math.isnan(interval.mean) or not interval.excludes_zero():
        return INCONCLUSIVE
    return AS_PUBLISHED if (interval.mean > 0) == (published_sign > 0) else UNLIKE
