"""Bootstrap engine: exact stratified multinomial counts, invariances, widths, coverage."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from icsd_audit import stats
from icsd_audit.tokens import Tokens, Weights
from icsd_audit.stats.bootstrap import (
    BLOCK,
    BootstrapResult,
    batch_bootstrap_mean,
    bootstrap_ratio_columns,
    cluster_bootstrap_ratio,
    resampled_sums,
)


def counts_matrix(sizes, n_resamples, seed):
    """Resampled multiplicities of every cluster: T with S = identity."""
    n = int(np.sum(sizes))
    parts = [T[:, 0, :] for _, _, T in resampled_sums(np.eye(n), sizes, [0] * len(sizes), 1, n_resamples, rng=seed)]
    return np.concatenate(parts)


# --------------------------------------------------------------------------- the count sampler


@pytest.mark.parametrize("sizes", [[1], [3, 9], [15, 16, 17], [50], [10, 200, 1200]])
def test_counts_are_exact_stratified_multinomial(sizes):
    C = counts_matrix(sizes, 6000, seed=1)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    tot = np.add.reduceat(C, starts, axis=1)
    assert (tot == np.asarray(sizes)).all()  # every stratum keeps its size in every resample
    assert C.min() >= 0 and np.allclose(C, np.round(C))
    for s, a in zip(sizes, starts):
        if s == 1:
            assert (C[:, a] == 1).all()
            continue
        # marginal of one cluster: Binomial(n_s, 1/n_s)
        col = C[:, a].astype(int)
        k = np.arange(6)
        p = sps.binom.pmf(k, s, 1 / s)
        p[-1] = sps.binom.sf(4, s, 1 / s)
        obs = np.bincount(np.minimum(col, 5), minlength=6)
        keep = p * len(col) > 5
        exp = p[keep] * len(col)
        chi = (((obs[keep] - exp) ** 2) / exp).sum() + 0.0
        assert sps.chi2.sf(chi, keep.sum() - 1) > 1e-4, (s, obs, exp)


def test_many_narrow_groups_sum_only_their_own_clusters():
    # 30 groups of 20 clusters, each group two strata of 10: the segment-sum path
    sizes = [10] * 60
    sgroup = np.repeat(np.arange(30), 2)
    n = 600
    T = np.concatenate([t for _, _, t in resampled_sums(np.eye(n), sizes, sgroup, 30, 200, rng=4)])
    assert T.shape == (200, 30, n)
    for g in range(30):
        inside = np.zeros(n, bool)
        inside[20 * g : 20 * g + 20] = True
        assert (T[:, g, ~inside] == 0).all()
        assert (T[:, g, 20 * g : 20 * g + 10].sum(axis=1) == 10).all()
        assert (T[:, g, 20 * g + 10 : 20 * g + 20].sum(axis=1) == 10).all()


@pytest.mark.parametrize("level", [0, 4, 7, 13])
def test_tuple_lookup_is_the_nested_poisson_inverse_cdf(level):
    # one 16-bit bucket (+ a double where it straddles a step) gives TUPLE Poisson counts:
    # compare with the inverse CDF taken coordinate by coordinate (scipy's Poisson CDF)
    from icsd_audit.stats.engine.counts import TUPLE, _level

    lv = _level(level)
    lam = 0.0 if level == 0 else 1 - 3 * 2 ** (-level / 2)
    rng = np.random.default_rng(level)
    bucket = rng.integers(0, 2**16, 3000)
    v = rng.random(3000)
    code = lv.table[bucket]
    flagged = code < 0
    code[flagged] = lv.resolve(bucket[flagged], v[flagged])
    got = code.view(np.uint8).reshape(-1, TUPLE)
    u = (bucket + v) / 2**16
    cdf = sps.poisson.cdf(np.arange(40), lam).tolist()
    pmf = sps.poisson.pmf(np.arange(40), lam).tolist()
    for i in range(3000):
        x, want = u[i], []
        for _ in range(TUPLE):
            c = 0
            while cdf[c] <= x:
                c += 1
            want.append(c)
            x = (x - (cdf[c - 1] if c else 0.0)) / pmf[c]
        assert list(got[i]) == want, (i, u[i], got[i], want)


def _all_tuples(F):
    """Reference: every tuple of counts 0..K-1, lexicographic, its nested CDF made monotone, zero widths dropped."""
    from icsd_audit.stats.engine.resample import TUPLE

    k = len(F)
    p = np.diff(np.concatenate([[0.0], F]))
    below = np.concatenate([[0.0], F[:-1]])
    cdf = np.asarray(F, dtype=np.float64)
    for _ in range(TUPLE - 1):
        cdf = (below[:, None] + p[:, None] * cdf[None, :]).reshape(-1)
    cdf = np.minimum(np.maximum.accumulate(cdf), 1.0)
    cdf[-1] = 1.0
    digits = np.array(np.unravel_index(np.arange(k**TUPLE), (k,) * TUPLE)).T
    keep = np.flatnonzero(np.diff(np.concatenate([[0.0], cdf])) > 0)
    return digits[keep], cdf[keep]


def test_tuple_table_skips_counts_without_mass_exactly():
    # where the Poisson CDF's partial sums stall one ulp below 1 (level 7: 60 terms, 18 with
    # mass) the table enumerates only counts of positive probability; the tuples kept and
    # their CDF values must be the bits of the full enumeration (which takes ~890 MB at 60 terms)
    from icsd_audit.stats.engine.counts import _SLACK, _poisson_cdf, _tuples

    F7 = _poisson_cdf(1 - _SLACK * 2 ** (-7 / 2))
    assert len(F7) == 60 and (np.diff(F7)[17:58] == 0).all()  # the stall this guards against
    stalled = np.concatenate([F7[:23], [1.0]])  # 24 counts: 17 with mass, 6 stalled, then 1
    hole = _poisson_cdf(0.8)
    hole = np.concatenate([hole[:3], hole[2:3], hole[3:]])  # a count of zero mass inside
    for F in (stalled, hole, _poisson_cdf(0.9)):
        d_ref, c_ref = _all_tuples(F)
        d, c = _tuples(F)
        assert np.array_equal(d, d_ref)
        assert c.tobytes() == c_ref.tobytes()


def test_counts_do_not_depend_on_the_sums():
    # the stream is a function of the seed and the layout: clusters whose sums are all 0
    # (turns without an active token, say) are resampled like any other, so the counts
    # of the others are the same bits whatever the zero pattern (SPEC 7)
    sizes = [40, 25, 30]
    n = 95
    full = counts_matrix(sizes, 500, seed=5)
    nz = np.zeros(n, bool)
    nz[[0, 3, 5, 7, 11, 13, 17, 19, 23, 39]] = True
    nz[65:] = True
    S = np.eye(n) * nz  # the same identity with most rows zeroed
    C = np.concatenate([T[:, 0, :] for _, _, T in resampled_sums(S, sizes, [0, 0, 0], 1, 500, rng=5)])
    assert np.array_equal(C[:, nz], full[:, nz]) and (C[:, ~nz] == 0).all()


def test_a_statistic_s_sums_do_not_depend_on_what_else_is_bootstrapped():
    from icsd_audit.stats.bootstrap import RatioFamily, bootstrap_ratio_families

    rng = np.random.default_rng(11)
    n = 9000
    strata = np.sort(rng.integers(0, 4, n))
    groups = (strata >= 2).astype(int)
    a = RatioFamily(rng.random((n, 4)) * (rng.random((n, 1)) < 0.8), [0, 2], [1, 3], strata=strata, groups=groups,
                    differences=[(1, 0)])
    wide = RatioFamily(rng.random((n, 19)), list(range(9)), list(range(9, 18)), strata=strata, groups=groups)
    other_layout = RatioFamily(rng.random((n, 2)), [0], [1], strata=rng.integers(0, 3, n))
    kw = dict(n_resamples=400, rng=3, keep_replicates=True)
    (alone,) = bootstrap_ratio_families([a], **kw)
    for fams, workers in (([a, wide], 1), ([wide, other_layout, a], 2), ([other_layout, a, wide], 3)):
        got = bootstrap_ratio_families(fams, workers=workers, **kw)[[f is a for f in fams].index(True)]
        assert np.array_equal(got.replicates, alone.replicates)
        assert np.array_equal(got.ci_low, alone.ci_low) and np.array_equal(got.standard_error, alone.standard_error)
    # and the library's one-call statistics: TCM alone = TCM among all four
    from tests.stats.test_api import make_tokens, run

    d = make_tokens(4, n_batches=4)
    assert run(stats.tcm, d, n_resamples=300, rng=2).to_dict() == run(stats.audit, d, n_resamples=300, rng=2).tcm.to_dict()


def test_gathered_parts_agree_with_dense_products(monkeypatch):
    # a share-shift-like family: 11 bins partition the turns (2 weightings each), a dense total and a column on 2 % of
    # turns; the bins and the sparse column are multiplied by their turns' gathered counts (parts), the rest densely.
    # Reference: the counts themselves (S = identity) times the sums, group by group; and the same family with every
    # column dense.  Both agree to rounding only: which columns are gathered changes the order of the additions, so
    # it is part of the numbers (it depends on the family's own sums alone: one interval per statistic, SPEC 7).
    from icsd_audit.stats.engine import resample

    rng = np.random.default_rng(4)
    sizes, n = [1000, 600, 800], 2400
    group_of = np.repeat([0, 0, 1], sizes)
    bins = rng.integers(0, 11, n)
    S = np.zeros((n, 24))
    S[np.arange(n), 2 * bins] = rng.standard_normal(n) * np.exp(2 * rng.standard_normal(n))
    S[np.arange(n), 2 * bins + 1] = rng.random(n)
    S[:, 22] = S[:, 0:22:2].sum(axis=1)
    S[rng.random(n) < 0.02, 23] = 1.0
    C = counts_matrix(sizes, 300, seed=9)  # exact (integer sums), whichever path
    ref = np.stack([C[:, group_of == g] @ S[group_of == g] for g in (0, 1)], axis=1)
    monkeypatch.setattr(resample, "_PART_OVERHEAD", 0)  # parts on a small input
    lay = resample.Layout(np.asarray(sizes))
    fam = resample.Family(np.ascontiguousarray(S.T), [0, 0, 1], 2, lay)
    assert len(fam.parts) == 12 and fam.dense.tolist() == [22]  # the parts path is what is tested here
    got = np.concatenate([T for _, _, T in resampled_sums(S, sizes, [0, 0, 1], 2, 300, rng=9)])
    assert np.allclose(got, ref, rtol=1e-12, atol=1e-12 * np.abs(S).sum())
    monkeypatch.setattr(resample, "_GATHER_COST", np.inf)  # every column dense
    assert not resample.Family(np.ascontiguousarray(S.T), [0, 0, 1], 2, lay).parts
    dense = np.concatenate([T for _, _, T in resampled_sums(S, sizes, [0, 0, 1], 2, 300, rng=9)])
    assert np.allclose(dense, got, rtol=1e-12, atol=1e-12 * np.abs(S).sum())


@pytest.mark.parametrize("k, sparse", [(5, True), (11, False), (11, True), (5, False), (17, False)])
def test_a_five_column_last_panel_runs_as_six_with_the_same_sums(monkeypatch, k: int, sparse: bool):
    # a family whose dense columns end in a panel of PANEL - 1 (5, 11, 17) multiplies it as a full panel: one row
    # up over the previous panel's last row, or, alone in the family's own dense copy, with a zero row under it.
    # Reference: the counts themselves (S = identity) times the sums, group by group; and the exact sums of an
    # integer copy of the same family (integers: exact in any order, so the padded panels must give them exactly)
    from icsd_audit.stats.engine import resample

    rng = np.random.default_rng(k + sparse)
    sizes, n = [1200, 700, 1100], 3000
    group_of = np.repeat([0, 0, 1], sizes)
    S = rng.standard_normal((n, k + 2 * sparse)) * np.exp(2 * rng.standard_normal(k + 2 * sparse))
    if sparse:  # two columns on 1 % of turns: parts, so the dense ones are the family's own copy
        S[:, k:] *= rng.random((n, 1)) < 0.01
        monkeypatch.setattr(resample, "_PART_OVERHEAD", 0)
    lay = resample.Layout(np.asarray(sizes))
    fam = resample.Family(np.ascontiguousarray(S.T), [0, 0, 1], 2, lay)
    assert len(fam.dense) == k and bool(fam.parts) == sparse
    last = fam.panels[-1]
    assert last[:2] == ((k // 6) * 6, k) and last[3] - last[2] == (5 if (k, sparse) == (5, False) else 6)
    C = counts_matrix(sizes, 300, seed=5)
    ref = np.stack([C[:, group_of == g] @ S[group_of == g] for g in (0, 1)], axis=1)
    got = np.concatenate([T for _, _, T in resampled_sums(S, sizes, [0, 0, 1], 2, 300, rng=5)])
    assert np.allclose(got, ref, rtol=1e-12, atol=1e-12 * np.abs(S).sum())
    Z = np.round(S * 50)
    exact = np.stack([C[:, group_of == g] @ Z[group_of == g] for g in (0, 1)], axis=1)
    assert np.array_equal(np.concatenate([T for _, _, T in resampled_sums(Z, sizes, [0, 0, 1], 2, 300, rng=5)]), exact)


def test_a_total_of_parts_is_their_resampled_sums_added():
    # the share shift's denominator: the total of its bins, from the bins' resampled sums (no product of its own).
    # Reference: the exact multiplicities (S = identity, the same seed) times the explicit total column.
    from icsd_audit.stats.bootstrap import RatioFamily, bootstrap_ratio_families

    rng = np.random.default_rng(8)
    sizes = [700, 500, 900]
    n = sum(sizes)
    strata = np.repeat([0, 1, 2], sizes)
    bins = rng.integers(0, 5, n)
    S = np.zeros((n, 6))
    S[np.arange(n), bins] = rng.random(n) * np.exp(rng.standard_normal(n))
    S[:, 5] = 1.0  # a count column
    total = S[:, :5].sum(axis=1)
    # ratios: bin b / total (b = 0..4), total / count; columns 0..5 are S's, column 6 is the total of 0..4
    fam = RatioFamily(S, [0, 1, 2, 3, 4, 6], [6, 6, 6, 6, 6, 5], strata=strata, totals=[[0, 1, 2, 3, 4]])
    (got,) = bootstrap_ratio_families([fam], n_resamples=300, rng=6, keep_replicates=True)
    C = counts_matrix(sizes, 300, seed=6)
    T, tot = C @ S, C @ total
    ref = np.concatenate([T[:, :5] / tot[:, None], (tot / T[:, 5])[:, None]], axis=1)
    assert np.allclose(got.replicates[:, 0, :], ref, rtol=1e-12, atol=0)
    est = np.concatenate([S[:, :5].sum(axis=0) / total.sum(), [total.sum() / n]])
    assert np.allclose(got.estimate[0], est, rtol=1e-12, atol=0)
    for bad in ([[]], [[0, 9]]):
        with pytest.raises(ValueError, match="each total needs"):
            bootstrap_ratio_families([RatioFamily(S, [0], [5], totals=bad)], n_resamples=16)
    with pytest.raises(ValueError, match="column indices must lie in 0..6"):
        bootstrap_ratio_families([RatioFamily(S, [7], [5], totals=[[0, 1]])], n_resamples=16)


def test_zero_clusters_keep_chunk_invariance():
    rng = np.random.default_rng(7)
    num = rng.random((2000, 2)) * (rng.random((2000, 1)) < 0.7)  # 30% of turns carry nothing
    den = num + rng.random((2000, 2)) * (num > 0)
    strata = rng.integers(0, 3, 2000)
    kw = dict(strata=strata, n_resamples=300, rng=3, keep_replicates=True)
    ref = cluster_bootstrap_ratio(num, den, **kw)
    for chunk, workers in [(BLOCK, 1), (5 * BLOCK, 2)]:
        assert np.array_equal(cluster_bootstrap_ratio(num, den, chunk_size=chunk, workers=workers, **kw).replicates,
                              ref.replicates)


def test_counts_covariance_is_multinomial():
    n = 64
    C = counts_matrix([n], 40000, seed=3)
    cov = np.cov(C[:, :12].T)
    off = cov[np.triu_indices(12, 1)]
    assert abs(np.diag(cov).mean() - (1 - 1 / n)) < 0.02
    assert abs(off.mean() - (-1 / n)) < 0.003


def test_results_do_not_depend_on_chunk_size_or_workers():
    rng = np.random.default_rng(0)
    num = rng.random((3000, 3))
    den = num + rng.random((3000, 3))
    strata = rng.integers(0, 5, 3000)
    groups = rng.integers(0, 2, 3000)
    kw = dict(strata=strata, groups=groups, differences=[(1, 0), (2, 0)], n_resamples=1000, rng=42, keep_replicates=True)
    ref = cluster_bootstrap_ratio(num, den, **kw)
    for chunk, workers in [(BLOCK, 1), (3 * BLOCK, 1), (100, 2), (10_000, 1), (None, 2)]:
        r = cluster_bootstrap_ratio(num, den, chunk_size=chunk, workers=workers, **kw)
        assert np.array_equal(r.replicates, ref.replicates)
        assert np.array_equal(r.ci_low, ref.ci_low) and np.array_equal(r.ci_high, ref.ci_high)
    # the first resamples do not depend on how many are drawn
    short = cluster_bootstrap_ratio(num, den, **dict(kw, n_resamples=100))
    assert np.array_equal(short.replicates, ref.replicates[:100])
    # a generator and its seed give the same draws
    r = cluster_bootstrap_ratio(num, den, **dict(kw, rng=np.random.default_rng(42)))
    assert np.array_equal(r.replicates, ref.replicates)


def test_stats_results_do_not_depend_on_chunk_size():
    from tests.stats.test_api import make_tokens, run

    d = make_tokens(21)
    a = run(stats.audit, d, chunk_size=16).to_dict()
    b = run(stats.audit, d, chunk_size=4096, workers=2).to_dict()
    assert a == b


# --------------------------------------------------------------------------- percentile summaries


def test_percentile_interval_matches_numpy_on_replicates():
    rng = np.random.default_rng(1)
    num, den = rng.random(500), 1 + rng.random(500)
    r = cluster_bootstrap_ratio(num, den, n_resamples=2001, confidence_level=0.9, rng=3, keep_replicates=True)
    reps = r.replicates[:, 0, 0]
    lo, hi = np.percentile(reps, [5, 95])
    assert r.ci_low[0, 0] == min(lo, r.estimate[0, 0]) and r.ci_high[0, 0] == max(hi, r.estimate[0, 0])
    assert abs(r.standard_error[0, 0] - reps.std(ddof=1)) < 1e-15
    assert abs(r.estimate[0, 0] - num.sum() / den.sum()) < 1e-15
    res = r.result(0)
    assert isinstance(res, BootstrapResult) and res.n_resamples == 2001 and res.confidence_level == 0.9
    assert res.to_dict()["method"] == "percentile" and res.to_dict()["unit"] == "action-turn"


def test_undefined_resamples_are_left_out():
    # one stratum where the denominator is nonzero in a single cluster only
    num = np.array([1.0, 0, 0, 0, 0, 0, 0, 0])
    den = np.array([2.0, 0, 0, 0, 0, 0, 0, 0])
    r = cluster_bootstrap_ratio(num, den, n_resamples=500, rng=0)
    assert r.estimate[0, 0] == 0.5
    assert 0 < r.n_valid[0, 0] < 500  # resamples without cluster 0 are 0/0
    assert r.ci_low[0, 0] == 0.5 == r.ci_high[0, 0] and r.standard_error[0, 0] == 0.0


def test_identical_columns_give_exact_zero_differences():
    rng = np.random.default_rng(2)
    a = rng.random((400, 1))
    r = cluster_bootstrap_ratio(np.hstack([a, a]), np.hstack([a + 1, a + 1]), differences=[(1, 0)], n_resamples=300, rng=0)
    assert r.estimate[0, 2] == 0 and r.ci_low[0, 2] == 0 and r.ci_high[0, 2] == 0


def test_validation_errors():
    x = np.ones(10)
    with pytest.raises(ValueError, match="n_resamples"):
        cluster_bootstrap_ratio(x, x, n_resamples=0)
    with pytest.raises(ValueError, match="confidence_level"):
        cluster_bootstrap_ratio(x, x, confidence_level=1.0)
    with pytest.raises(ValueError, match="unit"):
        cluster_bootstrap_ratio(x, x, unit="token")
    with pytest.raises(TypeError, match="rng"):
        cluster_bootstrap_ratio(x, x, rng="seed")
    with pytest.raises(ValueError, match="same shape"):
        cluster_bootstrap_ratio(x, np.ones(9))
    with pytest.raises(ValueError, match="NaN"):
        cluster_bootstrap_ratio(np.array([np.nan, 1.0]), np.ones(2))
    with pytest.raises(ValueError, match="chunk_size"):
        cluster_bootstrap_ratio(x, x, chunk_size=0)
    with pytest.raises(ValueError, match="difference"):
        cluster_bootstrap_ratio(x, x, differences=[(0, 3)])
    with pytest.raises(ValueError, match="strata"):
        cluster_bootstrap_ratio(x, x, strata=np.zeros(3))
    with pytest.raises(ValueError, match="empty"):
        batch_bootstrap_mean([])
    with pytest.raises(ValueError, match="column indices"):
        bootstrap_ratio_columns(np.ones((4, 2)), [0], [2])


# --------------------------------------------------------------------------- batch bootstrap


def test_batch_bootstrap_mean_matches_scipy():
    rng = np.random.default_rng(4)
    v = rng.normal(0.2, 0.1, 16)
    r = batch_bootstrap_mean(v, n_resamples=20000, rng=1)
    assert r.unit == "batch" and abs(r.estimate - v.mean()) < 1e-15
    ref = sps.bootstrap((v,), np.mean, n_resamples=20000, method="percentile", rng=np.random.default_rng(2))
    w_ours = r.ci_high - r.ci_low
    w_ref = ref.confidence_interval.high - ref.confidence_interval.low
    assert abs(w_ours / w_ref - 1) < 0.05
    assert abs(r.standard_error - ref.standard_error) / ref.standard_error < 0.05
    # several columns share the resamples: a column of differences is paired
    two = batch_bootstrap_mean(np.column_stack([v, v + 1, np.ones(16)]), n_resamples=2000, rng=1)
    assert len(two) == 3 and abs((two[1].ci_low - two[0].ci_low) - 1) < 1e-12
    assert two[2].ci_low == two[2].ci_high == 1.0 and two[2].standard_error == 0.0


def test_batch_unit_resamples_whole_strata():
    rng = np.random.default_rng(5)
    strata = np.repeat(np.arange(6), 50)
    num = rng.random(300) + strata * 0.2
    den = np.ones(300)
    r = cluster_bootstrap_ratio(num, den, strata=strata, unit="batch", n_resamples=4000, rng=0, keep_replicates=True)
    bmeans = np.array([num[strata == s].mean() for s in range(6)])
    ref = batch_bootstrap_mean(bmeans, n_resamples=4000, rng=9)
    assert abs((r.ci_high[0, 0] - r.ci_low[0, 0]) / (ref.ci_high - ref.ci_low) - 1) < 0.1
    assert r.unit == "batch"
    # chunking does not change batch resamples either
    r2 = cluster_bootstrap_ratio(num, den, strata=strata, unit="batch", n_resamples=4000, rng=0, chunk_size=7, keep_replicates=True)
    assert np.array_equal(r.replicates, r2.replicates)
    # with equal batch sizes every replicate is a mean of 6 resampled batch means
    reps = r.replicates[:, 0, 0]
    assert bmeans.min() - 1e-12 <= reps.min() and reps.max() <= bmeans.max() + 1e-12
    assert abs(reps.mean() - bmeans.mean()) < 0.01


# --------------------------------------------------------------------------- against an independent bootstrap


def slow_stratified_bootstrap(d, weights_names, n_resamples, seed):
    """Loop over resamples: resample action turns per batch, recompute TCM and shares from tokens."""
    rng = np.random.default_rng(seed)
    valid = d["valid"]
    key = list(zip(d["batch_id"][valid].tolist(), d["traj_id"][valid].tolist(), d["turn_id"][valid].tolist()))
    idx_of: dict = {}
    for i, k in enumerate(key):
        idx_of.setdefault(k, []).append(i)
    turns_by_batch: dict = {}
    for k in idx_of:
        turns_by_batch.setdefault(k[0], []).append(k)
    dl = d["delta"][valid].astype(np.float64)
    adv = d["advantage"][valid].astype(np.float64)
    u = adv * d["ratio"][valid].astype(np.float64) * dl
    act = (dl > 0) & (np.abs(u) > 1e-4)
    neg = act & (u < 0)
    pp = (dl > 0) & (adv > 0)
    out = {f"{s}:{w}": [] for w in weights_names for s in ("tcm", "pp")}
    out.update({f"{s}:diff": [] for s in ("tcm", "pp")})
    for _ in range(n_resamples):
        rows = []
        for b, turns in turns_by_batch.items():
            pick = rng.integers(0, len(turns), len(turns))
            for p in pick:
                rows.extend(idx_of[turns[p]])
        rows = np.asarray(rows)
        vals = {}
        for w in weights_names:
            x = d[w][valid][rows]
            vals[w] = (x[neg[rows]].sum() / x[act[rows]].sum(), x[pp[rows]].sum() / x.sum())
            out[f"tcm:{w}"].append(vals[w][0])
            out[f"pp:{w}"].append(vals[w][1])
        out["tcm:diff"].append(vals[weights_names[1]][0] - vals[weights_names[0]][0])
        out["pp:diff"].append(vals[weights_names[1]][1] - vals[weights_names[0]][1])
    return {k: np.percentile(v, [2.5, 97.5]) for k, v in out.items()}


def test_interval_widths_agree_with_independent_slow_bootstrap():
    from tests.stats.test_api import make_tokens, run

    d = make_tokens(30, n_batches=4)
    res = run(stats.audit, d, n_resamples=4000, rng=11)
    slow = slow_stratified_bootstrap(d, ("g", "c"), 500, seed=12)
    pairs = {
        "tcm:g": res.tcm.base, "tcm:c": res.tcm.compare, "tcm:diff": res.tcm.diff,
        "pp:g": res.quadrants.regions["pos_delta_pos_adv"].base,
        "pp:c": res.quadrants.regions["pos_delta_pos_adv"].compare,
        "pp:diff": res.quadrants.regions["pos_delta_pos_adv"].diff,
    }
    for k, r in pairs.items():
        w_slow = slow[k][1] - slow[k][0]
        w_fast = r.ci_high - r.ci_low
        assert 1 / 1.25 < w_fast / w_slow < 1.25, (k, w_fast, w_slow)
        # and the intervals sit in the same place
        assert abs((r.ci_low + r.ci_high) / 2 - slow[k].mean()) < 0.25 * w_slow, k


# --------------------------------------------------------------------------- coverage


def coverage_population(rng, p_neg, n_turns, lam_neg=4.0, lam_pos=14.0):
    """Tokens of one batch: turn-constant advantage, token counts depending on its sign.

    With g = sigmoid(5 delta) and c = g * (1 + [A > 0]), the pooled TCM over batches
    with P(A < 0) = p_b is known in closed form (see ``true_tcm``).
    """
    neg = rng.random(n_turns) < p_neg
    ntok = 1 + rng.poisson(np.where(neg, lam_neg, lam_pos))
    adv_turn = np.where(neg, -1.0, 1.0) * (0.1 + rng.random(n_turns))
    n = int(ntok.sum())
    turn = np.repeat(np.arange(n_turns), ntok)
    adv = adv_turn[turn]
    delta = rng.normal(0.3, 1.0, n)
    g = 1 / (1 + np.exp(-5 * delta))
    c = g * (1 + (adv > 0))
    return dict(delta=delta, advantage=adv, ratio=np.ones(n), base=g, compare=c, traj_id=turn, turn_id=np.zeros(n, np.int64))


def true_tcm(ps, lam_neg=4.0, lam_pos=14.0):
    # E[sum g 1(delta>0)] per token is a common factor; turn token means are 1 + lambda
    num_b = sum(p * (1 + lam_neg) for p in ps)
    den_b = sum(p * (1 + lam_neg) + (1 - p) * (1 + lam_pos) for p in ps)
    den_c = sum(p * (1 + lam_neg) + 2 * (1 - p) * (1 + lam_pos) for p in ps)
    return num_b / den_b, num_b / den_c


@pytest.mark.slow
def test_coverage_of_95_percent_intervals():
    """Stratified populations with a known pooled TCM: 95 % intervals cover 93-97 %."""
    ps = [0.3, 0.5, 0.6, 0.45]
    tb, tc = true_tcm(ps)
    truth = {"base": tb, "compare": tc, "diff": tc - tb}
    reps = 1000
    hits = {k: 0 for k in truth}
    rng = np.random.default_rng(2024)
    for rep in range(reps):
        acc = stats.AuditAccumulator(statistics=("tcm",))
        for b, p in enumerate(ps):
            tok = coverage_population(rng, p, 120)
            acc.add(Tokens(batch_id=np.full(tok["delta"].size, b), **{k: v for k, v in tok.items() if k not in ("base", "compare")}),
                    Weights(tok["base"], tok["compare"]))
        r = acc.finalize(n_resamples=1000, rng=rep).tcm
        for k in truth:
            x = getattr(r, k)
            hits[k] += x.ci_low <= truth[k] <= x.ci_high
    cover = {k: v / reps for k, v in hits.items()}
    for k, v in cover.items():
        assert 0.93 <= v <= 0.97, cover


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_sums_are_one_error(bad):
    sums = np.ones((20, 3))
    sums[7, 2] = bad  # (the check reads the sums' min and max: NaN propagates, an infinity is one of them)
    with pytest.raises(ValueError, match="sums contains NaN or infinite values"):
        bootstrap_ratio_columns(sums, [0], [2], n_resamples=16, rng=0)
