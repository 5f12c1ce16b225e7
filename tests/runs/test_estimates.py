"""SPEC 10's estimates: vectorized resamples equal a slow loop; point values and intervals equal rliable's."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from icsd_audit.runs import estimates as E


@pytest.mark.parametrize("n,ny", [(1, 1), (2, 3), (3, 1), (4, 4), (5, 2), (7, 6), (8, 3), (10, 9)])
def test_counts_statistics_equal_a_loop_over_the_same_draws(n, ny):
    """Mean, median, IQM and P(X > Y) of every resample, from the counts, equal the definitions
    applied to the drawn runs themselves (ties included: scores on a coarse grid)."""
    rng = np.random.default_rng(n * 100 + ny)
    x = np.sort(rng.integers(0, 4, n).astype(float))
    y = np.sort(rng.integers(0, 4, ny).astype(float))
    r = 300
    cx = E.resample_counts(n, r, np.random.default_rng(5))
    cy = E.resample_counts(ny, r, np.random.default_rng(7))
    ix = np.random.default_rng(5).integers(0, n, (r, n))  # the same draws as indices
    iy = np.random.default_rng(7).integers(0, ny, (r, ny))
    got = E.resampled_statistics(x, cx)
    poi = E.resampled_improvement(x, cx, y, cy)
    for i in range(r):
        xr, yr = x[ix[i]], y[iy[i]]
        assert got["mean"][i] == pytest.approx(xr.mean(), abs=1e-12)
        assert got["median"][i] == np.median(xr)
        assert got["iqm"][i] == pytest.approx(sps.trim_mean(xr, 0.25), abs=1e-12)
        pairs = [(a > b) + 0.5 * (a == b) for a in xr for b in yr]
        assert poi[i] == sum(pairs) / len(pairs)


def test_point_statistics_by_hand():
    x = np.array([0.1, 0.9, 0.2, 0.4, 0.3, 0.8, 0.5, 0.7])  # sorted: .1 .2 .3 .4 .5 .7 .8 .9
    p = E.point_statistics(x)
    assert p["mean"] == pytest.approx(3.9 / 8)
    assert p["median"] == pytest.approx(0.45)
    assert p["iqm"] == pytest.approx((0.3 + 0.4 + 0.5 + 0.7) / 4)  # positions 2..5 of 8
    # pairs (x, y): (1,2) (1,2) lose, (2,2) (2,2) tie, (3,2) (3,2) win
    assert E.improvement_probability([1, 2, 3], [2, 2]) == pytest.approx((0 + 0 + 0.5 + 0.5 + 1 + 1) / 6)


def test_iqm_is_scipy_trim_mean_bit_for_bit():
    rng = np.random.default_rng(3)
    for n in range(1, 40):
        for x in (rng.random(n), rng.integers(0, 3, n).astype(float), rng.standard_cauchy(n)):
            assert E.iqm(x) == sps.trim_mean(x, 0.25)


def test_stream_depends_on_names_only():
    a = E.stream(3, "runs", "icsd", "webshop").integers(0, 10**9, 5)
    b = E.stream(3, "runs", "icsd", "webshop").integers(0, 10**9, 5)
    c = E.stream(3, "runs", "sdar", "webshop").integers(0, 10**9, 5)
    assert (a == b).all() and not (a == c).all()


def test_non_finite_scores_are_refused():
    with pytest.raises(ValueError, match="non-finite"):
        E.check_scores([0.1, float("nan")], "group 'x' in webshop")


# --------------------------------------------------------------------------- rliable as reference


def _rliable():
    pytest.importorskip("rliable", reason="rliable not installed (pip install -e '.[test]')")
    from rliable import library as rly
    from rliable import metrics

    return rly, metrics


def _ours(x: np.ndarray, label: str, stratum: str, seed: int = 0, reps: int = 10_000):
    xs = np.sort(x)
    c = E.resample_counts(x.size, reps, E.stream(seed, "runs", label, stratum))
    return xs, c, E.resampled_statistics(xs, c)


def test_point_estimates_equal_rliable_exactly():
    rly, metrics = _rliable()
    rng = np.random.default_rng(0)
    for n in (3, 5, 8, 13):
        x = rng.random((n, 1))
        y = rng.random((n + 2, 1))
        p = E.point_statistics(x[:, 0])
        assert p["mean"] == metrics.aggregate_mean(x)
        assert p["iqm"] == metrics.aggregate_iqm(x)
        assert E.improvement_probability(x[:, 0], y[:, 0]) == metrics.probability_of_improvement(x, y)
    ties_x, ties_y = np.array([[0.0], [1.0], [1.0], [0.5]]), np.array([[1.0], [0.5], [0.0]])
    assert E.improvement_probability(ties_x[:, 0], ties_y[:, 0]) == metrics.probability_of_improvement(ties_x, ties_y)


def _mc_band(reps: np.ndarray, q: float, r_ref: int, z: float = 4.0) -> tuple[float, float]:
    """Where a reference bootstrap with ``r_ref`` resamples puts its q-quantile, given our distribution:
    our quantiles at q -+ z sigma, sigma the binomial error of a quantile's level at both resample counts."""
    sigma = np.sqrt(q * (1 - q) / r_ref) + np.sqrt(q * (1 - q) / reps.size)
    lo, hi = np.quantile(reps, [max(q - z * sigma, 0.0), min(q + z * sigma, 1.0)])
    return float(lo), float(hi)


def test_intervals_equal_rliable_within_monte_carlo_error():
    """rliable's stratified bootstrap (its own resampling and RNG) puts its 95 % bounds where ours are, up to
    Monte Carlo error: each of its bounds lies inside our bootstrap distribution's quantiles at the bound's
    level -+ 4 binomial standard errors (both resample counts); 2,000 rliable resamples keep the test fast.
    Heavy-tailed scores make mean, median and IQM intervals far apart, so the band tells them apart."""
    rly, metrics = _rliable()
    x = np.array([0.0, 0.02, 0.05, 0.1, 0.15, 0.3, 0.45, 0.6, 0.8, 3.0, 7.5, 12.0])[:, None]
    y = np.array([0.0, 0.1, 0.2, 0.2, 0.4, 0.5, 1.5, 9.0])[:, None]
    np.random.seed(0)  # rliable draws from NumPy's global generator
    r_ref = 2_000
    _, rl_iqm = rly.get_interval_estimates({"x": x}, lambda s: np.array([metrics.aggregate_iqm(s)]), reps=r_ref)
    _, rl_mean = rly.get_interval_estimates({"x": x}, lambda s: np.array([metrics.aggregate_mean(s)]), reps=r_ref)
    _, rl_poi = rly.get_interval_estimates({"xy": [x, y]}, metrics.probability_of_improvement, reps=r_ref)
    xs, cx, ours = _ours(x[:, 0], "x", "s")
    ys, cy, _ = _ours(y[:, 0], "y", "s")
    poi = E.resampled_improvement(xs, cx, ys, cy)
    for name, ref, rep in (("iqm", rl_iqm["x"][:, 0], ours["iqm"]), ("mean", rl_mean["x"][:, 0], ours["mean"]),
                           ("poi", np.ravel(rl_poi["xy"]), poi)):
        mine = E.interval(0.0, rep, confidence_level=0.95)
        for bound, q, got in ((ref[0], 0.025, mine.ci_low), (ref[1], 0.975, mine.ci_high)):
            lo, hi = _mc_band(rep, q, r_ref)
            assert lo <= bound <= hi, (name, q, bound, (lo, hi), got)
            assert lo <= got <= hi
    lo, hi = _mc_band(ours["median"], 0.025, r_ref)  # the check can fail: the median's interval is not the IQM's
    assert not lo <= rl_iqm["x"][0, 0] <= hi


def test_across_strata_values_equal_rliable_on_a_runs_by_tasks_matrix():
    """Across strata: the mean and P(X > Y) are rliable's aggregate_mean / probability_of_improvement on
    the (runs x tasks) matrix; the IQM is the unweighted mean of per-stratum IQMs (SPEC 10), i.e. rliable's
    aggregate_iqm per task column, averaged."""
    rly, metrics = _rliable()
    from icsd_audit.runs.compare import compare_runs
    from icsd_audit.runs.folders import Run

    rng = np.random.default_rng(2)
    envs = ("alfworld", "searchqa", "webshop")
    x, y = rng.random((6, 3)), rng.random((5, 3))
    runs = []
    for label, m in (("icsd", x), ("sdar", y)):
        for i in range(m.shape[0]):
            for j, env in enumerate(envs):
                runs.append(Run(path=f"{label}{i}{env}", name=f"{label}{i}{env}",  # type: ignore[arg-type]
                                config={"allocator": label, "env": env, "seed": i}, manifest=None,
                                steps=np.array([0]), columns={"rollout/success": np.array([m[i, j]])},
                                logged={"rollout/success": np.array([True])}))
    c = compare_runs(runs, metric="rollout/success", n_resamples=200)
    assert c.strata == envs
    assert c.group("icsd", "all").mean.estimate == pytest.approx(metrics.aggregate_mean(x), abs=1e-15)
    assert c.group("icsd", "all").iqm.estimate == pytest.approx(
        np.mean([metrics.aggregate_iqm(x[:, [j]]) for j in range(3)]), abs=1e-15)
    assert c.pair("icsd", "sdar", "all").probability_of_improvement.estimate == pytest.approx(
        metrics.probability_of_improvement(x, y), abs=1e-15)
    for j, env in enumerate(envs):
        assert c.group("sdar", env).iqm.estimate == metrics.aggregate_iqm(y[:, [j]])
        assert c.pair("icsd", "sdar", env).probability_of_improvement.estimate == \
            metrics.probability_of_improvement(x[:, [j]], y[:, [j]])
