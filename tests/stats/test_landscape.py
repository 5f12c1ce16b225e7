"""Landscape intensity (paper eq. normalized_allocation_intensity) against a slow reference."""

from __future__ import annotations

import json

import numpy as np
import pytest

from icsd_audit import stats
from icsd_audit.tokens import Weights
from tests.stats.test_api import make_tokens, ref_bins, split_call


def ref_landscape(d, w, grid, env=None):
    sel = [i for i in range(d["delta"].size) if d["valid"][i] and (env is None or d["env"][i] == env)]
    dv = [float(d["delta"][i]) for i in sel]
    av = [float(d["advantage"][i]) for i in sel]
    bi, bj = ref_bins(dv, grid), ref_bins(av, grid)
    n = len(sel)
    mean_all = sum(d[w][i] for i in sel) / n
    cell_sum, cell_n = {}, {}
    for k, i in enumerate(sel):
        key = (bi[k], bj[k])
        cell_sum[key] = cell_sum.get(key, 0.0) + d[w][i]
        cell_n[key] = cell_n.get(key, 0) + 1
    out = np.full((grid, grid), np.nan)
    for key, s in cell_sum.items():
        out[key] = (s / cell_n[key]) / mean_all
    dens = np.zeros((grid, grid))
    for key, c in cell_n.items():
        dens[key] = c / n
    return out, dens


def test_landscape_matches_reference_per_env():
    d = make_tokens(8, n_batches=4)
    tokens, weights, _ = split_call(d)
    res = stats.landscape(tokens, weights, env=d["env"], grid=6)
    assert set(res.envs) == {"alfworld", "webshop"}
    for env, gridres in res.envs.items():
        for w, name in (("g", "sdar"), ("c", "icsd")):
            ref, dens = ref_landscape(d, w, 6, env)
            np.testing.assert_allclose(gridres.intensity[name], ref, rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(gridres.density, dens, rtol=0, atol=1e-15)
        assert abs(np.nansum(gridres.intensity["icsd"] * gridres.density) - 1) < 1e-9
        sel = d["valid"] & (d["env"] == env)
        for name in ("delta", "advantage"):
            x = d[name][sel]
            assert gridres.zero_rank[name] == ((x < 0).sum() + (x == 0).sum() / 2) / x.size
    # without env: one grid keyed None; JSON-able
    res = stats.landscape(tokens.replace(valid=None), weights, grid=4)
    assert list(res.envs) == [None]
    json.dumps(res.to_dict())


def test_landscape_accumulator_equals_one_call():
    d = make_tokens(9, n_batches=4, shuffle=False)
    acc = stats.LandscapeAccumulator(grid=5)
    for b in np.unique(d["batch_id"]):
        s = d["batch_id"] == b
        tokens, weights, _ = split_call({k: v[s] for k, v in d.items()})
        acc.add(tokens, weights, env=d["env"][s])
    a = acc.finalize()
    tokens, weights, _ = split_call(d)
    b = stats.landscape(tokens.replace(columns={"env": d["env"]}), weights, env="env", grid=5)
    for env in a.envs:
        np.testing.assert_allclose(a.envs[env].intensity["icsd"], b.envs[env].intensity["icsd"], rtol=1e-12)


def test_landscape_errors():
    d = make_tokens(2)
    tokens, weights, _ = split_call(d)
    tokens = tokens.replace(valid=None)
    with pytest.raises(ValueError, match="grid"):
        stats.landscape(tokens, weights, grid=0)
    bad = d["c"].copy()
    bad[5] = np.inf
    with pytest.raises(ValueError, match="icsd: non-finite value inf at row 5"):
        stats.landscape(tokens, Weights(d["g"], bad))
    acc = stats.LandscapeAccumulator()
    acc.add(tokens, weights)
    with pytest.raises(ValueError, match="env"):
        acc.add(tokens, weights, env=d["env"])
    with pytest.raises(ValueError, match="no valid tokens"):
        stats.landscape(tokens.replace(valid=np.zeros(d["delta"].size, bool)), weights)
    with pytest.raises(ValueError, match="labelled"):
        acc.add(tokens, Weights(d["g"], d["c"], compare_name="fisher"))
    with pytest.raises(KeyError, match="no 'env' column"):
        stats.landscape(tokens, weights, env="env")


# --------------------------------------------------------------------------- smoothing and region multipliers


def ref_smoothed(raw_sum: np.ndarray, raw_n: np.ndarray, mean: float, bandwidth: float) -> np.ndarray:
    """Nadaraya-Watson with a Gaussian kernel (sd = bandwidth in rank units), truncated at 3 sd, by loops."""
    G = raw_n.shape[0]
    h = bandwidth * G
    r = int(np.ceil(3 * h))
    out = np.full((G, G), np.nan)
    for i in range(G):
        for j in range(G):
            num = den = 0.0
            for k in range(G):
                for m in range(G):
                    if abs(i - k) <= r and abs(j - m) <= r:
                        kw = np.exp(-0.5 * ((i - k) / h) ** 2) * np.exp(-0.5 * ((j - m) / h) ** 2)
                        num += kw * raw_sum[k, m]
                        den += kw * raw_n[k, m]
            if den > 0:
                out[i, j] = num / den / mean
    return out


@pytest.mark.parametrize("bandwidth", [0.05, 0.2])
def test_smoothed_intensity_matches_loop_reference(bandwidth):
    d = make_tokens(8, n_batches=4)
    tokens, weights, _ = split_call(d)
    res = stats.landscape(tokens, weights, env=d["env"], grid=6, bandwidth=bandwidth, n_resamples=0)
    for env, g in res.envs.items():
        for w, name in (("g", "sdar"), ("c", "icsd")):
            raw = np.nan_to_num(g.intensity[name]) * g.mean[name] * g.counts  # back to cell sums
            want = ref_smoothed(raw, g.counts, g.mean[name], bandwidth)
            np.testing.assert_allclose(g.smoothed[name], want, rtol=1e-10, atol=1e-12)
        assert g.regions is None  # n_resamples=0
    assert res.to_dict()["smoothing"]["bandwidth"] == bandwidth


def test_region_multipliers_hand_worked():
    # one env, one batch, 10 turns of one token each: delta = advantage rank order 1..10
    # (scaled mid-ranks 0.05, 0.15, ..., 0.95); top fifth = the last two tokens.
    delta = np.array([-5, -4, -3, -2, -1, 1, 2, 3, 4, 5], dtype=np.float64)
    adv = np.array([-5, -4, -3, -2, -1, 1, 2, 3, 4, 5], dtype=np.float64)
    # trusted_opposed needs delta in the top fifth with A < 0: make token 8 (delta 4) opposed
    adv[8] = -10.0  # now advantage ranks change: token 8 is the lowest advantage
    g = np.ones(10)
    c = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0.5, 3.0])
    from icsd_audit.tokens import Tokens

    t = Tokens(advantage=adv, ratio=np.ones(10), delta=delta, traj_id=np.arange(10), turn_id=np.zeros(10, int))
    res = stats.landscape(t, Weights(g, c), grid=5, n_resamples=300, rng=1)
    regs = res.envs[None].regions
    # trusted_supported: token 9 only (delta rank 0.95, advantage rank 0.95, both > 0);
    # multiplier = c_9 / mean c = 3.0 / (11.5 / 10) = 2.6087; under g: 1
    ts = regs["trusted_supported"]
    assert ts.n_tokens == 1 and ts.token_share == pytest.approx(0.1)
    assert ts.compare.estimate == pytest.approx(3.0 / 1.15) and ts.base.estimate == pytest.approx(1.0)
    assert ts.ratio.estimate == pytest.approx(3.0 / 1.15)
    # trusted_opposed: token 8 (delta rank 0.85 >= 0.8, delta > 0, A < 0): 0.5 / 1.15
    to = regs["trusted_opposed"]
    assert to.n_tokens == 1 and to.compare.estimate == pytest.approx(0.5 / 1.15)
    for r in (ts, to):
        assert r.compare.ci_low <= r.compare.estimate <= r.compare.ci_high
        assert r.base.ci_low == r.base.ci_high == 1.0  # uniform g: 1 on every resample where defined
    d = res.to_dict()["envs"][0]["regions"]["trusted_supported"]
    assert d["icsd"]["estimate"] == pytest.approx(3.0 / 1.15) and "definition" in d


def test_existing_landscape_json_keys_unchanged():
    d = make_tokens(3, n_batches=3)
    tokens, weights, _ = split_call(d)
    new = stats.landscape(tokens, weights, env=d["env"], grid=5, n_resamples=200, rng=0).to_dict()
    old_keys = {"base", "compare", "grid", "axes", "envs"}
    assert old_keys <= set(new) and set(new) - old_keys == {"smoothing"}
    for g in new["envs"]:
        assert {"env", "n_tokens", "grid", "intensity", "mean", "density", "counts", "zero_rank"} <= set(g)
        assert set(g) - {"env", "n_tokens", "grid", "intensity", "mean", "density", "counts", "zero_rank"} == {
            "smoothed_intensity", "regions"}
    json.dumps(new, allow_nan=False)


# --------------------------------------------------------------------------- exact ranks from a first pass


@pytest.mark.parametrize("seed", range(4))
def test_rank_edges_give_the_midrank_bins_and_region_thresholds(seed):
    from icsd_audit.stats.landscape import LandscapeRanks, scaled_midranks

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    # big ties, exact zeros, float32 values, a few distinct ones
    x = rng.choice(np.r_[rng.normal(size=40), 0.0, -1.5, 2.0], n).astype(np.float32)
    x[rng.random(n) < 0.3] = rng.normal(size=int((rng.random(n) < 0.3).sum()) or 1)[0]
    a = rng.choice([-1.0, 0.0, 0.5, 3.0], n)
    ranks = LandscapeRanks(grid=int(rng.integers(1, 30)))
    for part in np.array_split(np.arange(n), 5):  # several batches
        ranks.add(x[part], a[part])
    e = ranks.finalize()[None]
    G = ranks.grid
    for vals, edges, top, name in ((x, e.delta, e.delta_top, "delta"), (a, e.advantage, e.advantage_top, "advantage")):
        assert np.array_equal(np.searchsorted(edges, vals, side="right"), stats.midrank_bins(vals, G))
        assert np.array_equal(vals >= top, scaled_midranks(vals) >= 0.8)
        assert e.zero_rank[name] == (float((vals < 0).sum()) + 0.5 * float((vals == 0).sum())) / n
    assert e.n == n


def ref_regions(d, w, env=None):
    """The region multipliers' point estimates by the definition: scaled mid-ranks of all the env's tokens."""
    from icsd_audit.stats.landscape import scaled_midranks

    sel = d["valid"] & (True if env is None else d["env"] == env)
    dl, a, x = d["delta"][sel], d["advantage"][sel], d[w][sel].astype(np.float64)
    qt, qr = scaled_midranks(dl), scaled_midranks(a)
    regions = {"trusted_supported": (qt >= 0.8) & (qr >= 0.8) & (dl > 0) & (a > 0),
               "trusted_opposed": (qt >= 0.8) & (dl > 0) & (a < 0)}
    return {k: (int(m.sum()), (x[m].sum() / m.sum()) / (x.sum() / x.size) if m.any() else np.nan)
            for k, m in regions.items()}


@pytest.mark.parametrize("seed", [1, 5])
def test_streamed_landscape_equals_the_definition_and_the_in_memory_path(seed):
    from icsd_audit.stats.landscape import LandscapeAccumulator, LandscapeRanks

    d = make_tokens(seed, n_batches=5)
    parts = []
    for b in np.unique(d["batch_id"]):
        s = d["batch_id"] == b
        tokens, weights, _ = split_call({k: v[s] for k, v in d.items()})
        parts.append((tokens, weights, d["env"][s]))
    ranks = LandscapeRanks(grid=6)  # the first pass: values only
    for tokens, _, env in parts:
        ranks.add(tokens.delta, tokens.advantage, env=env, valid=tokens.valid)
    streamed = LandscapeAccumulator(grid=6, ranks=ranks.finalize())
    kept = LandscapeAccumulator(grid=6)
    for tokens, weights, env in parts:
        streamed.add(tokens, weights, env=env)
        kept.add(tokens, weights, env=env)
    a = streamed.finalize(n_resamples=300, rng=4, workers=2).to_dict()
    assert a == kept.finalize(n_resamples=300, rng=4).to_dict()
    res = streamed.finalize(n_resamples=300, rng=4)
    for env, g in res.envs.items():
        ref, dens = ref_landscape(d, "c", 6, env)
        np.testing.assert_allclose(g.intensity["icsd"], ref, rtol=1e-12)
        assert np.array_equal(g.counts, np.round(dens * g.n_tokens).astype(int))
        for w, side in (("g", "base"), ("c", "compare")):
            for name, (count, mult) in ref_regions(d, w, env).items():
                r = g.regions[name]
                assert r.n_tokens == count
                got = getattr(r, side).estimate
                assert (np.isnan(mult) and np.isnan(got)) or got == pytest.approx(mult, rel=1e-12)
