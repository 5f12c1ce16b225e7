"""Audit statistics (SPEC 6) against slow pure-Python references, and their contracts."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest

from icsd_audit import stats
from icsd_audit.stats.api import REGIONS, shift_bin_labels
from icsd_audit.tokens import Tokens, Weights

TOL = 1e-9  # the contract is 1e-6


# --------------------------------------------------------------------------- data


def make_tokens(seed: int, n_batches: int = 3, shuffle: bool = True, float32: bool = True) -> dict[str, np.ndarray]:
    """Random batches with ties, exact zeros, clip-boundary ratios and a validity mask.

    ``compare`` is an ICSD-like allocation: c = g on the fallback set D =
    {advantage < 0, delta < 0}, elsewhere g * m rescaled to keep each turn's mass.
    """
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {k: [] for k in ("batch_id", "traj_id", "turn_id", "advantage", "delta", "ratio", "valid", "env", "step")}
    for b in range(n_batches):
        for t in range(int(rng.integers(3, 7))):
            env = int(rng.integers(0, 2))
            for q in range(int(rng.integers(1, 6))):
                n_tok = int(rng.integers(1, 12))
                adv = float(rng.choice([0.0, 0.5, -0.5, 1.25, -2.0, rng.normal()]))  # ties and zeros
                for _ in range(n_tok):
                    cols["batch_id"].append(10 + b)
                    cols["traj_id"].append(1000 + t)
                    cols["turn_id"].append(q)
                    cols["advantage"].append(adv)
                    cols["delta"].append(float(rng.choice([0.0, 0.25, -0.25, rng.normal(), rng.normal(), 1e-6])))
                    cols["ratio"].append(float(rng.choice([1.0, 1.2, 0.8, 3.5, 0.5, 1 + 0.1 * rng.normal(), 1.3])))
                    cols["valid"].append(bool(rng.random() > 0.1))
                    cols["env"].append(["alfworld", "webshop"][env])
                    cols["step"].append(b % 2)
    out = {k: np.asarray(v) for k, v in cols.items()}
    ft = np.float32 if float32 else np.float64
    for k in ("advantage", "delta", "ratio"):
        out[k] = out[k].astype(ft)
    out["batch_id"] = out["batch_id"].astype(np.int64)
    out["traj_id"] = out["traj_id"].astype(np.int64)
    out["turn_id"] = out["turn_id"].astype(np.int32)
    n = out["delta"].size
    d64 = out["delta"].astype(np.float64)
    g = 1.0 / (1.0 + np.exp(-5.0 * d64))
    m = rng.random(n)
    D = (out["advantage"] < 0) & (out["delta"] < 0)
    key = (out["batch_id"] * 100000 + out["traj_id"]) * 1000 + out["turn_id"]
    _, inv = np.unique(key, return_inverse=True)
    C = out["valid"] & ~D
    sg = np.bincount(inv, weights=np.where(C, g, 0.0))
    sgm = np.bincount(inv, weights=np.where(C, g * m, 0.0))
    alpha = np.where(sgm > 1e-4, sg / np.where(sgm > 0, sgm, 1), np.nan)[inv]
    c = np.where(D | np.isnan(alpha), g, alpha * g * m)
    out["g"] = np.where(out["valid"], g, 0.0)
    out["c"] = np.where(out["valid"], c, 0.0)
    if shuffle:
        perm = rng.permutation(n)
        out = {k: v[perm] for k, v in out.items()}
    return out


_TOKEN_KEYS = ("delta", "advantage", "ratio", "traj_id", "turn_id", "batch_id", "valid", "u")


def split_call(d: dict[str, np.ndarray], **extra) -> tuple[Tokens, Weights, dict]:
    """(tokens, weights, options) of the random columns ``d``; ``extra`` overrides any of them."""
    cols = {k: d[k] for k in ("delta", "advantage", "ratio", "traj_id", "turn_id", "batch_id", "valid")}
    cols.update({k: v for k, v in extra.items() if k in _TOKEN_KEYS})
    tokens = Tokens(**cols)
    names = {k: extra[k] for k in ("base_name", "compare_name") if k in extra}
    weights = Weights(extra.get("base", d["g"]), extra.get("compare", d["c"]), **names)
    options = dict(n_resamples=400, rng=0)
    options.update({k: v for k, v in extra.items() if k not in _TOKEN_KEYS + ("base", "compare", "base_name", "compare_name")})
    return tokens, weights, options


def run(fn, d: dict[str, np.ndarray], **extra):
    """Call statistic ``fn`` on the random columns ``d`` as ``fn(tokens, weights, **options)``."""
    tokens, weights, options = split_call(d, **extra)
    return fn(tokens, weights, **options)


# --------------------------------------------------------------------------- slow references


def tokens(d, sel=None):
    n = d["delta"].size
    for i in range(n):
        if not d["valid"][i]:
            continue
        if sel is not None and not sel[i]:
            continue
        yield {k: v[i] for k, v in d.items()}


def ref_tcm(d, w, eps=1e-4, sel=None):
    num = den = 0.0
    for t in tokens(d, sel):
        u = float(t["advantage"]) * float(t["ratio"]) * float(t["delta"])
        if t["delta"] > 0 and abs(u) > eps:
            den += t[w]
            if u < 0:
                num += t[w]
    return num / den


def region_of(t):
    dl, a = t["delta"], t["advantage"]
    if dl == 0 or a == 0:
        return "neutral"
    return ("pos" if dl > 0 else "neg") + "_delta_" + ("pos" if a > 0 else "neg") + "_adv"


def ref_quadrants(d, w, sel=None):
    tot = 0.0
    acc = {r: 0.0 for r in REGIONS}
    for t in tokens(d, sel):
        tot += t[w]
        acc[region_of(t)] += t[w]
    return {r: v / tot for r, v in acc.items()}


def ref_bins(values, n_bins):
    """bin of each value: floor(n_bins * (midrank - 1/2) / n), exact rationals."""
    n = len(values)
    out = []
    for v in values:
        below = sum(1 for x in values if x < v)
        equal = sum(1 for x in values if x == v)
        midrank = Fraction(2 * below + equal + 1, 2)
        out.append(min(n_bins - 1, math.floor(n_bins * (midrank - Fraction(1, 2)) / n)))
    return out


def ref_shift(d, n_bins=5):
    sp = [t for t in tokens(d) if t["delta"] > 0]
    labels = shift_bin_labels(n_bins)
    neg = [t for t in sp if t["advantage"] < 0]
    pos = [t for t in sp if t["advantage"] > 0]
    bin_of = {}
    for t, b in zip(neg, ref_bins([float(t["advantage"]) for t in neg], n_bins)):
        bin_of[id(t)] = labels[b]
    for t, b in zip(pos, ref_bins([float(t["advantage"]) for t in pos], n_bins)):
        bin_of[id(t)] = labels[n_bins + 1 + b]
    out = {}
    for w in ("g", "c"):
        tot = sum(t[w] for t in sp)
        out[w] = {lab: sum(t[w] for t in sp if bin_of.get(id(t), "zero") == lab) / tot for lab in labels}
    return out


def ref_clip(d, w, clip=0.2, dual=3.0):
    lo, hi = np.float32(1 - clip), np.float32(1 + clip)
    n = n_out = n_flat = n_cap = 0
    tw = ow = fw = twd = owd = fwd = 0.0
    for t in tokens(d):
        r, a = t["ratio"], t["advantage"]
        lo_, hi_ = (lo, hi) if r.dtype == np.float32 else (1 - clip, 1 + clip)
        out = r < lo_ or r > hi_
        cap = a < 0 and r > dual
        flat = (a > 0 and r > hi_) or (a < 0 and r < lo_) or cap
        wd = t[w] * abs(float(t["delta"]))
        n += 1
        n_out += out
        n_flat += flat
        n_cap += cap
        tw += t[w]
        twd += wd
        if out:
            ow += t[w]
            owd += wd
        if flat:
            fw += t[w]
            fwd += wd
    return dict(out_tokens=n_out / n, flat_tokens=n_flat / n, cap=n_cap, out_mass=ow / tw, flat_mass=fw / tw,
                out_absd=owd / twd, flat_absd=fwd / twd, n_out=n_out, n_flat=n_flat)


# --------------------------------------------------------------------------- point estimates


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_tcm_matches_reference(seed, shuffle):
    d = make_tokens(seed, shuffle=shuffle)
    r = run(stats.tcm, d)
    assert abs(r.base.estimate - ref_tcm(d, "g")) < TOL
    assert abs(r.compare.estimate - ref_tcm(d, "c")) < TOL
    assert abs(r.diff.estimate - (ref_tcm(d, "c") - ref_tcm(d, "g"))) < TOL
    assert r.n_tokens == int(d["valid"].sum())
    assert r.n_batches == 3
    turns = {(b, t, q) for b, t, q, v in zip(d["batch_id"], d["traj_id"], d["turn_id"], d["valid"]) if v}
    assert r.n_turns == len(turns)


def test_tcm_eps_and_given_u():
    d = make_tokens(3)
    for eps in (0.0, 1e-4, 0.05):
        r = run(stats.tcm, d, eps=eps)
        assert abs(r.base.estimate - ref_tcm(d, "g", eps=eps)) < TOL
    # a supplied u replaces advantage * ratio * delta
    u = -(d["advantage"].astype(np.float64) * d["ratio"] * d["delta"])
    r = run(stats.tcm, d, u=u)
    flipped = dict(d, advantage=-d["advantage"])
    assert abs(r.compare.estimate - ref_tcm(flipped, "c")) < TOL


@pytest.mark.parametrize("seed", [0, 4])
def test_quadrants_match_reference_and_double_negative_is_exactly_zero(seed):
    d = make_tokens(seed)
    r = run(stats.quadrants, d)
    rg, rc = ref_quadrants(d, "g"), ref_quadrants(d, "c")
    for reg in REGIONS:
        p = r.regions[reg]
        assert abs(p.base.estimate - rg[reg]) < TOL
        assert abs(p.compare.estimate - rc[reg]) < TOL
    nn = r.regions["neg_delta_neg_adv"].diff
    assert nn.estimate == 0.0 and nn.ci_low == 0.0 and nn.ci_high == 0.0 and nn.standard_error == 0.0
    assert abs(sum(rg.values()) - 1) < 1e-12
    assert sum(r.region_tokens.values()) == r.n_tokens
    # other regions genuinely move
    assert abs(r.regions["pos_delta_pos_adv"].diff.estimate) > 1e-4


def test_double_negative_not_forced_when_masses_differ():
    d = make_tokens(5)
    c2 = d["c"] * 1.5  # no longer turn-mass matched: the shares differ for real
    r = run(stats.quadrants, dict(d, c=c2))
    ref = ref_quadrants(dict(d, c=c2), "c")["neg_delta_neg_adv"] - ref_quadrants(d, "g")["neg_delta_neg_adv"]
    assert abs(r.regions["neg_delta_neg_adv"].diff.estimate - ref) < TOL


@pytest.mark.parametrize("seed", [0, 6])
def test_share_shift_matches_reference(seed):
    d = make_tokens(seed)
    r = run(stats.share_shift, d)
    ref = ref_shift(d)
    for lab in shift_bin_labels():
        b = r.bins[lab]
        assert abs(b.base.estimate - ref["g"][lab]) < TOL
        assert abs(b.compare.estimate - ref["c"][lab]) < TOL
        assert abs(b.shift_pp.estimate - 100 * (ref["c"][lab] - ref["g"][lab])) < 1e-7
    assert sum(b.n_tokens for b in r.bins.values()) == r.n_splus_tokens
    assert abs(sum(b.base.estimate for b in r.bins.values()) - 1) < 1e-12


def test_midrank_bins_keep_ties_and_balance():
    from icsd_audit.stats.api import midrank_bins

    v = np.arange(100, dtype=float)
    assert np.bincount(midrank_bins(v, 5)).tolist() == [20] * 5
    v = np.array([1, 1, 1, 1, 2, 3, 3, 4, 5, 5, 5, 6], dtype=float)
    b = midrank_bins(v, 5)
    for x in np.unique(v):
        assert len(set(b[v == x].tolist())) == 1
    assert b.tolist() == ref_bins(v.tolist(), 5)
    from scipy.stats import rankdata

    rng = np.random.default_rng(0)
    w = rng.integers(0, 30, 1000).astype(float)  # heavy ties
    assert midrank_bins(w, 7).tolist() == np.floor(7 * (rankdata(w) - 0.5) / w.size).astype(int).tolist()
    # weights = token counts of each value: same as repeating the values
    vals, w = np.array([0.5, -1.0, 2.0]), np.array([3, 5, 2])
    assert midrank_bins(vals, 4, weights=w).tolist() == [midrank_bins(np.repeat(vals, w), 4)[np.repeat(np.arange(3), w) == i][0] for i in range(3)]


@pytest.mark.parametrize("seed", [0, 7])
def test_clip_exposure_matches_reference(seed):
    d = make_tokens(seed)
    r = run(stats.clip_exposure, d)
    for w, side in (("g", "base"), ("c", "compare")):
        ref = ref_clip(d, w)
        assert abs(r.outside.tokens.estimate - ref["out_tokens"]) < TOL
        assert abs(r.flat.tokens.estimate - ref["flat_tokens"]) < TOL
        assert abs(getattr(r.outside.mass, side).estimate - ref["out_mass"]) < TOL
        assert abs(getattr(r.flat.mass, side).estimate - ref["flat_mass"]) < TOL
        assert abs(getattr(r.outside.abs_delta_mass, side).estimate - ref["out_absd"]) < TOL
        assert abs(getattr(r.flat.abs_delta_mass, side).estimate - ref["flat_absd"]) < TOL
        assert r.dual_clip_cap_count == ref["cap"]
        assert r.outside.n_tokens == ref["n_out"] and r.flat.n_tokens == ref["n_flat"]
    rv = d["ratio"][d["valid"]].astype(np.float64)
    assert abs(r.ratio_mean - rv.mean()) < 1e-12 and abs(r.ratio_std - rv.std()) < 1e-12


def test_clip_boundary_uses_input_dtype():
    # float32 1.2 sits on the boundary in float32 (not outside), as in grads.compat.surrogate_flat
    n = 8
    kw = dict(delta=np.ones(n, np.float32), advantage=np.ones(n, np.float32), ratio=np.full(n, 1.2, np.float32),
              traj_id=np.arange(n), turn_id=np.zeros(n, np.int64))
    w = Weights(np.ones(n), np.ones(n))
    r = stats.clip_exposure(Tokens(**kw), w, n_resamples=50, rng=0)
    assert r.outside.n_tokens == 0 and r.flat.n_tokens == 0
    kw["ratio"] = np.full(n, 3.5, np.float32)
    kw["advantage"] = -np.ones(n, np.float32)
    r = stats.clip_exposure(Tokens(**kw), w, n_resamples=50, rng=0)
    assert r.dual_clip_cap_count == n and r.flat.n_tokens == n and r.dual_clip_cap.estimate == 1.0


# --------------------------------------------------------------------------- intervals, grouping, streaming


def all_results(res):
    out = []
    for name in ("tcm", "quadrants", "shift", "clip"):
        r = getattr(res, name)
        if r is None:
            continue
        d = r.to_dict()

        def walk(x):
            if isinstance(x, dict):
                if {"estimate", "ci_low", "ci_high"} <= set(x):
                    out.append(x)
                for v in x.values():
                    walk(v)

        walk(d)
    return out


def test_intervals_contain_estimates():
    d = make_tokens(10)
    res = run(stats.audit, d)
    trip = all_results(res)
    assert len(trip) > 50
    for t in trip:
        if t["estimate"] is None:
            continue
        assert t["ci_low"] <= t["estimate"] <= t["ci_high"], t


def test_json_contract_shapes():
    d = make_tokens(11)
    res = run(stats.audit, d, base_name="sdar", compare_name="icsd")
    j = json.loads(json.dumps(res.to_dict()))
    t = j["tcm"]
    for k in ("n_tokens", "n_turns", "n_batches", "sdar", "icsd", "diff"):
        assert k in t
    for side in ("sdar", "icsd", "diff"):
        assert {"estimate", "ci_low", "ci_high"} <= set(t[side])
    q = j["quadrants"]["regions"]
    assert list(q) == list(REGIONS)
    for reg in REGIONS:
        for side in ("sdar", "icsd", "diff"):
            assert {"estimate", "ci_low", "ci_high"} <= set(q[reg][side])
            assert 0 <= q[reg]["sdar"]["estimate"] <= 1  # fractions, not percent
    assert list(j["shift"]["bins"]) == list(shift_bin_labels())
    assert {"outside", "flat", "dual_clip_cap"} <= set(j["clip"])
    # other labels for the two weightings
    r = run(stats.tcm, d, base_name="sdar", compare_name="fisher")
    assert {"sdar", "fisher", "diff"} <= set(r.to_dict())
    with pytest.raises(ValueError):
        run(stats.tcm, d, base_name="diff")
    with pytest.raises(ValueError):
        run(stats.tcm, d, base_name="x", compare_name="x")


def test_by_group_equals_subset():
    d = make_tokens(12, n_batches=4)
    g = run(stats.tcm, d, by=d["step"], by_name="step")
    assert g.keys == (0, 1)
    j = g.to_dict()
    assert j["by"] == "step" and [x["key"] for x in j["groups"]] == [0, 1]
    for key in (0, 1):
        s = d["step"] == key
        sub = {k: v[s] for k, v in d.items()}
        alone = run(stats.tcm, sub)
        assert abs(g[key].base.estimate - alone.base.estimate) < 1e-12
        assert abs(g[key].compare.estimate - ref_tcm(d, "c", sel=s)) < TOL
        assert g[key].n_turns == alone.n_turns and g[key].n_batches == 2
    q = run(stats.quadrants, d, by=d["env"], by_name="env")
    assert q.keys == ("alfworld", "webshop")
    for key in q.keys:
        ref = ref_quadrants(d, "g", sel=d["env"] == key)
        for reg in REGIONS:
            assert abs(q[key].regions[reg].base.estimate - ref[reg]) < TOL
        assert q[key].regions["neg_delta_neg_adv"].diff.estimate == 0.0


def test_streaming_accumulator_equals_one_call():
    d = make_tokens(13, n_batches=4, shuffle=False)
    acc = stats.AuditAccumulator()
    for b in np.unique(d["batch_id"]):
        s = d["batch_id"] == b
        tokens, weights, _ = split_call({k: v[s] for k, v in d.items()})
        acc.add(tokens, weights)
    a = acc.finalize(n_resamples=300, rng=5).to_dict()
    b = run(stats.audit, d, n_resamples=300, rng=5).to_dict()
    assert a == b  # same turn order, same resamples: identical


def test_valid_mask_equals_filtering_and_torch_inputs():
    torch = pytest.importorskip("torch")
    d = make_tokens(14)
    r1 = run(stats.quadrants, d)
    v = d["valid"]
    sub = {k: x[v] for k, x in d.items()}
    r2 = run(stats.quadrants, sub, valid=None)
    for reg in REGIONS:
        assert abs(r1.regions[reg].compare.estimate - r2.regions[reg].compare.estimate) < 1e-12
    tk = {k: torch.from_numpy(np.ascontiguousarray(x)) for k, x in d.items() if x.dtype.kind != "U"}
    r3 = run(stats.quadrants, tk)
    assert r3.to_dict() == r1.to_dict()


def test_identical_weightings_have_zero_differences():
    d = make_tokens(15)
    res = run(stats.audit, dict(d, c=d["g"]))
    assert res.tcm.diff.estimate == 0.0 and res.tcm.diff.ci_low == 0.0 and res.tcm.diff.ci_high == 0.0
    for reg in REGIONS:
        assert res.quadrants.regions[reg].diff.ci_high == 0.0


def test_batch_unit_option():
    d = make_tokens(16, n_batches=6)
    r = run(stats.tcm, d, unit="batch")
    assert r.base.unit == "batch" and r.to_dict()["bootstrap"]["unit"] == "batch"
    assert r.base.ci_low <= r.base.estimate <= r.base.ci_high
    assert abs(r.base.estimate - ref_tcm(d, "g")) < TOL


# --------------------------------------------------------------------------- errors


def test_input_errors_name_column_and_row():
    d = make_tokens(17, shuffle=False)
    bad = d["delta"].copy()
    i = int(np.flatnonzero(d["valid"])[3])
    bad[i] = np.nan
    with pytest.raises(ValueError, match=rf"delta: non-finite value nan at row {i}$"):
        run(stats.tcm, dict(d, delta=bad))
    neg = d["c"].copy()
    neg[i] = -1.0
    with pytest.raises(ValueError, match=rf"icsd: negative weight -1.0 at row {i}"):
        run(stats.tcm, dict(d, c=neg))
    with pytest.raises(ValueError, match="ratio: length .* differs"):
        run(stats.tcm, dict(d, ratio=d["ratio"][:-1]))
    with pytest.raises(ValueError, match="integers"):
        run(stats.tcm, dict(d, turn_id=d["turn_id"].astype(float)))
    with pytest.raises(ValueError, match="n_resamples"):
        run(stats.tcm, d, n_resamples=0)
    with pytest.raises(ValueError, match="confidence_level"):
        run(stats.tcm, d, confidence_level=95)
    with pytest.raises(ValueError, match="no valid tokens"):
        run(stats.tcm, d, valid=np.zeros(d["delta"].size, bool))
    with pytest.raises(ValueError, match="unknown statistics"):
        stats.AuditAccumulator(statistics=("tcm", "nope"))
    with pytest.raises(ValueError, match="eps"):
        run(stats.tcm, d, eps=-1)
    # NaN on an invalid row is ignored (the row enters no statistic)
    j = int(np.flatnonzero(~d["valid"])[0])
    bad = d["delta"].copy()
    bad[j] = np.nan
    run(stats.tcm, dict(d, delta=bad))
