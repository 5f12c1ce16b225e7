"""SPEC 10's estimates over runs: mean, median, IQM, difference of means, probability of improvement.

Every estimate is a function of the per-run scores of one group in one stratum (two groups
for the between-group ones), and its interval comes from a percentile bootstrap over runs
(resample a group's runs with replacement, independently per group and stratum, as
rliable's ``StratifiedBootstrap`` / ``StratifiedIndependentBootstrap`` do).

Vectorized without sorting any resample: the scores of a group are sorted once, a
resample is a vector of multiplicities over those sorted runs (``counts``, shape
``(R, n)``), and each statistic is a closed form over the counts:

* mean = ``counts @ x / n``;
* order statistics: the resample's k-th smallest value is ``x[#(cum <= k)]`` with ``cum``
  the running count, so the median needs no sort;
* IQM (``scipy.stats.trim_mean(x, 0.25)``: the mean of sorted positions ``[lo, n - lo)``
  with ``lo = int(0.25 n)``): each sorted run contributes its value times the overlap of
  its positions ``[cum - c, cum)`` with ``[lo, n - lo)``;
* probability of improvement of X over Y (mean over pairs of ``1[x > y] + 0.5 1[x = y]``):
  with both groups' runs sorted, the number of Y draws below each X run is a running
  count of Y's multiplicities at a precomputed position, so each resample costs
  ``O(n_x + n_y)`` and the sums are exact integers (as halves) in float64.

Point estimates use the definitions directly (``np.mean``, ``np.median``,
``scipy.stats.trim_mean``, the pairwise count), so they equal rliable's
``aggregate_mean`` / ``aggregate_iqm`` / ``probability_of_improvement`` on one task.
Pure numpy, float64.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
from icsd_audit.stats.bootstrap import BootstrapResult

__all__ = ["STATISTICS", "IQM_CUT", "stream", "resample_counts", "point_statistics", "resampled_statistics",
           "improvement_probability", "resampled_improvement", "interval", "point_only", "iqm", "check_scores"]

#: Per-group statistics, in display order.
STATISTICS = ("mean", "median", "iqm")
#: The interquartile mean trims this share from each end (rliable's ``aggregate_iqm``).
IQM_CUT = 0.25


def stream(seed: int, *names: str) -> np.random.Generator:
    """A generator that depends only on the seed and the names (group label, stratum, statistic).

    So a group's interval in a stratum is the same whatever other groups, strata or
    runs the comparison holds (SPEC 7's one-interval-per-statistic rule, for runs).
    """
    words = [int(seed) & 0xFFFFFFFFFFFFFFFF]
    for name in names:
        words.append(int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little"))
    return np.random.default_rng(np.random.SeedSequence(words))


def resample_counts(n: int, n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Multiplicities ``(R, n)`` of ``n`` runs drawn with replacement ``n`` times, ``R`` times."""
    idx = rng.integers(0, n, size=(n_resamples, n))
    flat = idx + (np.arange(n_resamples, dtype=np.int64) * n)[:, None]
    return np.bincount(flat.ravel(), minlength=n_resamples * n).reshape(n_resamples, n).astype(np.float64)


def iqm(x: np.ndarray) -> float:
    """Interquartile mean, SPEC 10's ``scipy.stats.trim_mean(x, 0.25)``, by scipy's own steps (partition
    at the cut positions, mean of the kept slice), so the bits agree (tested) without importing
    ``scipy.stats`` (seconds of a command's start-up)."""
    a = np.asarray(x, dtype=np.float64).ravel()
    lo = int(IQM_CUT * a.size)
    hi = a.size - lo
    return float(np.mean(np.partition(a, (lo, hi - 1))[lo:hi]))


def point_statistics(x: np.ndarray) -> dict[str, float]:
    """Mean, median and IQM of one group's scores in one stratum."""
    x = np.asarray(x, dtype=np.float64)
    return {"mean": float(np.mean(x)), "median": float(np.median(x)), "iqm": iqm(x)}


def _order_statistic(xs: np.ndarray, cum: np.ndarray, k: int) -> np.ndarray:
    """Per resample, the k-th smallest (0-based) drawn value: ``xs[#(cum <= k)]``."""
    return xs[(cum <= k).sum(axis=1)]


def resampled_statistics(xs: np.ndarray, counts: np.ndarray) -> dict[str, np.ndarray]:
    """Mean, median and IQM of every resample; ``xs`` sorted ascending, ``counts`` ``(R, n)`` over it."""
    n = xs.shape[0]
    cum = np.cumsum(counts, axis=1)
    prev = cum - counts
    mean = counts @ xs / n
    if n % 2:
        median = _order_statistic(xs, cum, n // 2)
    else:
        median = (_order_statistic(xs, cum, n // 2 - 1) + _order_statistic(xs, cum, n // 2)) / 2.0
    lo = int(IQM_CUT * n)
    hi = n - lo
    overlap = np.clip(np.minimum(cum, hi) - np.maximum(prev, lo), 0.0, None)
    return {"mean": mean, "median": median, "iqm": overlap @ xs / (hi - lo)}


def improvement_probability(x: np.ndarray, y: np.ndarray) -> float:
    """P(X > Y): the mean over all pairs of ``1[x > y] + 0.5 * 1[x = y]`` (SPEC 10)."""
    x = np.asarray(x, dtype=np.float64)[:, None]
    y = np.asarray(y, dtype=np.float64)[None, :]
    return float(((x > y).sum() + 0.5 * (x == y).sum()) / (x.size * y.size))


def resampled_improvement(xs: np.ndarray, cx: np.ndarray, ys: np.ndarray, cy: np.ndarray) -> np.ndarray:
    """P(X > Y) of every resample pair; ``xs``/``ys`` sorted ascending, ``cx``/``cy`` their counts."""
    below = np.searchsorted(ys, xs, side="left")  # Y runs strictly below each X run
    upto = np.searchsorted(ys, xs, side="right")  # ... at or below it
    cum_y = np.concatenate([np.zeros((cy.shape[0], 1)), np.cumsum(cy, axis=1)], axis=1)
    less = cum_y[:, below]
    equal = cum_y[:, upto] - less
    return (cx * (less + 0.5 * equal)).sum(axis=1) / (xs.shape[0] * ys.shape[0])


def interval(estimate: float, reps: np.ndarray, *, confidence_level: float) -> BootstrapResult:
    """Percentile interval (NumPy's linear interpolation) and bootstrap standard error (ddof 1)."""
    reps = np.asarray(reps, dtype=np.float64)
    alpha = 1.0 - confidence_level
    lo, hi = np.percentile(reps, [100.0 * alpha / 2.0, 100.0 * (1.0 - alpha / 2.0)])
    se = float(np.std(reps, ddof=1)) if reps.size > 1 else float("nan")
    if reps.size > 1 and reps.min() == reps.max():
        se = 0.0
    return BootstrapResult(float(estimate), float(lo), float(hi), se, int(reps.size), float(confidence_level),
                           "percentile", "run")


def point_only(estimate: float, *, confidence_level: float) -> BootstrapResult:
    """An estimate without an interval (a group with one run: nothing to resample)."""
    nan = float("nan")
    return BootstrapResult(float(estimate), nan, nan, nan, 0, float(confidence_level), "none", "run")


def check_scores(scores: Sequence[float], what: str) -> np.ndarray:
    """Scores as float64; a non-finite one is an input error naming ``what``."""
    x = np.asarray(scores, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"{what}: no scores")
    if not np.isfinite(x).all():
        raise ValueError(f"{what}: non-finite score {x[~np.isfinite(x)][0]!r}")
    return x
