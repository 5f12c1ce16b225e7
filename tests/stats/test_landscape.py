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
