"""Token-side helpers of the per-turn reduction: the same bits as their plain numpy forms."""

from __future__ import annotations

import numpy as np

from icsd_audit.stats.accumulator import _splus_clusters
from icsd_audit.stats.turns import ClusterIndex, factorize, masked


def test_masked_is_np_where_bit_for_bit():
    rng = np.random.default_rng(0)
    for signed in (False, True):
        w = rng.random(5000)
        w[::5] = 0.0
        if signed:  # -0.0 * 0 = -0.0 and x * 0 = -0.0 for x < 0: np.where gives +0.0 there
            w[::7] = -0.0
            w[::9] = -rng.random(w[::9].size)
        m = rng.random(5000) < 0.5
        want = np.where(m, w, 0.0)
        assert masked(w, m).tobytes() == want.tobytes()
        assert masked(w, m, np.full(5000, 7.0)).tobytes() == want.tobytes()


def test_count_where_counts_each_cluster():
    rng = np.random.default_rng(1)
    runs = np.repeat(np.arange(40), rng.integers(1, 30, 40))  # turns arrive as runs (reduceat path)
    for keys in (runs, rng.permutation(runs)):  # and interleaved (bincount path)
        cidx = ClusterIndex(keys)
        mask = rng.random(keys.size) < 0.3
        ids = cidx.ids()
        want = np.array([mask[ids == c].sum() for c in range(cidx.n)])
        got = cidx.count_where(mask)
        assert got.dtype == np.int32 and np.array_equal(got, want)


def test_splus_clusters_equal_the_two_key_clusters():
    # the shortcut (advantage constant over each turn) must give the clusters, order and sums of
    # ClusterIndex(turn, advantage); changing advantages and interleaved turns take the general path
    rng = np.random.default_rng(2)
    cl = np.repeat(np.arange(50), rng.integers(1, 20, 50))
    a = rng.normal(size=50)[cl]
    a[cl == 3] = np.where(np.arange((cl == 3).sum()) % 2, 0.0, -0.0)  # +0.0 and -0.0 are one value
    changing = a.copy()
    changing[cl == 7] = np.arange((cl == 7).sum())
    perm = rng.permutation(cl.size)
    v = rng.random(cl.size)
    for c, x, vv in ((cl, a, v), (cl, changing, v), (cl[perm], a[perm], v[perm])):
        ref = ClusterIndex(c, factorize(x)[0])
        got = _splus_clusters(c, x)
        assert got.n == ref.n and np.array_equal(got.first, ref.first)
        assert got.sum(vv).tobytes() == ref.sum(vv).tobytes()
        assert np.array_equal(got.count(), ref.count())
