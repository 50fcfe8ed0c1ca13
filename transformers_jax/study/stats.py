"""Paired differences over seeds and held-out chunks, their intervals and p-values, and Holm's
correction over a sweep's declared comparisons.

A comparison scores two cells on the same held-out tokens with the same seeds, so its unit is
the difference ``d[s, c]`` for seed ``s`` and held-out chunk ``c`` (a fixed block of the
held-out stream, the same for every cell and length). Two intervals for the mean of ``d`` are
computed, and a comparison's interval is the hull of both:

1. a two-level percentile bootstrap: each replicate draws S seeds and C chunks with
   replacement (the same chunks for every drawn seed, which keeps the pairing) and averages
   ``d`` over that grid: how much the answer depends on the held-out text drawn and the seeds;
2. Student's t over the S per-seed means (S - 1 degrees of freedom): with the 3-5 seeds a
   sweep affords, three values have ten distinct resamples, and only the t-quantile widens
   the interval for so few (about 4.3 standard errors at S = 3 against the normal's 1.96).

The hull excludes zero exactly when both do, so a comparison's p-value is the larger of the
two tests' (bootstrap: twice the smaller tail beyond zero; t: two-sided), and the interval
and the verdict never disagree. Holm's step-down procedure then holds the family-wise error
at 5% over every declared comparison: the i-th smallest p-value is tested at
``alpha / (m - i)``, and the interval shown is the one at that level (after the first
comparison that fails, at that failing level for all the rest).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import integrate as scipy_integrate
from scipy import optimize as scipy_optimize
from scipy import stats as scipy_stats

ALPHA = 0.05
N_BOOT = 10_000


@dataclass(frozen=True)
class Paired:
    """The paired differences ``d [S, C]`` of one comparison and its bootstrap replicates."""

    d_SC: np.ndarray
    boot: np.ndarray  # [n_boot] replicate means

    @property
    def mean(self) -> float:
        return float(self.d_SC.mean()) if self.d_SC.size else float("nan")

    @property
    def per_seed(self) -> np.ndarray:
        return self.d_SC.mean(axis=1)

    def p_value(self) -> float:
        """Two-sided: the larger of the bootstrap's and the t-test's (see the docstring)."""
        if not self.d_SC.size:
            return float("nan")
        n = self.boot.size
        tail = min((self.boot <= 0).sum(), (self.boot >= 0).sum())
        p = min(1.0, 2 * (tail + 1) / (n + 1))
        S = self.d_SC.shape[0]
        if S >= 2:
            sd = self.per_seed.std(ddof=1)
            if sd == 0:
                p_t = 0.0 if self.mean != 0 else 1.0
            else:
                t = abs(self.mean) / (sd / math.sqrt(S))
                p_t = float(2 * scipy_stats.t.sf(t, S - 1))
            p = max(p, p_t)
        return p

    def p_one_sided(self, bound: float, above: bool) -> float:
        """The p-value against ``mean <= bound`` (``above``: the test that it lies above) or
        ``mean >= bound``: the larger of the bootstrap's (the share of replicates on the
        null's side) and the t-test's over the seed means, as ``p_value``."""
        if not self.d_SC.size:
            return float("nan")
        n = self.boot.size
        tail = (self.boot <= bound).sum() if above else (self.boot >= bound).sum()
        p = min(1.0, (tail + 1) / (n + 1))
        S = self.d_SC.shape[0]
        if S >= 2:
            sd = self.per_seed.std(ddof=1)
            beyond = self.mean - bound if above else bound - self.mean
            if sd == 0:
                p_t = 0.0 if beyond > 0 else 1.0
            else:
                p_t = float(scipy_stats.t.sf(beyond / (sd / math.sqrt(S)), S - 1))
            p = max(p, p_t)
        return p

    def p_equivalence(self, margin: float) -> float:
        """Two one-sided tests (TOST) that the mean lies within ``(-margin, margin)``: the
        larger of their p-values. At level alpha it rejects exactly where the ``1 - 2 alpha``
        interval (``interval(2 * alpha)``) lies inside the margins, up to the bootstrap's
        add-one."""
        return max(self.p_one_sided(-margin, above=True), self.p_one_sided(margin, above=False))

    def interval(self, alpha: float = ALPHA) -> tuple[float, float]:
        """The hull of the bootstrap and t intervals at level ``1 - alpha``."""
        if not self.d_SC.size:
            return float("nan"), float("nan")
        low, high = np.percentile(self.boot, [100 * alpha / 2, 100 * (1 - alpha / 2)])
        S = self.d_SC.shape[0]
        if S >= 2:
            half = (scipy_stats.t.ppf(1 - alpha / 2, S - 1) * self.per_seed.std(ddof=1)
                    / math.sqrt(S))
            low, high = min(low, self.mean - half), max(high, self.mean + half)
        return float(low), float(high)


def paired(d_SC, n_boot: int = N_BOOT, seed: int = 0) -> Paired:
    """``Paired`` for differences ``d_SC`` [seeds, chunks] (1-D: one seed). Chunks where any
    seed is NaN (not scored there) are dropped for all seeds."""
    d = np.asarray(d_SC, np.float64)
    if d.ndim == 1:
        d = d[None]
    d = d[:, ~np.isnan(d).any(axis=0)]
    S, C = d.shape
    if C == 0:
        return Paired(d, np.zeros(0))
    rng = np.random.default_rng(seed)
    seeds_BS = rng.integers(0, S, (n_boot, S))
    chunks_BC = rng.integers(0, C, (n_boot, C))
    weights_BC = np.zeros((n_boot, C))
    np.add.at(weights_BC, (np.arange(n_boot)[:, None], chunks_BC), 1.0 / C)
    seed_means_BS = weights_BC @ d.T  # each seed's mean over the drawn chunks
    boot = np.take_along_axis(seed_means_BS, seeds_BS, axis=1).mean(axis=1)
    return Paired(d, boot)


def holm(p_values: Sequence[float], alpha: float = ALPHA) -> tuple[list[float], list[float]]:
    """Holm's adjusted p-values and the level each comparison's interval is drawn at (its
    ``alpha`` share: ``alpha / (m - i)`` for the i-th smallest p, fixed at the first one that
    fails). NaN p-values (nothing scored) stay NaN and do not count in ``m``."""
    p = np.asarray(p_values, np.float64)
    valid = np.flatnonzero(~np.isnan(p))
    order = valid[np.argsort(p[valid], kind="stable")]
    m = len(order)
    adjusted = [float("nan")] * len(p)
    levels = [float("nan")] * len(p)
    running, failed_at = 0.0, None
    for i, k in enumerate(order):
        running = max(running, min(1.0, (m - i) * p[k]))
        adjusted[k] = running
        if failed_at is None and p[k] >= alpha / (m - i):
            failed_at = alpha / (m - i)
        levels[k] = failed_at if failed_at is not None else alpha / (m - i)
    return adjusted, levels


def t_power(effect: float, sd_seed: float, seeds: int, alpha: float = ALPHA) -> float:
    """The probability that a two-sided t-test over ``seeds`` per-seed mean differences
    (``seeds - 1`` degrees of freedom) rejects at ``alpha`` when the true difference is
    ``effect`` and the seeds' differences spread by ``sd_seed``: the noncentral t's mass
    beyond the critical values. The sweep's test asks the bootstrap too (its p-value is the
    larger), so this is the t-test's share of it: with few seeds, what decides."""
    if seeds < 2 or sd_seed <= 0:
        return float("nan")
    df = seeds - 1
    critical = scipy_stats.t.ppf(1 - alpha / 2, df)
    shift = abs(effect) / (sd_seed / math.sqrt(seeds))

    fast = scipy_stats.nct.sf(critical, df, shift) + scipy_stats.nct.cdf(-critical, df, shift)
    if math.isfinite(fast):
        return float(min(1.0, fast))

    # scipy's noncentral t gives NaN far in its tails at 2 degrees of freedom: T = (Z + shift)
    # / sqrt(V / df), V ~ chi2(df), integrated over V
    def rejects_given(v: float) -> float:
        c = critical * math.sqrt(v / df)
        return scipy_stats.chi2.pdf(v, df) * (scipy_stats.norm.cdf(shift - c)
                                              + scipy_stats.norm.cdf(-shift - c))

    return float(min(1.0, scipy_integrate.quad(rejects_given, 0, math.inf, limit=200)[0]))


def detectable_effect(sd_seed: float, seeds: int, alpha: float = ALPHA,
                      power: float = 0.8) -> float:
    """The smallest true difference ``t_power`` detects with probability ``power``."""
    if seeds < 2 or sd_seed <= 0:
        return float("nan")
    se, high = sd_seed / math.sqrt(seeds), sd_seed
    while t_power(high, sd_seed, seeds, alpha) < power:
        high *= 1.5
    return float(scipy_optimize.brentq(
        lambda effect: t_power(effect, sd_seed, seeds, alpha) - power, 1e-9 * se, high))


def equivalence_verdict(low: float, high: float, margin: float) -> str:
    """Plain words for an equivalence claim's ``1 - 2 alpha`` interval against its margin."""
    if math.isnan(low) or math.isnan(high):
        return "not scored"
    if -margin < low and high < margin:
        return f"equivalent within ±{margin:g}"
    return f"not shown equivalent within ±{margin:g}"


def verdict(low: float, high: float, a: str, b: str, better: str) -> str:
    """Plain words for the interval of ``a - b``: which is better, or inconclusive."""
    if math.isnan(low) or math.isnan(high):
        return "not scored"
    if low <= 0 <= high:
        return "inconclusive"
    a_higher = low > 0
    return f"{a if a_higher == (better == 'higher') else b} better"


def block_means(values_N, block: int) -> np.ndarray:
    """Mean of the scored (non-NaN) values in each block of ``block`` positions (the held-out
    chunks); NaN for a block with nothing scored. The last partial block is dropped so every
    chunk weighs the same."""
    x = np.asarray(values_N, np.float64)
    n = x.size // block
    if n == 0:
        raise ValueError(f"{x.size} positions is less than one chunk of {block}")
    x = x[: n * block].reshape(n, block)
    scored = (~np.isnan(x)).sum(axis=1)
    with np.errstate(invalid="ignore"):
        return np.where(scored > 0, np.nansum(x, axis=1) / np.maximum(scored, 1), np.nan)
