"""Token strata (SPEC 11) in the library: edges, bins, edge cases, and the bootstrap shared with tcm."""

from __future__ import annotations

import numpy as np
import pytest

from icsd_audit import Tokens, Weights, strata, tcm
from icsd_audit.stats.strata import StrataSpec, strata_bins, strata_edges, turn_positions


def _tokens(n_turns: int = 40, per_turn: int = 12, seed: int = 0, **cols: np.ndarray) -> tuple[Tokens, Weights]:
    rng = np.random.default_rng(seed)
    n = n_turns * per_turn
    turn_of = np.repeat(np.arange(n_turns), per_turn)
    adv = np.repeat(rng.choice([-1.0, -0.5, 0.5, 1.0], n_turns), per_turn)
    delta = rng.normal(0, 1, n)
    g = rng.uniform(0.1, 1.0, n)
    c = rng.uniform(0.0, 2.0, n)
    t = Tokens(advantage=adv, ratio=np.ones(n), delta=delta, traj_id=turn_of // 2, turn_id=turn_of % 2,
               batch_id=turn_of // 10, columns={"pos": np.tile(np.arange(per_turn), n_turns), **cols})
    return t, Weights(g, c)


def test_edges_and_bins_follow_spec_11() -> None:
    x = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 2.0, 3.0])  # a discrete covariate with ties
    e = strata_edges(x, StrataSpec("pos", bins=10))
    # quantiles at 0.1 .. 0.9 by linear interpolation, by hand: positions 0.9 k over the sorted sample
    by_hand = []
    s = np.sort(x)
    for k in range(1, 10):
        h = (x.size - 1) * k / 10
        lo = int(np.floor(h))
        by_hand.append(s[lo] + (h - lo) * (s[min(lo + 1, x.size - 1)] - s[lo]))
    distinct = sorted(set(np.round(by_hand, 12).tolist()))  # duplicates dropped: fewer than 10 bins
    assert e.tolist() == pytest.approx(distinct, abs=1e-12)
    assert e.size < 9 and e[0] == 0.0
    # a token's bin is the number of edges <= x: a value equal to an edge goes up
    assert strata_bins(np.array([-1.0, 0.0, 0.5, 1.0, 3.0]), e).tolist() == [
        sum(v <= xi for v in e) for xi in (-1.0, 0.0, 0.5, 1.0, 3.0)]
    assert strata_edges(x, StrataSpec("pos", top=0.2)).tolist() == [np.quantile(x, 0.8)]
    assert strata_edges(x, StrataSpec("pos", bins=1)).size == 0


def test_bins_by_comparison_are_the_binary_searchs() -> None:
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.normal(size=5_000), [np.nan, -np.inf, np.inf, 0.0, -0.0]])
    for k in (0, 1, 9, 32, 40):  # up to 32 edges by comparisons, more by np.searchsorted
        e = np.unique(rng.normal(size=k))
        e = np.concatenate([e, x[:3]]) if k == 9 else e  # edges equal to values: the value goes up
        e = np.unique(e)
        assert strata_bins(x, e).tolist() == np.searchsorted(e, x, side="right").tolist()


def test_per_turn_sums_are_the_whole_batch_sums_with_zeros_bit_for_bit() -> None:
    """Each TCM set summed over its own tokens gives the bits of summing every token with 0 off the set."""
    from icsd_audit.stats.strata import StrataAccumulator

    t, w = _tokens(n_turns=60, per_turn=9, seed=2)
    rng = np.random.default_rng(2)
    base = np.where(rng.random(len(t)) < 0.2, 0.0, w.base)
    w = Weights(base, w.compare)
    x = np.asarray(t.delta, dtype=np.float64)
    spec = StrataSpec("abs_delta", bins=4)
    edges = strata_edges(np.abs(x), spec)
    acc = StrataAccumulator(spec=spec, edges=edges)
    acc.add(t, w, x=np.abs(x))
    got = np.asarray(acc.family().sums).T  # (bins x 7, turns)
    turn = np.asarray(t.traj_id) * 2 + np.asarray(t.turn_id)
    nb = edges.size + 1
    key = turn * nb + np.searchsorted(edges, np.abs(x), side="right")
    u = np.asarray(t.advantage) * np.asarray(t.ratio) * x
    act = (x > 0) & (np.abs(u) > 1e-4)
    neg = act & (u < 0)
    for q, col in enumerate((np.ones(len(t)), w.base, w.compare, np.where(neg, w.base, 0.0), np.where(act, w.base, 0.0),
                             np.where(neg, w.compare, 0.0), np.where(act, w.compare, 0.0))):
        ref = np.bincount(key, weights=col, minlength=60 * nb).reshape(60, nb).T
        assert got[q::7].tobytes() == np.ascontiguousarray(ref).tobytes()


def test_spec_names_hold_the_covariate_and_k_or_q() -> None:
    assert StrataSpec("entropy").name == "strata:entropy:K10"
    assert StrataSpec("logp", bins=5).name == "strata:logp:K5"
    assert StrataSpec("entropy", top=0.2).name == "strata:entropy:top0.2"
    for bad in (dict(bins=0), dict(top=0.0), dict(top=1.0), dict(bins=3, top=0.2)):
        with pytest.raises(ValueError):
            StrataSpec("logp", **bad)


def test_turn_positions_count_rows_of_each_turn_in_order() -> None:
    batch = np.array([0, 0, 0, 0, 1, 1, 0])
    traj = np.array([0, 0, 1, 0, 0, 0, 1])
    turn = np.array([0, 0, 0, 0, 0, 0, 0])
    assert turn_positions(batch, traj, turn).tolist() == [0, 1, 0, 2, 0, 1, 1]


def test_pos_without_a_pos_column_is_the_index_within_the_turn() -> None:
    t, w = _tokens()
    with_col = strata(t, w, by="pos", bins=4, n_resamples=200, rng=1)
    without = strata(t.replace(columns={}), w, by="pos", bins=4, n_resamples=200, rng=1)
    assert with_col == without


def test_one_bin_is_tcm_on_the_same_resamples() -> None:
    """K = 1: the single bin's TCM is SPEC 6's TCM, and its interval is tcm's (one resample stream per layout)."""
    t, w = _tokens(seed=3)
    one = strata(t, w, by="abs_delta", bins=1, n_resamples=400, rng=5)
    ref = tcm(t, w, n_resamples=400, rng=5)
    b = one.bins[0]
    for got, want in ((b.tcm.base, ref.base), (b.tcm.compare, ref.compare), (b.tcm.diff, ref.diff)):
        assert got.estimate == pytest.approx(want.estimate, abs=1e-12)
        assert got.ci_low == pytest.approx(want.ci_low, abs=1e-12)
        assert got.ci_high == pytest.approx(want.ci_high, abs=1e-12)
    assert b.share.base.estimate == pytest.approx(1.0) and b.intensity_base.estimate == pytest.approx(1.0)


def test_hand_sums_intensity_and_invalid_rows() -> None:
    t, w = _tokens(seed=4)
    valid = np.ones(len(t), dtype=bool)
    valid[::7] = False
    x = np.random.default_rng(9).normal(size=len(t))
    t = t.replace(valid=valid)
    res = strata(t, w, by="logp", x=x, bins=3, n_resamples=300, rng=0)
    xv, gv, cv = x[valid], w.base[valid], w.compare[valid]
    e = np.quantile(xv, [1 / 3, 2 / 3])
    b = np.array([int((e <= xi).sum()) for xi in xv])
    u = (t.advantage * t.ratio * t.delta)[valid]
    act = (t.delta[valid] > 0) & (np.abs(u) > 1e-4)
    for k, r in enumerate(res.bins):
        sel = b == k
        assert r.n_tokens == sel.sum()
        assert r.share.base.estimate == pytest.approx(gv[sel].sum() / gv.sum(), rel=1e-12)
        assert r.intensity_compare.estimate == pytest.approx((cv[sel].sum() / cv.sum()) / sel.mean(), rel=1e-12)
        assert r.intensity_base.ci_low <= r.intensity_base.estimate <= r.intensity_base.ci_high
        want = gv[sel & act & (u < 0)].sum() / gv[sel & act].sum()
        assert r.tcm.base.estimate == pytest.approx(want, rel=1e-12)


def test_a_bin_without_active_tokens_has_no_tcm_and_says_why() -> None:
    t, w = _tokens(seed=6)
    x = t.delta.copy()  # bin by delta itself: the lowest bins hold delta <= 0 only
    res = strata(t, w, by="abs_delta", x=x, bins=4, n_resamples=100, rng=0)
    low = res.bins[0]
    assert np.isnan(low.tcm.base.estimate) and np.isnan(low.tcm.diff.ci_low)
    assert low.tcm_undefined == "no token has delta > 0, i.e. the teacher rates no sampled token above the student"
    assert res.to_dict()["bins"][0]["tcm"]["base"] == {"estimate": None, "ci_low": None, "ci_high": None}
    assert res.bins[-1].tcm_undefined is None


def test_an_empty_bin_between_edges() -> None:
    """Linear quantiles of a gappy sample give bins that hold no token: shares 0, TCM and intensity n/a."""
    t, w = _tokens(n_turns=4, per_turn=5, seed=7)
    x = np.where(np.arange(len(t)) < 10, 0.0, 100.0)
    x[0], x[-1] = -1.0, 101.0
    res = strata(t, w, by="logp", x=x, bins=10, n_resamples=50, rng=0)
    empty = [b for b in res.bins if b.n_tokens == 0]
    assert empty, [b.n_tokens for b in res.bins]
    for b in empty:
        assert b.token_share.estimate == 0.0 and b.share.base.estimate == 0.0
        assert np.isnan(b.intensity_base.estimate) and b.tcm_undefined == "no valid token"
    assert sum(b.n_tokens for b in res.bins) == len(t)


def test_non_finite_covariate_is_refused() -> None:
    t, w = _tokens()
    x = np.zeros(len(t))
    x[5] = np.inf
    with pytest.raises(ValueError, match="logp: non-finite value inf at row 5"):
        strata(t, w, by="logp", x=x, n_resamples=10)
